"""Command line: ``python -m tpfuse {demo,bench,tune,info}``."""

from __future__ import annotations

import argparse
import sys

POWERS_OF_TWO_TO_8192 = ",".join(str(1 << i) for i in range(14))


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tpfuse", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo", help="compile a TP Llama with the fusion pass and check it (CPU ranks or GPUs)"
    )
    demo.add_argument("--world-size", type=int, default=None)
    bench = sub.add_parser("bench", help="benchmarks (run under torchrun on GPUs)")
    bench.add_argument("what", choices=["kernel", "e2e", "host"])
    bench.add_argument("--hidden", default=None, help="kernel (default 4096,7168,8192), host (default 4096)")
    bench.add_argument("--tokens", default=None,
                       help=f"kernel (default {POWERS_OF_TWO_TO_8192}), host (default 1,64)")
    bench.add_argument(
        "--providers",
        default=None,
        help="kernel: tpfuse, tpfuse:oneshot, tpfuse:twoshot, tpfuse:<variant>, nccl, symm_mem, "
        "flashinfer, floor, launch, and sequence parallel's tpfuse:sp and nccl_sp (default "
        "tpfuse,nccl,symm_mem,flashinfer,floor,launch); e2e: unfused, tpfuse, flashinfer",
    )
    bench.add_argument("--epilogue", default="plain",
                       help="kernel: the block ends every provider computes, comma-separated: plain, "
                       "bias, gemma, layernorm, two_branches, fp8_token, fp8_group128 "
                       "(tpfuse.bench.providers.EPILOGUES)")
    bench.add_argument("--client", default="tpfuse", choices=["tpfuse", "hf"],
                       help="e2e: our TP Llama, or Hugging Face's LlamaForCausalLM under tp_plan='auto'")
    bench.add_argument("--preset", default="llama-3-8b", help="e2e: model preset")
    bench.add_argument("--layers", type=int, default=None, help="e2e: layers (default: the preset's)")
    bench.add_argument("--batches", default="1,8,32,64", help="e2e: decode batch sizes")
    bench.add_argument("--prefill", type=int, default=2048, help="e2e: prefill tokens (and KV cache length)")
    bench.add_argument("--mode", default="reduce-overhead", help="e2e: torch.compile mode of every provider")
    bench.add_argument("--profile", type=int, default=0, metavar="STEPS",
                       help="e2e: also profile STEPS calls of each workload: time by kernel family")
    bench.add_argument("--out", default="results")
    tune = sub.add_parser("tune", help="measure where each algorithm wins here; write the table (torchrun)")
    tune.add_argument("--hidden", default="4096,7168,8192")
    tune.add_argument("--tokens", default=POWERS_OF_TWO_TO_8192)
    tune.add_argument("--out", default=None, help="table file (default: the user table directory)")
    info = sub.add_parser(
        "info", help="versions, GPUs, peer access, backend, and the algorithm per call size"
    )
    info.add_argument("--hidden", type=int, default=4096)
    info.add_argument("--world-size", type=int, default=None)
    info.add_argument(
        "--max-tokens", type=int, default=None, help="workspace rows of hidden 8192 (default 512)"
    )
    args = parser.parse_args(argv)
    if args.command == "demo":
        from tpfuse.demo import run_demo

        return run_demo(args.world_size)
    if args.command == "tune":
        from tpfuse.bench.tune import run_tune

        return run_tune(_ints(args.hidden), _ints(args.tokens), args.out)
    if args.command == "info":
        from tpfuse.comm.communicator import DEFAULT_MAX_TOKENS
        from tpfuse.info import run_info

        return run_info(args.hidden, args.world_size, args.max_tokens or DEFAULT_MAX_TOKENS)
    if args.what == "e2e":
        from tpfuse.bench.e2e import PROVIDERS, run_e2e_bench

        providers = args.providers.split(",") if args.providers else list(PROVIDERS)
        return run_e2e_bench(args.preset, args.layers, _ints(args.batches), args.prefill, providers, args.out,
                             args.mode, args.client, args.profile)
    if args.what == "host":
        from tpfuse.bench.host import run_host_bench

        return run_host_bench(_ints(args.hidden or "4096"), _ints(args.tokens or "1,64"), args.out)
    from tpfuse.bench.kernel import run_kernel_bench

    providers = args.providers or "tpfuse,nccl,symm_mem,flashinfer,floor,launch"
    return run_kernel_bench(_ints(args.hidden or "4096,7168,8192"),
                            _ints(args.tokens or POWERS_OF_TWO_TO_8192),
                            providers.split(","), args.out,
                            tuple(args.epilogue.split(",")))


if __name__ == "__main__":
    sys.exit(main())
