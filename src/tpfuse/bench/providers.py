"""What the benchmarks and ``tune`` time: tpfuse's algorithms and the baselines, over one set of inputs.

Every provider computes y = RMSNorm(allreduce(x) + residual) * weight and h from the same inputs, with
the optional steps of an epilogue (:data:`EPILOGUES`: a bias, Gemma's post-norm, LayerNorm, two summed
all-reduces, dynamic fp8) where it has them:

- ``tpfuse``: the op as users call it (the algorithm the table picks);
- ``tpfuse:oneshot`` / ``tpfuse:twoshot``: one algorithm, forced;
- ``tpfuse:<variant>``: a launch variant of the one-shot (:data:`ONESHOT_VARIANTS`) or of the two-shot
  (:data:`TWOSHOT_GROUPS`), docs/kernel-notes.md; ``tpfuse:twoshot_fp8``: the two-shot on the fp8 wire;
- ``nccl+norm``: the group's all-reduce plus a compiled add + RMSNorm (the unfused model);
- ``tpfuse:sp`` / ``nccl_sp`` (``nccl_rs+norm+ag``): sequence parallel's block end for the same rows, fused
  (``tpfuse.reduce_scatter_add_rmsnorm_all_gather``) and unfused (the group's reduce-scatter, the compiled
  add + RMSNorm of the rank's rows, the group's all-gather); plain epilogue only;
- ``symm_oneshot+norm``: torch symmetric memory's one-shot all-reduce plus the same norm;
- ``fi_oneshot`` / ``fi_twoshot``: FlashInfer's fused kernel, when importable (plain epilogue only);
- ``floor`` / ``launch``: no op, the bounds of a one-token call (one exchange with every peer; an
  empty kernel), ``tpfuse.bench.floor``; they return None.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

EPS = 1e-6
#: Providers that time a bound, not the op: ``bench kernel`` does not check their output.
FLOOR_PROVIDERS = ("floor", "launch")

# One-shot launch variants that can be timed beside the default as providers "tpfuse:<name>".
ONESHOT_VARIANTS = {
    "nopdl": dict(pdl=False),
    "clear_last": dict(clear_first=False),
    "acq_rel": dict(relaxed_arrive=False),
    # Every row pushed by the program that reduces it, also where split_push_programs would split.
    "no_split_push": dict(split_push_words=0),
    # Chunks of 4096 words: two a row of 7168 or 8192, so 32 such rows fit the grid of an H200.
    "split_push_4k": dict(split_push_words=4096),
    # The first chunk of x loaded before the state vector, so the two loads' latencies overlap.
    "x_first": dict(x_first=True),
    # At most 8 warps (a row of 4096 is 16 elements a thread): cheaper block-wide reductions.
    "w8": dict(max_warps=8),
}
# Two-shot variants "tpfuse:<name>": rows a program scatters ahead of the ones it reduces and gathers
# (the default is twoshot.GROUP_ROWS; 0 is twoshot.ALL_ROWS, one group of all of a program's rows).
TWOSHOT_GROUPS = {"twoshot_all_rows": 0, "twoshot_g2": 2, "twoshot_g8": 8}
# Two-shot launches with up to 32 warps ("tpfuse:twoshot_w32"): rows of 8192 one 16-byte access a thread.
TWOSHOT_MAX_WARPS = {"twoshot_w32": 32}

#: ``bench kernel --epilogue``: the block ends of real models (``tpfuse.testing.cases.Case`` fields; a
#: scale_group of -1 is one scale a token). "two_branches" all-reduces two inputs: the baselines twice,
#: tpfuse once, their sum (Phi-2 / GPT-NeoX's parallel attention and MLP).
EPILOGUES = {
    "plain": {},
    "bias": dict(bias=True),  # StarCoder2 (with LayerNorm), HF row-parallel layers with a bias
    "gemma": dict(sum_norm=True),  # Gemma 2/3: post-norm, residual add, pre-norm
    "layernorm": dict(bias=True, layer_norm=True, norm_bias=True),  # StarCoder2, GPT-NeoX
    "two_branches": dict(bias=True, layer_norm=True, norm_bias=True),  # Phi-2
    "fp8_token": dict(scale_group=-1),
    "fp8_group128": dict(scale_group=128),
}


def epilogue_case(name: str, tokens: int, hidden: int, seed: int = 0):
    """The :class:`tpfuse.testing.cases.Case` of ``bench kernel --epilogue name`` at one size."""
    from tpfuse.testing.cases import Case

    fields = dict(EPILOGUES[name])
    if fields.get("scale_group") == -1:
        fields["scale_group"] = hidden
    return Case(tokens, hidden, seed=seed, **fields)


class Providers:
    """Resources of every requested provider, created once for calls of up to ``max_tokens`` x ``max_hidden``.

    ``requested`` holds the names of the command line: ``tpfuse``, ``tpfuse:<algorithm or variant>``,
    ``nccl``, ``symm_mem``, ``flashinfer``.
    """

    def __init__(self, requested: list[str], max_tokens: int, max_hidden: int):
        import tpfuse
        from tpfuse.blockend.reference import add_rmsnorm_reference

        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.requested = requested
        self.group_name = dist.group.WORLD.group_name
        self.comm = tpfuse.get_communicator(max_tokens=max_tokens, hidden=max_hidden)
        self.fi = None
        self.floor = None
        if "floor" in requested or "launch" in requested:
            from tpfuse.bench.floor import FloorKernels

            self.floor = FloorKernels(dist.group.WORLD, torch.device("cuda", torch.cuda.current_device()))
        if "flashinfer" in requested:
            from tpfuse.comm.flashinfer import FlashInferBackend

            try:
                self.fi = FlashInferBackend(dist.group.WORLD, max_tokens, max_hidden)
            except ImportError as exc:
                if self.rank == 0:
                    print(f"{exc}; skipping it")
        if "symm_mem" in requested:
            import torch.distributed._symmetric_memory as symm_mem

            from tpfuse.comm.workspace import enable_symm_mem

            enable_symm_mem(self.group_name)
            self.symm_buf = symm_mem.empty(max_tokens * max_hidden, device="cuda", dtype=torch.bfloat16)
            symm_mem.rendezvous(self.symm_buf, self.group_name)
        # The baselines' add + RMSNorm: the reference path's own torch code, compiled.
        self._norm = torch.compile(add_rmsnorm_reference, dynamic=True)

    def release(self) -> None:
        for resource in (self.fi, self.floor):
            if resource is not None:
                resource.release()

    def _sequence_parallel(self, name: str, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor
                           ) -> dict[str, Callable[[], tuple[torch.Tensor, None]]]:
        """Sequence parallel's block end of ``x``'s rows, this rank's rows of ``residual`` added: fused, or
        the group's reduce-scatter, the compiled add + RMSNorm and the group's all-gather."""
        import tpfuse

        rows = x.shape[0] // self.world
        own = residual[self.rank * rows:(self.rank + 1) * rows].contiguous()
        if name == "tpfuse:sp":
            fused = tpfuse.reduce_scatter_add_rmsnorm_all_gather
            return {name: lambda: (fused(x, own, weight, EPS)[0], None)}
        from tpfuse.blockend.epilogue import PLAIN

        scattered, y = torch.empty_like(own), torch.empty_like(x)

        def unfused():
            dist.reduce_scatter_tensor(scattered, x)
            y_own = self._norm(scattered, own, weight, EPS, None, PLAIN)[0]
            dist.all_gather_into_tensor(y, y_own)
            return y, None

        return {"nccl_rs+norm+ag": unfused}

    def calls(self, case, inputs: dict, two_branches: bool = False
              ) -> dict[str, Callable[[], tuple[torch.Tensor, torch.Tensor | None]]]:
        """name -> a function that runs that provider once and returns its ``(y, scales)`` (scales: dynamic
        fp8 only; outputs preallocated where the API allows). ``case`` and ``inputs``: a
        :class:`tpfuse.testing.cases.Case` and its inputs on this rank's device; with ``two_branches``
        ``inputs["x_other"]`` is all-reduced too and added."""
        import tpfuse
        from tpfuse.blockend.call import FusedCall
        from tpfuse.kernels.oneshot import OneShotVariant, oneshot_allreduce_add_rmsnorm
        from tpfuse.kernels.twoshot import twoshot_allreduce_add_rmsnorm

        x, residual, weight = inputs["xs"][self.rank], inputs["residual"], inputs["weight"]
        x_other = inputs["x_other"] if two_branches else None
        n, hidden = x.shape
        comm = self.comm
        dynamic = case.scale_group > 0
        y = torch.empty(x.shape, dtype=torch.float8_e4m3fn if dynamic else x.dtype, device=x.device)
        h = torch.empty_like(x)
        scales = torch.empty((n, hidden // case.scale_group), device=x.device) if dynamic else None
        epilogue = case.epilogue(inputs)
        extras = dict(bias=epilogue.bias, sum_weight=epilogue.sum_weight, layer_norm=epilogue.layer_norm,
                      norm_bias=epilogue.norm_bias)
        out: dict[str, Callable[[], tuple[torch.Tensor, torch.Tensor | None]]] = {}

        def norm(reduced):
            y_ref, _, scales_ref = self._norm(reduced, residual, weight, EPS, None, epilogue)
            return y_ref, scales_ref

        def our_input():  # the fused model all-reduces the sum of both branches once
            return x if x_other is None else x + x_other

        def ours():
            if dynamic:
                y8, s, _ = tpfuse.allreduce_add_rmsnorm_dynamic_fp8(our_input(), residual, weight, EPS,
                                                                    scale_group=case.scale_group, **extras)
                return y8, s
            return tpfuse.allreduce_add_rmsnorm(our_input(), residual, weight, EPS, out=y, residual_out=h,
                                                **extras)[0], None

        def launcher(launch, **kwargs):
            def call():
                launch(comm.fused_backend.launch,
                       FusedCall(our_input(), residual, weight, EPS, y, h, epilogue, scales),
                       **kwargs)
                return y, scales

            return call

        def all_reduced(reduce):  # a baseline all-reduces each branch
            return reduce(x) if x_other is None else reduce(x) + reduce(x_other)

        for name in self.requested:
            if name == "tpfuse":
                out[name] = ours
            elif name == "tpfuse:oneshot":
                out[name] = launcher(oneshot_allreduce_add_rmsnorm)
            elif name == "tpfuse:twoshot":
                out[name] = launcher(twoshot_allreduce_add_rmsnorm)
            elif name in ("tpfuse:sp", "nccl_sp"):
                if epilogue.plain and x_other is None and n % self.world == 0:
                    out.update(self._sequence_parallel(name, x, residual, weight))
            elif name.startswith("tpfuse:"):
                key = name.split(":", 1)[1]
                if key == "twoshot_fp8":  # the two-shot on the fp8 wire (kernels/wire.py)
                    out[name] = launcher(twoshot_allreduce_add_rmsnorm, wire=True)
                elif key in TWOSHOT_MAX_WARPS:
                    out[name] = launcher(twoshot_allreduce_add_rmsnorm, max_warps=TWOSHOT_MAX_WARPS[key])
                elif key in TWOSHOT_GROUPS:
                    out[name] = launcher(twoshot_allreduce_add_rmsnorm, group_rows=TWOSHOT_GROUPS[key])
                else:
                    variant = OneShotVariant(**ONESHOT_VARIANTS[key])
                    out[name] = launcher(oneshot_allreduce_add_rmsnorm, variant=variant)
            elif name == "nccl":

                def nccl_all_reduce(part):
                    reduced = part.clone()
                    dist.all_reduce(reduced)
                    return reduced

                out["nccl+norm"] = lambda: norm(all_reduced(nccl_all_reduce))
            elif name == "symm_mem":

                def symm_all_reduce(part):
                    buf = self.symm_buf[: n * hidden].view(n, hidden)
                    buf.copy_(part)
                    return torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", self.group_name)

                out["symm_oneshot+norm"] = lambda: norm(all_reduced(symm_all_reduce))
            elif name in FLOOR_PROVIDERS:
                out[name] = lambda kernel=getattr(self.floor, name): (kernel(hidden), None)
            elif name == "flashinfer" and self.fi is not None and epilogue.plain and x_other is None:
                fi_y, fi_h = torch.empty_like(x), torch.empty_like(x)
                for label, algorithm in (("fi_oneshot", "oneshot"), ("fi_twoshot", "twoshot")):
                    if algorithm == "twoshot" and n <= self.world:
                        continue

                    def fi_call(algorithm=algorithm, call=FusedCall(x, residual, weight, EPS, fi_y, fi_h)):
                        self.fi.run(algorithm, call)
                        return fi_y, None

                    out[label] = fi_call
        return out


def peer_copy_gbps(n_bytes: int) -> float:
    """One rank's copy of ``n_bytes`` into its next peer's memory, GB/s: the ceiling for any push kernel."""
    import torch.distributed._symmetric_memory as symm_mem

    from tpfuse.bench.timing import graph_replay_us
    from tpfuse.comm.workspace import enable_symm_mem

    group_name = dist.group.WORLD.group_name
    enable_symm_mem(group_name)
    n = n_bytes // 2
    buf = symm_mem.empty(n, device="cuda", dtype=torch.bfloat16)
    handle = symm_mem.rendezvous(buf, group_name)
    src = torch.randn(n, device="cuda").bfloat16()
    peer = handle.get_buffer((dist.get_rank() + 1) % dist.get_world_size(), (n,), torch.bfloat16)
    us = graph_replay_us(lambda: peer.copy_(src), calls_per_graph=4, replays=10)
    dist.barrier()
    return n_bytes / us / 1e3
