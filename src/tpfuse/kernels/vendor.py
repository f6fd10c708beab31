"""What differs between NVIDIA and AMD GPUs, in one place: for the kernels and for the host.

The kernels are one Triton source for both vendors. What they do differently is chosen while a kernel
is compiled, for the architecture it is compiled for (the compiler's own target, so a kernel built
for gfx942 on any machine gets AMD's choices), by the helpers below:

==========================  ====================================  =========================================
what                        NVIDIA (sm_90 and newer)              AMD (gfx942 = MI300X, gfx950 = MI355X)
==========================  ====================================  =========================================
timer (:func:`now`)         ``%globaltimer``, nanoseconds          ``s_memrealtime``, the device's wall clock
                                                                  (100 MHz on MI300; :func:`timer_hz`)
PDL (:func:`pdl_start`)     ``griddepcontrol`` when launched so    none (the host never asks for it)
polls (:func:`load_polled`) volatile loads (``ld.volatile``)      ``.cv`` loads: ``sc0 sc1``, from memory
                                                                  every time (a volatile load is a plain
                                                                  one there: a poll of one word became one
                                                                  hoisted scalar load, a hang)
words peers wait for        plain stores                          ``.wt`` stores: ``sc0 sc1``, written
(:func:`store_shared`)                                            through to memory at system scope
end of a call (:func:`arrive`)  relaxed or acq_rel atomic (GPU)   acq_rel atomic at system scope: release
                                                                  (``buffer_wbl2 sc0 sc1``) of the clears
                                                                  before a peer can write those words again
fp8 outputs (:func:`fp8_max`)  float8_e4m3fn, largest 448         gfx942: float8_e4m3fnuz, largest 240;
                                                                  gfx950: float8_e4m3fn
==========================  ====================================  =========================================

Under the CPU interpreter (``TRITON_INTERPRET=1``) the kernels take the choices of the architecture
named by ``$TPFUSE_INTERPRET_ARCH`` (default ``sm90``): ``gfx942`` runs them with AMD's timer (served
by ``kernels/interpreter.py`` at :data:`INTERPRETED_AMD_TIMER_HZ`) and FNUZ fp8, so the CPU tests run
both vendors' code paths. docs/architecture.md says why each memory rule is met.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from tpfuse.targets import E4M3FNUZ, fp8_format_of, interpreted_arch

# --- Compile-time choices, for the kernels -------------------------------------------------------------
# These are Triton builtins: the compiler calls them with its state, from which they read the
# architecture being compiled for; they return constexprs, so each kernel keeps one vendor's code only.
# The interpreter calls them as plain functions (no compiler state): then the interpreted arch decides.


def _builtin(fn):
    fn.__triton_builtin__ = True
    return fn


def _compiled_arch(_semantic) -> str:
    if _semantic is None:
        return interpreted_arch()
    return _semantic.builder.options.arch  # "sm90" / "gfx942": the compile target's own name


@_builtin
def on_amd(_semantic=None):
    """constexpr: the kernel is compiled for (or interpreted as) an AMD GPU."""
    return tl.constexpr(_compiled_arch(_semantic).startswith("gfx"))


@_builtin
def fp8_fnuz(_semantic=None):
    """constexpr: fp8 outputs are float8_e4m3fnuz (gfx942), not float8_e4m3fn."""
    return tl.constexpr(fp8_format_of(_compiled_arch(_semantic)) is E4M3FNUZ)


@_builtin
def fp8_max(_semantic=None):
    """constexpr: the largest finite value of the fp8 output format (448 or 240)."""
    return tl.constexpr(fp8_format_of(_compiled_arch(_semantic)).max)


@triton.jit
def now():
    """The GPU's timer, in ticks of :func:`timer_hz`. Inline assembly on both vendors (not Triton's
    ``globaltimer`` / ``memrealtime``), so that ``kernels/interpreter.py`` can serve it on the CPU."""
    if on_amd():
        return tl.inline_asm_elementwise("s_memrealtime $0\ns_waitcnt lgkmcnt(0)", "=s", [], dtype=tl.int64,
                                         is_pure=False, pack=1)
    else:
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                         is_pure=False, pack=1)


@triton.jit
def pdl_start(USE_PDL: tl.constexpr):
    """With programmatic dependent launch (USE_PDL, NVIDIA) the kernel was launched early: wait until the
    previous kernel's writes are visible, then let the next kernel launch early too. Before any load."""
    if USE_PDL:
        tl.static_assert(not on_amd(), "PDL is NVIDIA's: launch with USE_PDL=False on AMD (Target.has_pdl)")
        gdc_wait()
        gdc_launch_dependents()


#: Two fp32 values rounded to nearest even into one packed pair of 16-bit floats ($0), -0.0 made +0.0
#: (x * 1 + 0 in the packed type), and the pair as fp32 again ($1, $2: exact). The lower index sits
#: in the low half, as the packed types lay them out.
ROUND_BF16_PAIR = tl.constexpr(
    "{ .reg .b32 one, zero;\n\tcvt.rn.bf16x2.f32 $0, $4, $3;\n\tmov.b32 one, 0x3F803F80;\n\tmov.b32 zero, 0;"
    "\n\tfma.rn.bf16x2 $0, $0, one, zero;\n\tshl.b32 $1, $0, 16;\n\tand.b32 $2, $0, 0xFFFF0000; }")
ROUND_FP16_PAIR = tl.constexpr(
    "{ .reg .b32 one, zero;\n\t.reg .b16 lo, hi;\n\tcvt.rn.f16x2.f32 $0, $4, $3;\n\tmov.b32 one, 0x3C003C00;"
    "\n\tmov.b32 zero, 0;\n\tfma.rn.f16x2 $0, $0, one, zero;\n\tmov.b32 {lo, hi}, $0;\n\tcvt.f32.f16 $1, lo;"
    "\n\tcvt.f32.f16 $2, hi; }")


@triton.jit
def round_to(v, DTYPE: tl.constexpr):
    """``v`` rounded to nearest even in ``DTYPE`` once, with -0.0 made +0.0 (as the two-shot sends it),
    and those values as fp32: ``(rounded, rounded_fp32)``. A 16-bit ``v`` is taken as already rounded.

    Where the rounded row is both stored and normed (every kernel norms the h it returns), plain
    ``v.to(DTYPE)`` became a scalar conversion an element and ``.to(tl.float32)`` a repacking: rows of
    8192 took 0.1-0.2 us longer on one H200 (docs/determinism.md). On NVIDIA one packed conversion
    makes two elements and their fp32 values come from its halves."""
    if v.dtype != tl.float32:
        return v, v.to(tl.float32)
    elif on_amd() or DTYPE == tl.float32:
        rounded = v.to(DTYPE)
        rounded = tl.where(rounded == 0, tl.zeros_like(rounded), rounded)
        return rounded, rounded.to(tl.float32)
    elif DTYPE == tl.bfloat16:
        return tl.inline_asm_elementwise(ROUND_BF16_PAIR, "=r,=r,=r,r,r", [v],
                                         dtype=(tl.bfloat16, tl.float32), is_pure=True, pack=2)
    else:
        tl.static_assert(DTYPE == tl.float16, "h is bfloat16 or float16")
        return tl.inline_asm_elementwise(ROUND_FP16_PAIR, "=r,=r,=r,r,r", [v],
                                         dtype=(tl.float16, tl.float32), is_pure=True, pack=2)


#: An assembly statement the compiler must run at every poll, whose result (zero) it cannot know.
OPAQUE_ZERO = tl.constexpr("s_mov_b32 $0, 0")


@triton.jit
def load_polled(ptrs, mask):
    """Load words that a peer writes, as a wait reads them: from memory on every call, never a value
    a cache or the compiler kept. Masked lanes read 0."""
    if on_amd():
        # sc0 sc1: past both cache levels. To LLVM these are ordinary loads (a cache policy; volatile=True
        # is dropped on AMD). Two things let Triton 3.6 build waits that spin without reading (a loop
        # that redid the block-wide reduction and read the timer, its loads in a sibling loop): a masked
        # load is a branch on each lane's mask, which does not change while a wait loops, so the loop
        # was split on it; and an address that does not change lets a load be kept from one look to the
        # next. So every lane loads, its mask applied to the value (``layout.POLL_REACH``: the buffer has
        # room for the lanes past a row), from an address plus a zero that assembly with side effects
        # makes at each look, which the compiler can neither know nor move (times 8: 16-byte accesses).
        fresh = tl.inline_asm_elementwise(OPAQUE_ZERO, "=s", [], dtype=tl.int32, is_pure=False, pack=1)
        return tl.where(mask, tl.load(ptrs + fresh * 8, cache_modifier=".cv", volatile=True), 0)
    else:
        return tl.load(ptrs, mask=mask, other=0, volatile=True)


@triton.jit
def store_shared(ptrs, values, mask=None):
    """Store words a peer waits for (data and descriptors pushed to peers), or the sentinel that clears
    them in our own buffer: written through to memory, where peers and polls read."""
    if on_amd():
        tl.store(ptrs, values, mask=mask, cache_modifier=".wt")
    else:
        tl.store(ptrs, values, mask=mask)


@triton.jit
def arrive(ptr, RELAXED: tl.constexpr):
    """Count this program's arrival at the end of a call (an atomic add of 1); returns the count before.

    On AMD it releases at system scope: every store of this program (its clears of the previous slot
    above all) is out of its caches before the call can end, hence before any peer, which needs our
    next call's data first, writes those words again. NVIDIA keeps the measured choice (RELAXED).
    """
    if on_amd():
        return tl.atomic_add(ptr, 1, sem="acq_rel", scope="sys")
    elif RELAXED:
        return tl.atomic_add(ptr, 1, sem="relaxed")
    else:
        return tl.atomic_add(ptr, 1, sem="acq_rel")
