"""Counts of which backend and algorithm served each call, so users and tests see what ran."""

from __future__ import annotations

import collections
import threading

_lock = threading.Lock()
_counts: collections.Counter[str] = collections.Counter()


def record(key: str, count: int = 1) -> None:
    with _lock:
        _counts[key] += count


def stats() -> dict[str, int]:
    """Calls served per ``"backend.algorithm"`` since start or the last :func:`reset_stats`.

    Counted when the Python op runs: eager calls and CUDA-graph captures, not graph replays.
    ``"compile.fused_sites"`` and ``"compile.unfused_sites"`` count what the compiler pass did.
    """
    with _lock:
        return dict(_counts)


def reset_stats() -> None:
    """Set every count of :func:`stats` back to zero."""
    with _lock:
        _counts.clear()
