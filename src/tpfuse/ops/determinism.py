"""Batch-invariant mode: every path of the fused op gives a token the kernels' bits.

tpfuse's kernels (one-shot, two-shot, chunked calls, the local kernel) are batch-invariant always: a
row's outputs depend on its own inputs, the weights, the world size and the rank order, never on the
other rows of its call or the algorithm (docs/determinism.md). The paths that are not those kernels
(no communicator, float32 inputs, ``backend="reference"``, the FlashInfer backend, a call over the
workspace that cannot chunk) use the group's own all-reduce, whose summation order follows the
message size. In batch-invariant mode they gather every rank's part instead and sum in ascending rank
order in fp32, rounding once, then run the kernels' block end; the compiler keeps tpfuse's op at
every token count (no compile range hands a site back to the group's all-reduce).

The mode is on when :func:`set_batch_invariant` says so, else when the environment asks for it:
``TPFUSE_BATCH_INVARIANT=1``, or an engine's deterministic mode (``VLLM_BATCH_INVARIANT=1``,
``SGLANG_ENABLE_DETERMINISTIC_INFERENCE=1``). The environment is read once, at the first question.
"""

from __future__ import annotations

import os

__all__ = ["batch_invariant", "batch_invariant_source", "set_batch_invariant"]

#: The variables that turn the mode on (any one set to a true value), in the order they are named.
ENVIRONMENT = ("TPFUSE_BATCH_INVARIANT", "VLLM_BATCH_INVARIANT", "SGLANG_ENABLE_DETERMINISTIC_INFERENCE")

_set: bool | None = None  # set_batch_invariant's value; None: follow the environment
_from_env: str | None | bool = False  # the variable that turned the mode on, None for none; False: not read


def _true(value: str | None) -> bool:
    return value is not None and value.strip().lower() in ("1", "true", "yes", "on")


def _environment_source() -> str | None:
    global _from_env
    if _from_env is False:
        _from_env = next((name for name in ENVIRONMENT if _true(os.environ.get(name))), None)
    return _from_env


def batch_invariant() -> bool:
    """Whether batch-invariant mode is on (:func:`set_batch_invariant`, else the environment)."""
    if _set is not None:
        return _set
    return _environment_source() is not None


def batch_invariant_source() -> str | None:
    """What turned the mode on: ``"set_batch_invariant"``, the environment variable's name, or None
    where the mode is off (for logs)."""
    if _set is not None:
        return "set_batch_invariant" if _set else None
    return _environment_source()


def set_batch_invariant(enabled: bool | None) -> bool:
    """Turn batch-invariant mode on or off in this process (None: follow the environment again, read
    anew). Returns whether it was on. Every rank of a group must be in the same mode: the mode's
    fallback gathers where the plain one all-reduces.

    Call it before compiling a model: a compiled graph keeps the compile ranges it was built with.
    """
    global _set, _from_env
    was = batch_invariant()
    _set = None if enabled is None else bool(enabled)
    if enabled is None:
        _from_env = False
    return was
