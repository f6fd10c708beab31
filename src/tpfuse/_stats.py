"""Counts of which backend and algorithm served each call, so users and tests see what ran.

Every eager call records one count, so recording takes no lock: each thread counts in its own
``Counter`` (only that thread writes it) and :func:`stats` adds them up.
"""

from __future__ import annotations

import collections
import threading

_lock = threading.Lock()  # guards the list of counters, not the counting
_this_thread = threading.local()
_counters: list[collections.Counter[str]] = []  # one a thread that has recorded


def _new_counter() -> collections.Counter[str]:
    counter = _this_thread.counter = collections.Counter()
    with _lock:
        _counters.append(counter)
    return counter


def record(key: str, count: int = 1) -> None:
    try:
        counter = _this_thread.counter
    except AttributeError:
        counter = _new_counter()
    counter[key] += count


def stats() -> dict[str, int]:
    """Calls served per ``"backend.algorithm"`` since start or the last :func:`reset_stats`.

    Counted when the Python op runs: eager calls and CUDA-graph captures, not graph replays.
    ``"compile.fused_sites"`` and ``"compile.unfused_sites"`` count what the compiler pass did.
    """
    total: collections.Counter[str] = collections.Counter()
    with _lock:
        for counter in _counters:
            total.update(counter.copy())
    return dict(total)


def reset_stats() -> None:
    """Set every count of :func:`stats` back to zero."""
    with _lock:
        for counter in _counters:
            counter.clear()
