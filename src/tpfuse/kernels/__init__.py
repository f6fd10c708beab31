"""Triton kernels of tpfuse, each beside its pure-torch reference (``reference.py``).

Kernel modules are imported lazily: Triton decides at decoration time whether a kernel runs
compiled or in its CPU interpreter (``TRITON_INTERPRET=1``), so the choice must be made before.
"""

from __future__ import annotations

import functools
import os

import torch


@functools.cache
def triton_installed() -> bool:
    """Whether Triton imports here (the core of tpfuse, its reference path and checks, needs none)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


# Read once, at import, as Triton reads it: a process runs its kernels compiled or interpreted throughout.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def interpreter_enabled() -> bool:
    return _INTERPRETED


def kernels_usable(device: torch.device) -> bool:
    """Whether the Triton kernels can run on ``device``: a CUDA GPU, or the CPU interpreter."""
    if device.type == "cuda":
        usable = not interpreter_enabled()
    else:
        usable = device.type == "cpu" and interpreter_enabled()
    return usable and triton_installed()


if interpreter_enabled() and triton_installed():  # CPU runs of any kernel get the GPU's semantics
    from tpfuse.kernels import interpreter

    interpreter.install()
