"""``python -m tpfuse bench e2e``: decode-step and prefill latency of the tensor-parallel Llama.

Three ways to run the same model (:class:`tpfuse.models.Transformer`, random weights, bf16), each
compiled with the same ``torch.compile`` mode (``mode="reduce-overhead"``, CUDA graphs, unless
``--mode`` says otherwise):

- ``unfused``: ``torch.compile`` as is: NCCL all-reduce, Inductor's add + RMSNorm;
- ``tpfuse``: :func:`tpfuse.compile` with the Triton backend;
- ``flashinfer``: :func:`tpfuse.compile` with the communicator's ``flashinfer`` backend (when importable).

A decode step is one token for each of ``batch`` sequences whose KV cache holds ``prefill``
positions; the prefill is ``prefill`` tokens of one sequence. Times are CUDA-event milliseconds per
call over back-to-back calls (median of repeats, slowest rank). Every provider's logits are compared
with the unfused model's: the largest difference, and the argmax agreement over every row and over the
rows whose top two are not a near-tie (:func:`argmax_agreement`). ``--profile STEPS`` adds where each
step's time goes, by kernel family (GEMMs, attention, collectives, Inductor's kernels, copies) and the time
the GPU waits for the host.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from tpfuse.bench.output import pyplot, write_csv
from tpfuse.bench.timing import progress
from tpfuse.testing import environment, fused_calls

PROVIDERS = ("unfused", "tpfuse", "flashinfer")


def _ms_per_call(fn, device: torch.device, iters: int = 20, repeats: int = 5) -> float:
    """Median over ``repeats`` of back-to-back calls (CUDA events; wall clock on the CPU), slowest rank.

    On the CPU (the tests) one warm-up and one repeat: there the number only shows the path runs.
    """
    cuda = device.type == "cuda"
    warmup, repeats = (3, repeats) if cuda else (1, 1)
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        samples.append(_elapsed_ms(fn, iters, cuda) / iters)
    t = torch.tensor([sorted(samples)[len(samples) // 2]], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _elapsed_ms(fn, calls: int, cuda: bool) -> float:
    """Milliseconds ``calls`` back-to-back calls of ``fn`` take: CUDA events on a GPU, else wall clock."""
    if not cuda:
        began = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - began) * 1000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def _compiled(provider: str, model, max_tokens: int, hidden: int, mode: str):
    import tpfuse

    torch._dynamo.reset()
    tpfuse.destroy_all()
    if provider == "unfused":
        return torch.compile(model, mode=mode, dynamic=True)
    backend = "triton" if provider == "tpfuse" else "flashinfer"
    tpfuse.get_communicator(max_tokens=max_tokens, hidden=hidden, backend=backend)
    return tpfuse.compile(model, mode=mode)


#: Kernel families a profile sorts a step's time into: (family, name fragments); the first match wins.
KERNEL_FAMILIES = (
    # Fused all-reduce kernels (tpfuse's, FlashInfer's) count as collectives too.
    ("collective", ("nccl", "allreduce", "all_reduce", "allgather", "wait_tensor", "lamport")),
    ("attention", ("sdpa", "flash", "fmha", "attention", "attn")),
    ("gemm", ("gemm", "gemv", "nvjet", "cutlass", "xmma", "cublas", "splitk", "aten::mm", "aten::addmm",
              "aten::bmm")),
    ("inductor", ("triton_", "cpp_fused")),
    ("copy", ("memcpy", "memset", "copy", "fill", "elementwise", "cat")),
)


def kernel_family(name: str) -> str:
    """The :data:`KERNEL_FAMILIES` entry a kernel (or, on the CPU, an aten op) belongs to, else "other"."""
    lowered = name.lower()
    for family, fragments in KERNEL_FAMILIES:
        if any(fragment in lowered for fragment in fragments):
            return family
    return "other"


@dataclass
class StepProfile:
    """Where one workload's step spends its time: milliseconds per step, from ``torch.profiler``."""

    step_ms: float  # the steps' elapsed time (CUDA events; wall clock on the CPU), per step
    busy_ms: float  # kernel time summed (the GPU's busy time; on the CPU, ops' self time)
    kernels: collections.Counter  # kernel name -> ms per step

    def families(self) -> dict[str, float]:
        out = dict.fromkeys([f for f, _ in KERNEL_FAMILIES] + ["other"], 0.0)
        for name, ms in self.kernels.items():
            out[kernel_family(name)] += ms
        return out


def profile_step(fn: Callable[[], object], device: torch.device, steps: int = 10) -> StepProfile:
    """Run ``fn`` ``steps`` times under ``torch.profiler``: per-kernel time per step. Call it warm
    (:func:`time_providers` profiles right after timing the same calls).

    On a GPU the kernels inside CUDA-graph replays are counted one by one; the gap between the step
    time and the busy time is time the GPU waited for the host.
    """
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        elapsed_ms = _elapsed_ms(fn, steps, cuda)
    kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    kernels = collections.Counter()
    for event in prof.events():
        if event.device_type == kind:
            # Self time on the CPU: aten ops nest (linear -> mm), kernels do not.
            us = event.device_time if cuda else event.self_cpu_time_total
            kernels[event.name] += us / 1000 / steps
    return StepProfile(elapsed_ms / steps, sum(kernels.values()), kernels)


@dataclass(frozen=True)
class E2ERun:
    """What every timed call of one benchmark run shares (one value through the harness).

    Attributes
    ----------
    rank : int
        This process's rank (rank 0 prints).
    batches : tuple of int
        Sequences per decode step, one workload each.
    prefill : int
        Positions the KV cache holds before a decode step; tokens of the prefill workload.
    providers : tuple of str
        :data:`PROVIDERS` to time, in order (``unfused`` first: the others' logits compare with its).
    device : torch.device
        Where the model runs; defaults to the current GPU.
    iters : int
        Calls per timed repeat.
    mode : str or None
        The ``torch.compile`` mode of every provider.
    profile_steps : int
        > 0: each timed workload is also profiled over this many steps.
    """

    rank: int
    batches: tuple[int, ...]
    prefill: int
    providers: tuple[str, ...]
    device: torch.device = None
    iters: int = 20
    mode: str | None = "reduce-overhead"
    profile_steps: int = 0

    def __post_init__(self):
        object.__setattr__(self, "batches", tuple(self.batches))
        object.__setattr__(self, "providers", tuple(self.providers))
        if self.device is None:
            object.__setattr__(self, "device", torch.device("cuda", torch.cuda.current_device()))


@dataclass
class Workload:
    """One timed call: ``step(compiled_model)`` returns the logits; ``reset()`` restores the KV cache."""

    name: str
    tokens: int
    step: Callable
    reset: Callable


def time_providers(run: E2ERun, model, hidden: int, workloads: list[Workload]) -> list[dict]:
    """Compile ``model`` per provider (fused up to ``run.prefill`` tokens), run and time every workload;
    the rows, the same on every rank.

    With ``run.profile_steps``, each timed workload is also profiled (:func:`profile_step`, rank 0's
    view): ``{provider}_gpu_busy_ms`` and ``{provider}_gpu_{family}_ms`` per :data:`KERNEL_FAMILIES`.
    """
    import tpfuse

    rows = {w.name: {"workload": w.name, "tokens": w.tokens} for w in workloads}
    reference = {}  # workload name -> the unfused model's logits
    total, done = len(run.providers) * len(workloads), 0
    for provider in run.providers:
        try:
            fn = _compiled(provider, model, run.prefill, hidden, run.mode)
        except (ImportError, ValueError) as exc:  # FlashInfer missing, or no CUDA for it
            if run.rank == 0:
                print(f"\n{provider}: {exc}; skipping it")
            done += len(workloads)
            continue
        torch._dynamo.reset()  # each provider compiles from nothing: its first calls time the compile
        with _fresh_compile_caches():
            for w in workloads:
                if run.rank == 0:
                    progress(done, total, f"e2e: {provider}, {w.name}")
                _time_workload(run, provider, fn, w, rows[w.name], reference)
                done += 1
    if run.rank == 0:
        progress(total, total, "e2e: done")
    torch._dynamo.reset()
    tpfuse.destroy_all()
    out = list(rows.values())
    for row in out:
        for provider in ("tpfuse", "flashinfer"):
            if f"{provider}_ms" in row and "unfused_ms" in row:
                row[f"{provider}_speedup_%"] = 100 * (row["unfused_ms"] / row[f"{provider}_ms"] - 1)
    return out


@contextlib.contextmanager
def _fresh_compile_caches():
    """Inductor's and Triton's caches in a new, empty folder: compile times as a first run has them."""
    import tempfile

    names = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")
    with tempfile.TemporaryDirectory(prefix="tpfuse-e2e-cache-") as folder, \
            environment({name: os.path.join(folder, name.lower()) for name in names}):
        yield


def _time_workload(run: E2ERun, provider: str, fn, w: Workload, row: dict, reference: dict) -> None:
    """Run and time one workload with one provider's compiled model ``fn``: its columns of ``row``.

    ``{provider}_first_call_s`` is the first call's wall time: with fresh caches, the compile it triggers
    (the first workload compiles the graphs, later ones any new shapes) and one step.
    """
    import tpfuse

    device, name = run.device, w.name
    with torch.no_grad():
        w.reset()
        tpfuse.reset_stats()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        logits = w.step(fn).float().clone()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        row[f"{provider}_first_call_s"] = time.perf_counter() - started
        fused = fused_calls()
        row[f"{provider}_ms"] = _ms_per_call(lambda: w.step(fn), device, run.iters)
        if run.profile_steps:
            profile = profile_step(lambda: w.step(fn), device, run.profile_steps)
            row[f"{provider}_gpu_busy_ms"] = profile.busy_ms
            for family, ms in profile.families().items():
                row[f"{provider}_gpu_{family}_ms"] = ms
            if run.rank == 0:
                print(f"\n{provider} {name}: profiled step {profile.step_ms:.3f} ms, kernels "
                      f"{profile.busy_ms:.3f} ms; the largest:")
                for kernel, ms in profile.kernels.most_common(8):
                    print(f"  {ms * 1000:9.1f} us  [{kernel_family(kernel)}] {kernel[:100]}")
    row[f"{provider}_fused_calls"] = fused
    if run.rank == 0:
        print(f"\n{provider:>10} {name:>14}: {row[f'{provider}_ms']:.3f} ms, {fused} fused calls, "
              f"first call {row[f'{provider}_first_call_s']:.1f} s", flush=True)
    if provider == "unfused":
        reference[name] = logits
    elif name in reference:
        ref = reference[name]
        row[f"{provider}_logit_diff"] = ((logits - ref).abs().max() / ref.abs().max()).item()
        agree, clear_agree, clear_rows = argmax_agreement(logits, ref)
        row[f"{provider}_argmax_agree"] = agree
        row[f"{provider}_argmax_agree_clear"] = clear_agree
        row[f"{provider}_argmax_clear_rows"] = clear_rows


#: :func:`argmax_agreement`'s clear rows: the reference's top two logits differ by at least this fraction of
#: the row's largest |logit|, four bf16 steps of it (a bf16 logit is rounded to 2^-8 of its size, or finer).
#: Closer top two are near-ties that a change of rounding alone flips: the tiny HF Llama of the tests
#: (2026-12-05) has one whose top two are 0.0015 apart in float64 at 0.486, under one bf16 step (0.002);
#: the uncompiled model and tpfuse round both to 0.4863 (a tie: argmax takes the lower index), Inductor's
#: unfused graph the second to 0.4844, each logit within 0.0021 of float64.
ARGMAX_MARGIN = 2 ** -6


def argmax_agreement(logits: torch.Tensor, reference: torch.Tensor,
                     margin: float = ARGMAX_MARGIN) -> tuple[float, float, int]:
    """How often ``logits`` and ``reference`` pick the same largest entry of the last dimension.

    Returns
    -------
    agree : float
        The fraction of every row.
    clear_agree : float
        The fraction of the clear rows: those whose ``reference`` top two differ by at least ``margin`` of
        the row's largest |value| (nan if there are none).
    clear_rows : int
        How many rows are clear.
    """
    logits, reference = (t.reshape(-1, t.shape[-1]).float() for t in (logits, reference))
    same = logits.argmax(-1) == reference.argmax(-1)
    top2 = reference.topk(2, -1).values
    clear = top2[:, 0] - top2[:, 1] >= margin * reference.abs().amax(-1)
    clear_agree = same[clear].float().mean().item() if clear.any() else float("nan")
    return same.float().mean().item(), clear_agree, int(clear.sum())


def _fill_caches(model, device: torch.device) -> None:
    """The same cache contents before every workload of every provider, so their logits compare."""
    gen = torch.Generator(device).manual_seed(1)
    for layer in model.layers:
        for cache in (layer.attention.k_cache, layer.attention.v_cache):
            cache.copy_(torch.randn(cache.shape, generator=gen, device=device, dtype=cache.dtype))


def e2e_rank(run: E2ERun, preset: str, layers: int | None) -> list[dict]:
    """Time every provider on our TP Llama (the process group is set up); the rows, the same on every rank.

    On the CPU (tests) the kernels run in Triton's interpreter.
    """
    from tpfuse.models import Transformer

    device, prefill = run.device, run.prefill
    overrides = {"n_layers": layers} if layers else {}
    model = Transformer.build(preset, device=device, **overrides)
    model.setup_caches(max_batch=max(run.batches), max_seq=prefill + 1)
    gen = torch.Generator().manual_seed(0)

    def workload(name: str, batch: int, seq: int, pos: torch.Tensor) -> Workload:
        ids = torch.randint(0, model.args.vocab_size, (batch, seq), generator=gen).to(device)
        return Workload(name, ids.numel(), lambda fn: fn(ids, pos), lambda: _fill_caches(model, device))

    workloads = [workload(f"decode b{b}", b, 1, torch.tensor([prefill], device=device)) for b in run.batches]
    workloads.append(workload(f"prefill {prefill}", 1, prefill, torch.arange(prefill, device=device)))
    return time_providers(run, model, model.args.dim, workloads)


#: The generate() workload: prompt tokens per sequence and new tokens generated per call.
GENERATE_PROMPT, GENERATE_NEW_TOKENS = 128, 64


#: Decode calls one workload of the HF client may make (warm-up and timed): positions its cache keeps free.
DECODE_HEADROOM = 256
#: llama-3-8b as a Hugging Face config (the layer count is the benchmark's).
HF_LLAMA_3_8B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                     vocab_size=128256, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0)


def save_hf_llama(path: str, layers: int, device: torch.device, config: dict | None = None) -> None:
    """Write a Hugging Face Llama with random weights made from ``config`` to ``path`` (once per path)."""
    import pathlib

    from transformers import LlamaConfig, LlamaForCausalLM

    if (pathlib.Path(path) / "config.json").exists():
        return
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(LlamaConfig(**(config or HF_LLAMA_3_8B), num_hidden_layers=layers))
    model.to(torch.bfloat16).save_pretrained(path)
    del model


def hf_checkpoint(preset: str, layers: int) -> str:
    """The HF client's random-weight checkpoint: under ``$TPFUSE_HF_CHECKPOINTS`` (default /tmp/tpfuse-hf)."""
    return os.path.join(os.environ.get("TPFUSE_HF_CHECKPOINTS", "/tmp/tpfuse-hf"), f"{preset}-{layers}")


def hf_e2e_rank(run: E2ERun, path: str, generate_new_tokens: int = GENERATE_NEW_TOKENS) -> list[dict]:
    """Time every provider on the Hugging Face Llama saved at ``path``, loaded with ``tp_plan="auto"``.

    Then, per batch size, ``generate()`` as users call it (:func:`time_generate`: tokens per second
    over a static cache, prompts of ``min(GENERATE_PROMPT, prefill)`` tokens, ``generate_new_tokens``
    new tokens a call).

    A decode step is HF's forward of one token per sequence at position ``prefill`` over a
    :class:`transformers.StaticCache` of ``prefill + DECODE_HEADROOM`` positions (one cache per batch
    size, contents reset before each workload). transformers 5.17's static cache writes each step at
    its own running count, not at ``cache_position``, so every timed call writes one position further
    on (masked out): the headroom holds them, and the reset puts the count back at ``prefill``. The
    prefill is ``prefill`` tokens of one sequence without a cache: after a compiled decode step, a
    compiled prefill into a second StaticCache indexes out of bounds (torch 2.13 and transformers 5.17
    on the CPU, with plain ``torch.compile`` as well). Both keep the last position's logits only, as
    ``generate`` does.
    """
    from transformers import AutoModelForCausalLM, StaticCache

    device, prefill = run.device, run.prefill
    model = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=torch.bfloat16)
    config = model.config
    gen = torch.Generator().manual_seed(0)

    def decode(batch: int) -> Workload:
        ids = torch.randint(0, config.vocab_size, (batch, 1), generator=gen).to(device)
        positions = torch.tensor([prefill], device=device)
        cache = StaticCache(config=config, max_cache_len=prefill + DECODE_HEADROOM)
        with torch.no_grad():  # the cache's tensors are made on first use
            model(input_ids=ids, past_key_values=cache, cache_position=positions, use_cache=True,
                  logits_to_keep=1)

        def reset() -> None:
            fill = torch.Generator(device).manual_seed(1)
            for layer in cache.layers:
                for t in (layer.keys, layer.values):
                    t.copy_(torch.randn(t.shape, generator=fill, device=device, dtype=t.dtype))
                if hasattr(layer, "cumulative_length"):
                    layer.cumulative_length.fill_(prefill)

        def step(fn):
            return fn(input_ids=ids, past_key_values=cache, cache_position=positions, use_cache=True,
                      logits_to_keep=1).logits

        return Workload(f"decode b{batch}", batch, step, reset)

    prompt = torch.randint(0, config.vocab_size, (1, prefill), generator=gen).to(device)
    workloads = [decode(b) for b in run.batches]
    workloads.append(Workload(f"prefill {prefill}", prefill,
                              lambda fn: fn(input_ids=prompt, use_cache=False, logits_to_keep=1).logits,
                              lambda: None))
    rows = time_providers(run, model, config.hidden_size, workloads)
    # a call: new_tokens forwards + a prefill
    generating = dataclasses.replace(run, iters=max(1, run.iters // 10))
    return rows + [time_generate(generating, model, b, prompt=min(GENERATE_PROMPT, prefill),
                                 new_tokens=generate_new_tokens) for b in run.batches]


def time_generate(run: E2ERun, model, batch: int, prompt: int = GENERATE_PROMPT,
                  new_tokens: int = GENERATE_NEW_TOKENS) -> dict:
    """Hugging Face ``generate()`` as users call it, greedy over a static cache: one row.

    ``unfused`` is generate()'s own compilation with Inductor (``CompileConfig(mode=mode)``), the
    other providers the same with :func:`tpfuse.compile_config` (decode steps compiled and fused;
    prefill eager in both, Hugging Face's choice). Per provider: ``{p}_ms`` per generate() call,
    ``{p}_tokens_per_s`` (new tokens of every sequence), ``{p}_fused_calls`` in one call and
    ``{p}_tokens_agree`` (the fraction of generated tokens equal to unfused's).
    """
    from transformers import CompileConfig

    import tpfuse

    device, mode = run.device, run.mode
    ids = torch.randint(0, model.config.vocab_size, (batch, prompt),
                        generator=torch.Generator().manual_seed(3))
    ids = ids.to(device)
    row: dict = {"workload": f"generate b{batch}", "tokens": batch * new_tokens}
    reference = None

    def generate():
        return model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                              cache_implementation="static")

    for provider in run.providers:
        torch._dynamo.reset()
        tpfuse.destroy_all()
        if provider == "unfused":
            config = CompileConfig(mode=mode)
            config._compile_all_devices = device.type != "cuda" or None  # the CPU ranks of the tests
        else:
            try:
                tpfuse.get_communicator(max_tokens=batch, hidden=model.config.hidden_size,
                                        backend="triton" if provider == "tpfuse" else "flashinfer")
            except (ImportError, ValueError) as exc:  # FlashInfer missing, or no CUDA for it
                if run.rank == 0:
                    print(f"\n{provider}: {exc}; skipping it")
                continue
            config = tpfuse.compile_config(model, mode=mode)
        model.generation_config.compile_config = config
        if run.rank == 0:
            progress(0, 1, f"e2e: {provider}, generate b{batch}")
        with torch.no_grad():
            generate()  # compiles
            tpfuse.reset_stats()
            tokens = generate()[:, prompt:]
            row[f"{provider}_fused_calls"] = fused_calls()
            row[f"{provider}_ms"] = _ms_per_call(generate, device, run.iters)
        row[f"{provider}_tokens_per_s"] = batch * new_tokens / row[f"{provider}_ms"] * 1000
        if provider == "unfused":
            reference = tokens
        elif reference is not None:
            row[f"{provider}_tokens_agree"] = (tokens == reference).float().mean().item()
            row[f"{provider}_speedup_%"] = 100 * (row["unfused_ms"] / row[f"{provider}_ms"] - 1)
        if run.rank == 0:
            print(f"\n{provider:>10} generate b{batch}: {row[f'{provider}_tokens_per_s']:.1f} tokens/s, "
                  f"{row[f'{provider}_fused_calls']} fused calls", flush=True)
    model.generation_config.compile_config = None
    torch._dynamo.reset()
    tpfuse.destroy_all()
    return row


def write_outputs(rows: list[dict], title: str, out_dir: str) -> None:
    keys = write_csv(rows, out_dir, "e2e.csv")
    cols = [k for k in keys
            if k.endswith(("_ms", "_speedup_%", "_fused_calls", "_logit_diff", "_tokens_per_s",
                                           "_first_call_s"))
            and "_gpu_" not in k]
    print(f"\n{title}")
    print(f"{'workload':>14} " + " ".join(f"{k:>20}" for k in cols))
    for row in rows:
        print(
            f"{row['workload']:>14} "
            + " ".join(
                f"{row[k]:>20.4g}" if isinstance(row.get(k), float) else f"{row.get(k, '-'):>20}"
                for k in cols
            )
        )
    print_profile(rows)
    plt = pyplot()
    if plt is None:
        return
    providers = [p for p in PROVIDERS if f"{p}_ms" in keys]
    fig, ax = plt.subplots(figsize=(2 + 1.6 * len(rows), 4))
    width = 0.8 / len(providers)
    for i, provider in enumerate(providers):
        ax.bar(
            [j + i * width for j in range(len(rows))],
            [row.get(f"{provider}_ms", 0) for row in rows],
            width,
            label=provider,
        )
    ax.set_xticks(
        [j + width * (len(providers) - 1) / 2 for j in range(len(rows))], [r["workload"] for r in rows]
    )
    ax.set_yscale("log")
    ax.set_ylabel("ms per call (CUDA graphs)")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "e2e.png"), dpi=110)


def print_profile(rows: list[dict]) -> None:
    """Where each profiled workload's step goes, per provider: ms per step by kernel family."""
    families = [f for f, _ in KERNEL_FAMILIES] + ["other"]
    for row in rows:
        providers = [p for p in PROVIDERS if f"{p}_gpu_busy_ms" in row]
        if not providers:
            continue
        print(f"\n{row['workload']}: ms per step" + "".join(f"{p:>12}" for p in providers))
        for label, key in [("step (timed)", "{p}_ms"), ("kernels", "{p}_gpu_busy_ms")] + [
                (f"  {f}", f"{{p}}_gpu_{f}_ms") for f in families]:
            print(f"{label:>24}" + "".join(f"{row[key.format(p=p)]:>12.3f}" for p in providers))


def describe(client: str, preset: str, layers: int | None, world_size: int,
             mode: str = "reduce-overhead") -> str:
    from tpfuse.models.llama import PRESETS

    args = PRESETS[preset]
    model = f"{preset} ({layers or args.n_layers} layers, hidden {args.dim}, bf16)"
    if client == "hf":
        model = (f"Hugging Face LlamaForCausalLM, tp_plan='auto', StaticCache, {model}; generate(): "
                 f"{GENERATE_PROMPT}-token prompts, {GENERATE_NEW_TOKENS} new tokens")
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU process"
    return (f"{model}, {world_size} x {device}, torch.compile mode {mode}, "
            "decode steps and prefill, ms per call")


def run_e2e_bench(
    preset: str, layers: int | None, batches: list[int], prefill: int, providers: list[str], out_dir: str,
    mode: str = "reduce-overhead", client: str = "tpfuse", profile_steps: int = 0,
) -> int:
    """Entry point of ``python -m tpfuse bench e2e``; run it under torchrun, one process a GPU.

    ``client="tpfuse"`` times our own TP Llama (:mod:`tpfuse.models`); ``client="hf"`` a Hugging Face
    ``LlamaForCausalLM`` with ``preset``'s shapes (llama-3-8b only), saved once with random weights
    to ``$TPFUSE_HF_CHECKPOINTS`` (default ``/tmp/tpfuse-hf``) and loaded with ``tp_plan="auto"``.
    """
    from tpfuse.bench.kernel import finish_torchrun, init_torchrun

    if client == "hf" and preset != "llama-3-8b":
        raise ValueError("bench e2e --client hf: only the llama-3-8b preset has a Hugging Face config here")
    if not init_torchrun():
        return 2
    try:
        rank, world_size = dist.get_rank(), dist.get_world_size()
        run = E2ERun(rank, batches, prefill, providers, mode=mode, profile_steps=profile_steps)
        if client == "hf":
            from tpfuse.models.llama import PRESETS

            layers = layers or PRESETS[preset].n_layers
            path = hf_checkpoint(preset, layers)
            if rank == 0:
                save_hf_llama(path, layers, torch.device("cuda", torch.cuda.current_device()))
            dist.barrier()
            rows = hf_e2e_rank(run, path)
        else:
            rows = e2e_rank(run, preset, layers)
        if rank == 0:
            write_outputs(rows, describe(client, preset, layers, world_size, mode), out_dir)
    finally:
        finish_torchrun()
    return 0
