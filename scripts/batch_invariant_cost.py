"""What batch-invariant mode's gathered path costs on one GPU, beside the reference path it replaces.

The gathered path (``ops.route.block_end_of_parts``): every rank's part summed in rank order in fp32, then
the local kernel's block end. The reference path: the all-reduced fp32 sum's block end in torch. Both
timed without their collective (one GPU has no peer: the parts of a 2-rank group are made here), CUDA
graph replays, median of 7 batches of 10. Collectives, per element a rank receives: the gathered path's
all-gather W - 1 parts of 2 bytes, the reference path's fp32 all-reduce (ring) 2 (W - 1) / W x 4 bytes:
2 against 4 bytes at W = 2, 14 against 7 at W = 8.

Usage: PYTHONPATH=src python3 scripts/batch_invariant_cost.py
"""

import torch

from tpfuse.bench.timing import graph_replay_us
from tpfuse.ops.route import _block_end_in_torch, block_end_of_parts, part_as_sent
from tpfuse.testing.cases import Case


def main() -> None:
    device = torch.device("cuda")
    print(f"{'tokens x hidden':>16} {'gathered us':>12} {'reference us':>13}")
    for hidden in (4096, 8192):
        for tokens in (1, 64, 512):
            case = Case(tokens, hidden, seed=tokens)
            inputs = case.inputs(2, device)
            calls = [case.fused_call(inputs, r) for r in range(2)]
            parts = [part_as_sent(call) for call in calls]
            gathered, reference = case.fused_call(inputs, 0), case.fused_call(inputs, 0)
            reduced = parts[0].float() + parts[1].float()
            block_end_of_parts(gathered, parts)
            _block_end_in_torch(reference, reduced)
            # the same h; y within a step (torch's reductions are not the kernel's)
            assert torch.equal(gathered.h, reference.h)
            torch.testing.assert_close(gathered.y.float(), reference.y.float(), rtol=2**-7, atol=1e-3)
            cells = [graph_replay_us(lambda: block_end_of_parts(gathered, parts)),
                     graph_replay_us(lambda: _block_end_in_torch(reference, reduced))]
            print(f"{tokens:>7} x {hidden:<6} {cells[0]:>12.2f} {cells[1]:>13.2f}")


if __name__ == "__main__":
    main()
