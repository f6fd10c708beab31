"""Seeded inputs for the fused op and the float64 check every test and GPU script applies.

Every rank rebuilds all ranks' inputs from the same seed, so the process that checks results can
compute the float64 reference without receiving the inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tpfuse.blockend import codecs
from tpfuse.blockend.bits import FP4_GROUP, FP4_MXFP4, FP4_NONE, FP4_NVFP4
from tpfuse.blockend.call import FusedCall
from tpfuse.blockend.epilogue import Epilogue
from tpfuse.blockend.reference import fused_reference_float64, rank_part, unquantised
from tpfuse.ops.allreduce_add_rmsnorm import SCALE_LAYOUTS
from tpfuse.targets import E4M3FN, E4M3FNUZ, fp8_format

# (atol, rtol) of y and h against float64, by the dtype y is stored in.
TOLERANCE = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (4e-3, 4e-3),
    torch.bfloat16: (2.5e-2, 1.6e-2),
    torch.float8_e4m3fn: (2e-2, 7e-2),
    torch.float8_e4m3fnuz: (2e-2, 7e-2),  # the same 3 mantissa bits (gfx942's fp8)
}
#: Dynamic fp8 scales against amax / fp8 max of the float64 y (the two-shot's y comes from a rounded h).
SCALE_TOLERANCE = (0.0, 1e-2)
FP4 = {"": FP4_NONE, "nvfp4": FP4_NVFP4, "mxfp4": FP4_MXFP4}


@dataclass(frozen=True)
class Case:
    tokens: int
    hidden: int
    dtype: torch.dtype = torch.bfloat16
    residual: bool = True
    quant_scale: float | None = None
    weight_fp32: bool = False
    seed: int = 0
    eps: float = 1e-6
    # Ranks 0 and 1 send +B and -B (B = 2**30 in bf16, 2**15 in fp16): summed in rank order they
    # cancel exactly and the other ranks' values survive; a sum that adds another rank between them
    # rounds those values away (fp32 keeps 24 bits). With normal values alone, sums of a few ranks
    # are nearly always exact in fp32 whatever the order, so no test could see the order. Needs 3+
    # ranks (two terms add the same either way); ignored below that.
    cancelling: bool = False
    # The block end's optional steps (blockend/epilogue.py): a bias after the sum, Gemma's post-norm,
    # LayerNorm (with its bias), dynamic fp8 with a scale per ``scale_group`` elements.
    bias: bool = False
    sum_norm: bool = False
    layer_norm: bool = False
    norm_bias: bool = False
    scale_group: int = 0
    # False: a plain all-reduce (``tpfuse.all_reduce``; no residual): y is h.
    normed: bool = True
    # A MoE finalize before the sum: x [T, experts, H] (the top-k experts' outputs), weighted by the
    # routing's top-k weights (the same on every rank), plus each rank's part of a shared expert.
    experts: int = 0
    topk_weighted: bool = False
    shared_expert: bool = False
    # The quantised outputs the next GEMM takes (``tpfuse.allreduce_add_rmsnorm_quant``): "nvfp4" or
    # "mxfp4" y; dynamic fp8 scales as powers of two and in a layout ("rows", "columns",
    # "packed_ue8m0"; MXFP4's "rows" or "shuffled"); the norm's output in x's dtype beside the quantised one.
    fp4: str = ""
    ue8m0_scales: bool = False
    scale_layout: str = "rows"
    normed_copy: bool = False

    @property
    def quant_call(self) -> bool:
        """Whether the call goes through ``allreduce_add_rmsnorm_quant`` (and returns its four outputs)."""
        return bool(self.fp4) or self.ue8m0_scales or self.scale_layout != "rows" or self.normed_copy

    def epilogue(self, inputs: dict, rank: int = 0) -> Epilogue:
        """Rank ``rank``'s block end (:class:`Epilogue`) from ``inputs``: ``block_end.PLAIN`` itself where it
        has no step, as the op makes it."""
        return Epilogue.of(dict(
            quant_scale=inputs["quant_scale"], bias=inputs["bias"], sum_weight=inputs["sum_weight"],
            layer_norm=self.layer_norm, norm_bias=inputs["norm_bias"], scale_group=self.scale_group,
            normed=self.normed, experts=self.experts, topk_weights=inputs["topk_weights"],
            shared_expert=None if inputs["shared"] is None else inputs["shared"][rank],
            normed_copy=self.normed_copy, ue8m0_scales=self.ue8m0_scales,
            scale_layout=SCALE_LAYOUTS[self.scale_layout], fp4=FP4[self.fp4],
            global_scale=inputs["global_scale"]))

    def fused_call(self, inputs: dict, rank: int) -> FusedCall:
        """Rank ``rank``'s call as the kernels take it, with fresh outputs poisoned with NaN."""
        x = inputs["xs"][rank]
        steps = self.epilogue(inputs, rank)
        rows = (self.tokens, self.hidden)
        y = torch.full(rows, float("nan"), dtype=x.dtype, device=x.device)
        if steps.fp8_output:
            fmt = fp8_format(x.device)  # poisoned with its NaN code: 0xFF (e4m3fn), 0x80 (e4m3fnuz)
            nan_code = 0x80 if fmt is E4M3FNUZ else 0xFF
            y = torch.full(rows, nan_code, dtype=torch.uint8, device=x.device).view(fmt.dtype)
        elif self.fp4:
            y = torch.full((self.tokens, self.hidden // 2), 0xFF, dtype=torch.uint8, device=x.device)
        scales = steps.output.empty_scales(self.tokens, self.hidden, x.device)
        if scales is not None:  # every bit set: NaN, or packed exponents no scale has
            scales.fill_(float("nan") if scales.is_floating_point() else -1)
        normed = torch.full(rows, float("nan"), dtype=x.dtype, device=x.device) if self.normed_copy else None
        h = torch.full(rows, float("nan"), dtype=x.dtype, device=x.device)
        return FusedCall(x, inputs["residual"], inputs["weight"], self.eps, y if self.normed else h, h,
                         steps, scales, normed)

    def call(self, inputs: dict, rank: int, **kwargs):
        """This rank's call through the public API: ``(y, h)``, or ``(y, h, scales)`` for dynamic fp8."""
        import tpfuse

        if not self.normed:
            h = tpfuse.all_reduce(inputs["xs"][rank], **kwargs)
            return h, h
        args = (inputs["xs"][rank], inputs["residual"], inputs["weight"], self.eps)
        extras = dict(bias=inputs["bias"], sum_weight=inputs["sum_weight"], layer_norm=self.layer_norm,
                      norm_bias=inputs["norm_bias"], topk_weights=inputs["topk_weights"],
                      shared_expert=None if inputs["shared"] is None else inputs["shared"][rank], **kwargs)
        if self.quant_call:
            y, scales, h, normed = tpfuse.allreduce_add_rmsnorm_quant(
                *args, output=self.fp4 or "fp8", quant_scale=inputs["quant_scale"],
                scale_group=self.scale_group or None, ue8m0_scales=self.ue8m0_scales,
                scale_layout=self.scale_layout, global_scale=inputs["global_scale"],
                normed_copy=self.normed_copy, **extras)
            return y, h, scales, normed
        if self.scale_group:
            y, scales, h = tpfuse.allreduce_add_rmsnorm_dynamic_fp8(*args, scale_group=self.scale_group,
                                                                    **extras)
            return y, h, scales
        return tpfuse.allreduce_add_rmsnorm(*args, quant_scale=inputs["quant_scale"], **extras)

    def inputs(self, world_size: int, device: torch.device | str = "cpu") -> dict:
        """All ranks' inputs: ``xs`` (one per rank), ``residual``, ``weight``, ``quant_scale``, the block
        end's rows, a MoE finalize's ``topk_weights`` and ``shared`` (one per rank)."""
        g = torch.Generator().manual_seed(self.seed * 7919 + self.tokens * 131 + self.hidden)
        shape = (self.tokens, self.hidden)
        x_shape = (self.tokens, self.experts, self.hidden) if self.experts else shape
        xs = [torch.randn(x_shape, generator=g).to(self.dtype) for _ in range(world_size)]
        if self.cancelling and world_size >= 3:
            big = 2.0 ** (15 if self.dtype == torch.float16 else 30)
            xs[0], xs[1] = torch.full(shape, big, dtype=self.dtype), torch.full(shape, -big, dtype=self.dtype)
        residual = torch.randn(shape, generator=g).to(self.dtype) if self.residual else None
        weight = (1 + 0.5 * torch.randn(self.hidden, generator=g)).to(
            torch.float32 if self.weight_fp32 else self.dtype)
        scale = None if self.quant_scale is None else torch.tensor([self.quant_scale], dtype=torch.float32)

        def row(wanted, centre):
            return (centre + 0.5 * torch.randn(self.hidden, generator=g)).to(self.dtype) if wanted else None

        topk_weights = None
        if self.topk_weighted:  # a softmax over the top k, as routers make them
            topk_weights = torch.randn(self.tokens, self.experts, generator=g).softmax(-1)
        shared = None
        if self.shared_expert:
            shared = [torch.randn(shape, generator=g).to(self.dtype) for _ in range(world_size)]

        def move(t):
            return None if t is None else t.to(device)

        # NVFP4's global scale: y's amax (about 4 here) near 448 * 6 / 10, as vLLM picks it.
        global_scale = torch.tensor([448 * 6 / 10.0]) if self.fp4 == "nvfp4" else None
        return {"xs": [move(x) for x in xs], "residual": move(residual), "weight": move(weight),
                "quant_scale": move(scale), "global_scale": move(global_scale),
                "bias": move(row(self.bias, 0.0)),
                "sum_weight": move(row(self.sum_norm, 1.0)), "norm_bias": move(row(self.norm_bias, 0.0)),
                "topk_weights": move(topk_weights), "shared": None if shared is None
                else [move(t) for t in shared]}


def check_results(case: Case, world_size: int, per_rank: list[tuple[torch.Tensor, ...]],
                  inputs: dict | None = None) -> None:
    """Assert every rank's ``(y, h)`` (``(y, h, scales)`` for dynamic fp8, ``(y, h, scales, normed)``
    through ``allreduce_add_rmsnorm_quant``) matches float64 and that all ranks agree bit for bit.

    A dynamic fp8 ``y`` is compared in its own scaled units (``y_ref / scale``), with fp8's tolerance,
    and each scale with ``amax / 448`` of the float64 ``y`` (240 where y is float8_e4m3fnuz; UE8M0
    scales: the power of two at or above it). fp4 ``y`` is decoded by the format's definition
    (``blockend.codecs``) and compared in its scaled units within half a step of e2m1.
    """
    inputs = inputs or case.inputs(world_size)
    # The fp8 format the ranks' device gives (a GPU's results come back on the CPU): from y's dtype.
    fmt = E4M3FNUZ if per_rank[0][0].dtype == torch.float8_e4m3fnuz else E4M3FN
    # A MoE finalize's part is rounded to x's dtype before the sum: the oracle takes it as the kernels
    # make it (fp32, in their order), since an fp32 sum that rounds the other way from float64's at a
    # tie moves a dynamic fp8 code; the sum and the block end stay float64.
    parts = [rank_part(x, case.epilogue(inputs, rank)) for rank, x in enumerate(inputs["xs"])]
    epilogue = case.epilogue(inputs)
    reference = (parts, inputs["residual"], inputs["weight"], case.eps)
    y_ref, h_ref = fused_reference_float64(*reference, epilogue, fmt)
    first = per_rank[0]
    for rank, (y, h, *extra) in enumerate(per_rank):
        scales, normed = (list(extra) + [None, None])[:2]
        checks = [("y", y, y_ref), ("h", h, h_ref)]
        if case.fp4:
            checks = [("h", h, h_ref)] + _fp4_checks(epilogue, y.cpu(), scales.cpu(), y_ref.cpu())
        elif case.scale_group:
            got = epilogue.output.scales_as_float(scales.cpu(), case.tokens, case.hidden).double()
            groups = y_ref.cpu().unflatten(-1, (-1, case.scale_group))
            expected = (groups.abs().amax(-1) / fmt.max).clamp(min=fmt.min_dynamic_scale)
            checks = [("y", y, (groups / got.unsqueeze(-1)).flatten(-2)), ("h", h, h_ref)]
            if epilogue.output.pow2:
                _check_powers_of_two(case, rank, got, expected)
            else:
                checks.append(("scales", got.float(), expected))
        if normed is not None:
            checks.append(("normed", normed, fused_reference_float64(*reference, unquantised(epilogue))[0]))
        for name, got, ref in checks:
            atol, rtol = SCALE_TOLERANCE if name == "scales" else TOLERANCE.get(got.dtype, (0.0, 0.0))
            got64 = got.cpu().double()
            bad = ~torch.isclose(got64, ref.cpu(), atol=atol, rtol=rtol)
            if bad.any():
                i = bad.nonzero()[0].tolist()
                raise AssertionError(
                    f"{case} rank {rank}: {name} differs from float64 at {bad.sum().item()} places, first "
                    f"{i}: {got64[tuple(i)].item()} vs {ref[tuple(i)].item()}")
        ours = per_rank[rank]
        same = [a is None and b is None or torch.equal(_bytes(a), _bytes(b)) for a, b in zip(ours, first)]
        if not all(same):
            raise AssertionError(f"{case}: rank {rank}'s result is not bit-identical to rank 0's")


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's values as bytes, row-major (a column-major view of one column is "contiguous" to
    torch with a last stride that is not 1)."""
    return torch.empty(t.shape, dtype=t.dtype).copy_(t).view(torch.uint8)


def _check_powers_of_two(case: Case, rank: int, got: torch.Tensor, expected: torch.Tensor) -> None:
    """UE8M0 scales: powers of two, the one at or above ``expected`` (or the next, where the kernel's
    amax rounded across one)."""
    exponent = torch.log2(got)
    low = torch.ceil(torch.log2(expected * (1 - SCALE_TOLERANCE[1])))
    high = torch.ceil(torch.log2(expected * (1 + SCALE_TOLERANCE[1])))
    ok = (exponent == torch.round(exponent)) & (exponent >= low) & (exponent <= high)
    if not ok.all():
        i = tuple((~ok).nonzero()[0].tolist())
        raise AssertionError(f"{case} rank {rank}: UE8M0 scale {got[i].item()} is not the power of two at or "
                             f"above {expected[i].item()}")


def _fp4_checks(epilogue: Epilogue, y: torch.Tensor, scales: torch.Tensor, y_ref: torch.Tensor) -> list:
    """fp4 ``y`` decoded, in its scaled units, against float64 (within half an e2m1 step, saturated at
    6), and its scales against their definitions; as (name, got, ref) checks with exact tolerance."""
    n_tokens, hidden = y_ref.shape
    group = FP4_GROUP[epilogue.fp4]
    got_scales = epilogue.output.scales_as_float(scales, n_tokens, hidden).double()
    amax = y_ref.unflatten(-1, (-1, group)).abs().amax(-1)
    if epilogue.fp4 == FP4_NVFP4:
        g = epilogue.global_scale.cpu().double()
        wanted = (amax / 6 * g).clamp(max=448)
        scale_ok = torch.isclose(got_scales, wanted, rtol=TOLERANCE[torch.float8_e4m3fn][1], atol=2 ** -9)
        factor = torch.where(got_scales > 0, g / got_scales, torch.zeros_like(got_scales))
    else:  # amax in [4 s, 8 s): e2m1's largest power of two, 4, times the scale
        slack = 1 + SCALE_TOLERANCE[1]
        scale_ok = (4 * got_scales <= amax * slack) & (amax < 8 * got_scales * slack)
        factor = 1 / got_scales
    v = (y_ref.unflatten(-1, (-1, group)) * factor.unsqueeze(-1)).flatten(-2).clamp(-6, 6)
    step = torch.where(v.abs() < 2, 0.5, torch.where(v.abs() < 4, 1.0, 2.0))
    decoded = codecs.e2m1_values(y).double()
    value_ok = (decoded - v).abs() <= step / 2 + 1e-2 * v.abs() + 1e-6
    return [("fp4 scales", scale_ok.double(), torch.ones_like(got_scales)),
            ("fp4 y", value_ok.double(), torch.ones_like(v))]


def check_case_runs(world_size: int, cases: list[Case], results: list[dict], kernel_cases: int, route: str,
                    chunked: tuple[int, ...] = ()) -> None:
    """Every rank's outputs of ``testing.cases_on_a_fresh_group`` against float64 (:func:`check_results`)
    and how each call ran: the first ``kernel_cases`` by ``route`` (``"oneshot"`` / ``"twoshot"``: one
    fused call each, or one a ``limit`` of rows for the cases at ``chunked``; ``"local"``; or
    ``"reference"``), the others on the reference path."""
    from tpfuse.testing import fused_calls

    for i, case in enumerate(cases):
        check_results(case, world_size, [res["outputs"][i] for res in results])
    for res in results:
        ran, rest = res["stats"][:kernel_cases], res["stats"][kernel_cases:]
        if route in ("oneshot", "twoshot"):
            chunks = -(-max(cases[i].tokens for i in chunked) // res["limit"]) if chunked else 1
            assert chunks > 1 or not chunked, (chunks, res["limit"])
            assert [fused_calls(s) for s in ran] == [chunks if i in chunked else 1
                                                     for i in range(kernel_cases)], ran
            assert all(set(s) == {f"triton.{route}"} for s in ran), ran
        else:
            assert all(s == {("triton.local" if route == "local" else "reference"): 1} for s in ran), ran
        assert all(s == {"reference": 1} for s in rest), rest


# One token, one answer (docs/determinism.md): the same rows in batches of other sizes and places.


def batch_inputs(inputs: dict, first: int, rows: int) -> dict:
    """``inputs`` (``Case.inputs``) for rows ``first:first + rows``: every per-row tensor sliced."""
    part = slice(first, first + rows)

    def rows_of(t):
        return None if t is None else t[part]

    sliced = dict(inputs)
    sliced["xs"] = [x[part] for x in inputs["xs"]]
    sliced["residual"] = rows_of(inputs["residual"])
    sliced["topk_weights"] = rows_of(inputs["topk_weights"])
    sliced["shared"] = None if inputs["shared"] is None else [s[part] for s in inputs["shared"]]
    return sliced


def row_outputs(case: Case, inputs: dict, outputs: tuple, rows: int) -> list[dict]:
    """A call's outputs row by row: each as bytes (scales decoded to their float values, exactly)."""
    y, h, *extra = outputs
    scales, normed = (list(extra) + [None, None])[:2]
    if scales is not None:
        scales = case.epilogue(inputs).output.scales_as_float(scales, rows, case.hidden)
    per_row = []
    for i in range(rows):
        row = {"y": y[i], "h": h[i]}
        if scales is not None:
            row["scales"] = scales[i]
        if normed is not None:
            row["normed"] = normed[i]
        per_row.append({name: t.contiguous().view(torch.uint8).cpu().clone() for name, t in row.items()})
    return per_row
