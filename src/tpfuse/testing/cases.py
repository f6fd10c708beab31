"""Seeded inputs for the fused op and the float64 check every test and GPU script applies.

Every rank rebuilds all ranks' inputs from the same seed, so the process that checks results can
compute the float64 reference without receiving the inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tpfuse.kernels.reference import fused_reference_float64

# (atol, rtol) of y and h against float64, by the dtype y is stored in.
TOLERANCE = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (4e-3, 4e-3),
    torch.bfloat16: (2.5e-2, 1.6e-2),
    torch.float8_e4m3fn: (2e-2, 7e-2),
}


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

    def inputs(self, world_size: int, device: torch.device | str = "cpu") -> dict:
        """All ranks' inputs: ``xs`` (one per rank), ``residual``, ``weight``, ``quant_scale``."""
        g = torch.Generator().manual_seed(self.seed * 7919 + self.tokens * 131 + self.hidden)
        shape = (self.tokens, self.hidden)
        xs = [torch.randn(shape, generator=g).to(self.dtype) for _ in range(world_size)]
        if self.cancelling and world_size >= 3:
            big = 2.0 ** (15 if self.dtype == torch.float16 else 30)
            xs[0], xs[1] = torch.full(shape, big, dtype=self.dtype), torch.full(shape, -big, dtype=self.dtype)
        residual = torch.randn(shape, generator=g).to(self.dtype) if self.residual else None
        weight = (1 + 0.5 * torch.randn(self.hidden, generator=g)).to(
            torch.float32 if self.weight_fp32 else self.dtype)
        scale = None if self.quant_scale is None else torch.tensor([self.quant_scale], dtype=torch.float32)
        move = (lambda t: None if t is None else t.to(device))
        return {"xs": [move(x) for x in xs], "residual": move(residual), "weight": move(weight),
                "quant_scale": move(scale)}


def check_results(case: Case, world_size: int, per_rank: list[tuple[torch.Tensor, torch.Tensor]],
                  inputs: dict | None = None) -> None:
    """Assert every rank's ``(y, h)`` matches float64 and that all ranks agree bit for bit."""
    inputs = inputs or case.inputs(world_size)
    y_ref, h_ref = fused_reference_float64(inputs["xs"], inputs["residual"], inputs["weight"], case.eps,
                                           inputs["quant_scale"])
    y0, h0 = per_rank[0]
    for rank, (y, h) in enumerate(per_rank):
        for name, got, ref in (("y", y, y_ref), ("h", h, h_ref)):
            atol, rtol = TOLERANCE[got.dtype]
            got64 = got.cpu().double()
            bad = ~torch.isclose(got64, ref.cpu(), atol=atol, rtol=rtol)
            if bad.any():
                i = bad.nonzero()[0].tolist()
                raise AssertionError(
                    f"{case} rank {rank}: {name} differs from float64 at {bad.sum().item()} places, first "
                    f"{i}: {got64[tuple(i)].item()} vs {ref[tuple(i)].item()}")
        if not (torch.equal(y.view(torch.uint8), y0.view(torch.uint8))
                and torch.equal(h.view(torch.uint8), h0.view(torch.uint8))):
            raise AssertionError(f"{case}: rank {rank}'s result is not bit-identical to rank 0's")
