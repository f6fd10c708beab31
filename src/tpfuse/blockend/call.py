"""One call of the fused op as one value: what the op builds once and every layer below it takes.

The op checks its arguments and builds a :class:`FusedCall`; the communicator plans it (fused rows or
the reference path), its backend runs it, the kernels' launchers read their arguments from it and the
torch reference computes it. Nothing in between passes the call's tensors one by one.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from tpfuse.blockend import bits, outputs
from tpfuse.blockend.epilogue import PLAIN, Epilogue, StepTensors, rows_of_every_shard

_STEPS = len(StepTensors._fields)


class CallDescription(NamedTuple):
    """What a call is, as every rank must make it: its rows, hidden size and flags word (``bits.FLAG_*``:
    dtype, residual, the block end's steps). The kernels' descriptor carries it (``bits.describe_call``,
    with the algorithm's bits), and the host compares it where no kernel does (``comm.agreement``)."""

    tokens: int
    hidden: int
    flags: int

    def fields(self) -> dict[str, int]:
        """For ``agreement.exchange``: its fields by name."""
        return self._asdict()


class FusedCall(NamedTuple):
    """``y, h = block_end(sum over ranks of x, residual)`` for one rank: inputs, outputs and steps.

    A frozen value (a named tuple: one is made per eager call, and a dataclass costs more host time
    to make).

    Attributes
    ----------
    x : Tensor [T, H] or [T, K, H]
        This rank's partial result (bf16, fp16 or fp32), contiguous; [T, K, H]: the outputs of each
        token's top-k experts, which a MoE finalize sums first (``Epilogue.experts``).
    residual : Tensor [T, H] or None
        Added after the sum; None means zero.
    weight : Tensor [H]
        The norm's gain.
    eps : float
    y, h : Tensor [T, H]
        Where the normed output (fp8 with an fp8 block end) and the new residual stream go.
    epilogue : Epilogue
        The block end's optional steps (bias, post-norm, LayerNorm, static or dynamic fp8).
    scales : Tensor or None
        Where a dynamic fp8 or fp4 call writes its scales, in their format and layout
        (``Output.empty_scales``).
    normed : Tensor [T, H] or None
        Where a quantising call with ``epilogue.normed_copy`` writes the norm's output in x's dtype.
    sharded : bool
        Sequence parallel: the rows are sharded over the W ranks, rank r owning rows
        ``r * T / W ... (r + 1) * T / W - 1`` as a reduce-scatter over dim 0 gives them. ``residual`` and
        ``h`` (and RMSNorm backward's ``norm_input`` and ``grad_h``) hold this rank's T / W rows; ``x``,
        ``y`` (gathered from every rank) and the rest hold all T.
    """

    x: torch.Tensor
    residual: torch.Tensor | None
    weight: torch.Tensor
    eps: float
    y: torch.Tensor
    h: torch.Tensor
    epilogue: Epilogue = PLAIN
    scales: torch.Tensor | None = None
    normed: torch.Tensor | None = None
    sharded: bool = False

    @property
    def n_tokens(self) -> int:
        return self.x.shape[0]

    @property
    def own_rows(self) -> int:
        """The rows of ``h`` (T, or T / W of a sharded call)."""
        return self.h.shape[0]

    @property
    def hidden(self) -> int:
        return self.x.shape[-1]

    def describe(self) -> CallDescription:
        """The call as every rank must make it (:class:`CallDescription`)."""
        return CallDescription(self.n_tokens, self.hidden,
                               bits.call_flags(self.x.dtype, self.residual is not None)
                               | self.epilogue.flags(self.hidden)
                               | (bits.FLAG_SHARDED if self.sharded else 0))

    def outputs(self) -> tuple[torch.Tensor, ...]:
        """Every tensor the call writes."""
        return tuple(t for t in (self.y, self.h, self.scales, self.normed) if t is not None)

    def rows(self, start: int, stop: int) -> FusedCall:
        """The same call restricted to rows ``start:stop`` (rows are independent). Scales whose layout
        does not slice by rows (``Output.scales_by_rows``) go to a new tensor of the part's own layout:
        ``Output.place_scale_rows`` puts them back. A sharded call's parts are :meth:`shard_part`'s."""
        assert not self.sharded, "a sharded call's rows are not a slice of its tensors"
        part = slice(start, stop)
        scales = self.scales
        if scales is not None:
            output = self.epilogue.output
            scales = (scales[part] if output.scales_by_rows
                      else output.empty_scales(stop - start, self.hidden, scales.device))
        return self._replace(x=self.x[part], residual=None if self.residual is None else self.residual[part],
                             y=self.y[part], h=self.h[part], epilogue=self.epilogue.rows(part), scales=scales,
                             normed=None if self.normed is None else self.normed[part])

    def shard_part(self, start: int, stop: int, world_size: int) -> FusedCall:
        """A sharded call restricted to rows ``start:stop`` of every rank's shard: a sharded call of its own
        (x's rows copied together; h, the residual and h-side inputs sliced; y, its scales and the norm's
        copy new tensors that :meth:`place_shard_part` puts back). Scales must slice by rows."""
        def x_rows(t):
            return rows_of_every_shard(t, start, stop, world_size).flatten(0, 1)

        def fresh(t):
            return None if t is None else torch.empty_like(x_rows(t))

        return self._replace(x=x_rows(self.x).contiguous(),
                             residual=None if self.residual is None else self.residual[start:stop],
                             y=fresh(self.y), h=self.h[start:stop],
                             epilogue=self.epilogue.shard_rows(start, stop, world_size),
                             scales=fresh(self.scales), normed=fresh(self.normed))

    def place_shard_part(self, part: FusedCall, start: int, stop: int, world_size: int) -> None:
        """Copy a :meth:`shard_part`'s gathered outputs into this call's."""
        for whole, got in ((self.y, part.y), (self.scales, part.scales), (self.normed, part.normed)):
            if whole is not None:
                rows_of_every_shard(whole, start, stop, world_size).copy_(got.unflatten(0, (world_size, -1)))

    def kernel_tensors(self) -> tuple:
        """The call's tensors as every kernel of ours takes them, in order: x, residual, weight, y, h, then
        the block end's (``epilogue.StepTensors``: the kernels' ``steps``). An absent one is passed as
        ``weight``, a stand-in the kernel never reads; an fp8 ``y`` as bytes (the kernels store fp8 codes)."""
        x, residual, weight, _, y, h, steps, scales, normed, _ = self
        if residual is None:
            residual = x
        if steps is PLAIN:  # the common call: every step's place taken by the stand-in
            return x, residual, weight, y, h, StepTensors._make((weight,) * _STEPS)
        if scales is not None and scales.element_size() == 1:  # e4m3 / e8m0 scales: stored as bytes
            scales = scales.view(torch.uint8)
        return (x, residual, weight, y.view(torch.uint8) if steps.fp8_output else y, h,
                steps.step_tensors(weight, scales, normed))

    def kernel_addresses(self) -> list:
        """:meth:`kernel_tensors`' device addresses, in the same order and nesting (the steps' as one
        tuple, as the kernels' ``steps``): what a kept launch passes. Each tensor's read once, the
        stand-in's reused."""
        x, residual, weight, _, y, h, steps, _, _, _ = self
        if steps is not PLAIN:
            *tensors, step_tensors = self.kernel_tensors()
            return [*[t.data_ptr() for t in tensors], tuple(t.data_ptr() for t in step_tensors)]
        stand_in, x_at = weight.data_ptr(), x.data_ptr()
        return [x_at, residual.data_ptr() if residual is not None else x_at, stand_in,
                y.data_ptr(), h.data_ptr(),
                (stand_in,) * _STEPS]

    def kernel_key(self) -> tuple:
        """What about this call, besides its row count, decides a compiled kernel: dtypes, hidden size,
        the residual and the block end's steps."""
        x = self.x
        return (x.shape[-1], x.dtype, self.y.dtype, self.weight.dtype, self.residual is not None,
                self.epilogue.signature, self.sharded)


def explain_flags(flags: int) -> str:
    """A flags word as words: ``bfloat16, residual, MoE finalize, 3 experts a token, topk_weights``."""
    dtype = "bfloat16" if flags & bits.FLAG_BF16 else "float16" if flags & bits.FLAG_FP16 else "float32" \
        if flags & bits.FLAG_FP32 else "?"
    return ", ".join([dtype, "residual" if flags & bits.FLAG_RESIDUAL else "no residual"]
                     + [word if isinstance(word, str) else word(flags) for mask, word in bits.EXPLAINED_FLAGS
                        if flags & mask]
                     + outputs.explain_code(flags))


def explain_descriptor(words: list[int], other: list[int] | None = None) -> str:
    """A descriptor as a reader wants it: ``5 x 512 bfloat16 oneshot, residual``; the call's number and
    the workspace's region are added where they differ from ``other``'s."""
    def tokens(w):
        return w[0] | w[1] << 15

    def region(w):
        return w[5] | w[6] << 15 | (w[7] & 1) << 30

    flags = words[3] | (words[7] >> 1) << 15
    dtype, *steps = explain_flags(flags).split(", ")
    parts = [f"{tokens(words)} x {words[2]} {dtype} {'twoshot' if flags & bits.FLAG_TWOSHOT else 'oneshot'}",
             *steps]
    if other is not None and other[4] != words[4]:
        parts.append(f"its call #{words[4] + 1} (mod 32768)")
    if other is not None and region(other) != region(words):
        parts.append(f"a workspace region of {region(words)} words")
    return ", ".join(parts)
