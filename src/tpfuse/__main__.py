"""Command line: ``python -m tpfuse {demo,bench}``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tpfuse", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the fused op on several ranks and check it")
    demo.add_argument("--world-size", type=int, default=None)
    bench = sub.add_parser("bench", help="benchmarks (run under torchrun on GPUs)")
    bench.add_argument("what", choices=["kernel"])
    bench.add_argument("--hidden", default="4096,7168,8192")
    bench.add_argument("--tokens", default="1,2,4,8,16,32,64,128,256,512")
    bench.add_argument("--providers", default="tpfuse,nccl,symm_mem,flashinfer")
    bench.add_argument("--out", default="results")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from tpfuse.demo import run_demo

        return run_demo(args.world_size)
    from tpfuse.bench.kernel import run_kernel_bench

    return run_kernel_bench([int(h) for h in args.hidden.split(",")], [int(t) for t in args.tokens.split(",")],
                            args.providers.split(","), args.out)


if __name__ == "__main__":
    sys.exit(main())
