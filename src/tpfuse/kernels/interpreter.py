"""Triton's CPU interpreter made fit for the shared-file workspace: whole-word 16-bit accesses, a clock.

The kernels detect a peer's data word by word: a 16-bit word has arrived once it no longer holds the
sentinel. That needs each word to be written and read in one piece. On a GPU it is (an aligned
16-bit access is one transaction). Triton's interpreter copies every element with ``memcpy`` of a
size known only at run time, and glibc may copy those two bytes one at a time: a rank polling a
word that a peer process is writing can read one new byte and one old byte, a value that is neither
the sentinel nor the data (with glibc 2.36, torn words appear within seconds of polling). So while a
shared-file workspace exists, 16-bit loads and stores of contiguous rows go through a numpy ufunc
instead, whose typed loop moves whole aligned words. Other accesses keep Triton's own path.

The kernels bound every wait with the GPU's timer (``vendor.now``, inline assembly: NVIDIA's
``%globaltimer`` in nanoseconds, AMD's ``s_memrealtime`` at the device's wall-clock rate), which the
interpreter cannot run; here either reads the host's monotonic clock instead, at the rate the host
side expects (``targets.cpu_timer_ticks``), so the bound holds in wall time on the CPU too.

And the interpreter truncates float32 -> bfloat16 (1.99 becomes 1.984375 where a GPU gives 1.9921875):
here it rounds to nearest even, as GPUs do, so CPU results are the GPU's to the bit (the fp8 wire's
error bound counts on it).

Also for speed: the interpreter patches ``triton.language`` once a kernel launch, not again at each
call of a ``@triton.jit`` helper (a fifth of the interpreted kernels' time went there).
"""

from __future__ import annotations

import ctypes
import time

import numpy as np

_installed = False
_ZERO = np.uint16(0)


def _word_span(ptrs: np.ndarray, mask: np.ndarray):
    """(first, last, lanes, words) when ``ptrs`` are consecutive aligned 16-bit words and a lane is on.

    ``lanes`` is the mask flattened, first..last bound the lanes that are on, and ``words`` is a uint16
    view of the memory of lanes first..last. None otherwise: Triton's own path then serves the access.
    """
    flat = ptrs.ravel()
    lanes = np.broadcast_to(mask, ptrs.shape).ravel()
    on = np.flatnonzero(lanes)
    if on.size == 0 or flat[0] % 2 or np.any(np.diff(flat) != 2):
        return None
    first, last = int(on[0]), int(on[-1])
    words = np.ctypeslib.as_array((ctypes.c_uint16 * (last - first + 1)).from_address(int(flat[first])))
    return first, last, lanes, words


class _AsmCall:
    """What the interpreter's ``inline_asm_elementwise`` expects back from the builder: its results."""

    def __init__(self, *results):
        self._results = results

    def get_result(self, index):
        return self._results[index]


def _float32_to_bfloat16(data: np.ndarray) -> np.ndarray:
    """Round to nearest even, as ``cvt.rn.bf16.f32`` does (NaN stays a quiet NaN)."""
    data = np.asarray(data, np.float32)
    bits = np.ascontiguousarray(data).view(np.uint32)
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
    quiet = ((bits >> 16) | np.uint32(0x40)).astype(np.uint16)
    return np.where(np.isnan(data), quiet, rounded)


def install() -> None:
    """Route the interpreter's 16-bit loads and stores of contiguous words through whole-word copies,
    serve the kernels' timer reads (``%globaltimer``, ``s_memrealtime``) from ``time.monotonic_ns``, and
    round float32 ->
    bfloat16 to nearest even.

    Idempotent. Only affects Triton's interpreter (``TRITON_INTERPRET=1``); compiled kernels are
    untouched.
    """
    global _installed
    if _installed:
        return
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    triton_load, triton_store = builder.create_masked_load, builder.create_masked_store

    # The cache-policy arguments after ``other`` / ``mask`` changed between Triton releases (3.6: cache
    # modifier, eviction policy, volatile; 3.9: one cache policy, volatile): passed on as they come.
    def create_masked_load(self, ptrs, mask, other, *policy):
        dtype_tt = ptrs.get_element_ty()
        dtype_np = np.dtype(interpreter._get_np_dtype(dtype_tt))
        span = _word_span(ptrs.data, mask.data) if dtype_np.itemsize == 2 else None
        if span is None:
            return triton_load(self, ptrs, mask, other, *policy)
        first, last, lanes, words = span
        if other is None:
            loaded = np.zeros(lanes.size, np.uint16)
        else:
            loaded = np.broadcast_to(other.data, ptrs.data.shape).astype(dtype_np).view(np.uint16).ravel()
        # Only the span between the first and last lanes that are on is read (all of it is mapped),
        # by a typed loop: each word is read whole.
        part = slice(first, last + 1)
        loaded[part] = np.where(lanes[part], np.bitwise_or(words, _ZERO), loaded[part])
        return interpreter.TensorHandle(loaded.view(dtype_np).reshape(ptrs.data.shape), dtype_tt)

    def create_masked_store(self, ptrs, value, mask, *policy):
        span = _word_span(ptrs.data, mask.data) if value.data.dtype.itemsize == 2 else None
        if span is None:
            return triton_store(self, ptrs, value, mask, *policy)
        first, last, lanes, words = span
        part = slice(first, last + 1)
        values = np.broadcast_to(value.data, ptrs.data.shape).view(np.uint16).ravel()
        # Lanes that are off are left untouched; each written word is written whole.
        np.bitwise_or(values[part], _ZERO, out=words, where=lanes[part])

    def create_inline_asm(self, asm, constraints, values, type, is_pure, pack):
        import triton.language as tl

        from tpfuse import targets
        from tpfuse.kernels import vendor

        if asm == vendor.OPAQUE_ZERO.value:  # the polls' zero that the compiler cannot know
            return _AsmCall(interpreter.TensorHandle(np.zeros(1, np.int32), tl.int32))
        if asm == vendor.ROUND_BF16_PAIR.value:  # vendor.round_to: bits, -0.0 made +0.0, and as fp32
            bits = _float32_to_bfloat16(values[0].data)
            bits = np.where(bits == 0x8000, np.uint16(0), bits)
            as_fp32 = (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)
            return _AsmCall(interpreter.TensorHandle(bits, tl.bfloat16),
                            interpreter.TensorHandle(as_fp32, tl.float32))
        if asm == vendor.ROUND_FP16_PAIR.value:
            rounded = values[0].data.astype(np.float16)
            rounded = np.where(rounded == 0, np.float16(0), rounded)
            return _AsmCall(interpreter.TensorHandle(rounded, tl.float16),
                            interpreter.TensorHandle(rounded.astype(np.float32), tl.float32))
        if "%globaltimer" not in asm and "s_memrealtime" not in asm:
            return triton_inline_asm(self, asm, constraints, values, type, is_pure, pack)
        # The interpreted arch's timer, as the host computed the deadline (targets.cpu_timer_ticks).
        hz = targets.NVIDIA_TIMER_HZ if "%globaltimer" in asm else targets.INTERPRETED_AMD_TIMER_HZ
        ticks = time.monotonic_ns() * hz // 1_000_000_000
        return _AsmCall(interpreter.TensorHandle(np.array([ticks], np.int64), tl.int64))

    def cast_impl(self, src, dst_type):
        import triton.language as tl

        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return interpreter.TensorHandle(_float32_to_bfloat16(src.data), tl.bfloat16)
        return triton_cast(self, src, dst_type)

    triton_inline_asm, triton_cast = builder.create_inline_asm, builder.cast_impl
    builder.cast_impl = cast_impl
    builder.create_masked_load = create_masked_load
    builder.create_masked_store = create_masked_store
    builder.create_inline_asm = create_inline_asm
    _patch_the_language_once_a_kernel(interpreter)
    _installed = True


def _patch_the_language_once_a_kernel(interpreter) -> None:
    """Every call of a ``@triton.jit`` helper patches ``triton.language`` again for the interpreter
    (``inspect.getmembers`` over its modules: 0.14 ms a call here), though the running kernel's patch
    holds until the kernel returns: a helper whose language modules the kernel patched is run as it
    is. 22% of the interpreted kernels' time in the demo's compiled model (cProfile, 2 CPU ranks)."""
    import triton.language as tl

    patch_lang = getattr(interpreter, "_patch_lang", None)
    scope_class = getattr(interpreter, "_LangPatchScope", None)
    launcher = getattr(interpreter, "GridExecutor", None)
    if patch_lang is None or scope_class is None or launcher is None:
        return  # another Triton's interpreter: as it is
    running: list[frozenset] = []  # the language modules patched while the kernel runs (at most one runs)
    langs_of: dict = {}

    def patch_once(fn):
        langs = langs_of.get(fn)
        if langs is None:
            langs = langs_of[fn] = frozenset(id(v) for v in fn.__globals__.values()
                                             if v is tl or v is tl.core)
        if running:  # a helper called by the running kernel (its caller drops the scope: nothing is undone)
            if not langs <= running[-1]:  # modules the kernel did not patch (Triton's own helpers: tl.core)
                patch_lang(fn)
                running[-1] |= langs
            return scope_class()
        scope = patch_lang(fn)  # a kernel: patched until it returns (its launcher restores the scope)
        running.append(langs)
        restore = scope.restore

        def restore_and_leave():
            running.clear()
            restore()

        scope.restore = restore_and_leave
        return scope

    run_grid = launcher.__call__

    def launch(self, *args, **kwargs):  # a launch starts afresh (a helper called outside a kernel never ends)
        running.clear()
        return run_grid(self, *args, **kwargs)

    launcher.__call__ = launch
    interpreter._patch_lang = patch_once
