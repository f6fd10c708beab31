"""Test scaffolding, not product: vLLM's CPU build compiling the way vLLM does on GPUs.

Out of the box vLLM's CPU platform replaces ``VLLM_COMPILE`` with one plain ``torch.compile`` (no pass
manager, no compile ranges, the CPU's in-place shared-memory all-reduce in the graph). With
``TPFUSE_VLLM_CPU_GRAPHS=1`` (or ``traced``) this plugin (entry point ``tpfuse_cpu_graphs``, loaded by
vLLM in every process) undoes that, so tpfuse's vLLM tests see GPU-shaped graphs on CPU ranks: vLLM's
piecewise backend, its post-grad pass manager and compile ranges, ``vllm.all_reduce`` and the
``vllm_ir`` norms.
"""

from __future__ import annotations

import os

ENV = "TPFUSE_VLLM_CPU_GRAPHS"
#: Its values: "1", vLLM's norms as its IR ops (the default with Inductor on GPUs); "traced", as aten ops
#: (``ir_enable_torch_wrap=False``, and vLLM before its IR).
GRAPHS = ("1", "traced")
# CUDA-only ops vLLM's FixFunctionalizationPass names; the CPU build lacks them (stubs, never called).
_CUDA_ONLY_OPS = ("fused_add_rms_norm_static_fp8_quant", "rms_norm_dynamic_per_token_quant",
                  "rms_norm_static_fp8_quant", "silu_and_mul_quant", "fused_qk_norm_rope")
_stubs = None


def register() -> None:
    """vLLM plugin entry point: on the CPU platform with ``$TPFUSE_VLLM_CPU_GRAPHS`` set (:data:`GRAPHS`),
    restore ``VLLM_COMPILE`` with Inductor and its custom-op collectives, with or without vLLM's IR ops."""
    global _stubs
    from vllm.platforms import current_platform

    platform = type(current_platform)
    graphs = os.environ.get(ENV)
    if graphs not in GRAPHS or not current_platform.is_cpu() or getattr(platform, "_tpfuse_gpu_graphs",
                                                                        False):
        return
    platform._tpfuse_gpu_graphs = True
    from vllm.config import CompilationMode

    check_and_update = platform.check_and_update_config.__func__

    def check_and_update_config(cls, vllm_config) -> None:
        compilation = vllm_config.compilation_config
        wanted = compilation.mode
        check_and_update(cls, vllm_config)
        if wanted == CompilationMode.VLLM_COMPILE:
            compilation.mode = CompilationMode.VLLM_COMPILE
            compilation.backend = "inductor"
            compilation.ir_enable_torch_wrap = graphs == "1"
            if compilation.compile_sizes is None:  # the piecewise backend looks sizes up in it
                compilation.compile_sizes = []

    platform.check_and_update_config = classmethod(check_and_update_config)
    platform.use_custom_op_collectives = classmethod(lambda cls: True)
    # The CPU communicator sums in place and returns its input: inside vllm.all_reduce, which the graph
    # takes for a new tensor, that corrupts whatever else reads the input (seen: a 5-token prefill's next
    # token unlike Hugging Face's on the same weights). CUDA's all-reduces return a new tensor; so here.
    from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator

    in_place = CpuCommunicator.all_reduce
    CpuCommunicator.all_reduce = lambda self, input_: in_place(self, input_.clone())

    _without_triton_overrides_in_batch_invariant_mode()

    import torch
    import vllm._custom_ops  # noqa: F401  (loads torch.ops._C)

    _stubs = torch.library.Library("_C", "FRAGMENT")
    for name in _CUDA_ONLY_OPS:
        if not hasattr(torch.ops._C, name):
            _stubs.define(f"{name}(Tensor x) -> ()")


def _without_triton_overrides_in_batch_invariant_mode() -> None:
    """Under ``VLLM_BATCH_INVARIANT=1`` vLLM 0.32's CPU build cannot run at all: its worker's
    ``init_batch_invariance`` registers Triton kernels for aten's softmax, log_softmax, mean and bmm on the
    CPU dispatch key, and the CPU build's Triton is vLLM's placeholder ("Triton is installed, but doesn't
    include CPU backend. Disabling Triton"), so the sampler's first softmax fails ("'function' object is
    not subscriptable"), with or without tpfuse. Here those overrides are left out (the rest of the mode
    stays: the flag every layer reads, the environment it sets); the CPU's own aten kernels serve instead,
    so vLLM's other ops are not batch-invariant on these ranks, tpfuse's sites and the mode's switches are
    what the test checks."""
    from vllm import envs

    if not envs.VLLM_BATCH_INVARIANT:
        return
    from vllm.model_executor.determinism import batch_invariant

    batch_invariant.enable_batch_invariant_mode = lambda: None


# What the vLLM tests run, in a process of its own (vLLM starts its workers from it):
#   python -m tpfuse.testing.vllm_cpu --model llama|qwen3|gemma2|granite [--tpfuse] [--max-tokens N] \
#       --out result.json
TINY_CONFIGS = {
    "llama": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "rms_norm_eps": 1e-5,
              "rope_theta": 10000.0},
    "qwen3": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "rms_norm_eps": 1e-6,
              "rope_theta": 1000000.0},
    # Gemma 2: the embedding times sqrt(hidden) (vLLM's normalizer buffer), post-norms, GemmaRMSNorm's 1 + w
    "gemma2": {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "rms_norm_eps": 1e-6,
               "rope_theta": 10000.0, "query_pre_attn_scalar": 64, "sliding_window": 128,
               "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
               "hidden_activation": "gelu_pytorch_tanh",
               "tie_word_embeddings": True},  # vLLM's Gemma 2 has no lm_head of its own
    # Granite: the embedding times embedding_multiplier, each layer's output times residual_multiplier
    "granite": {"architectures": ["GraniteForCausalLM"], "model_type": "granite", "rms_norm_eps": 1e-5,
                "rope_theta": 10000.0, "embedding_multiplier": 12.0, "residual_multiplier": 0.22,
                "attention_multiplier": 0.015625, "logits_scaling": 8.0},
}
#: Greedy prompts: prefills of 5 and 3 tokens (under a 32-token limit) and of 40 (over it).
PROMPTS = ([1, 5, 7, 9, 11], [1, 3, 4], list(range(3, 43)))
TINY_SIZES = {"initializer_range": 0.1, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
              "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 512, "max_position_embeddings": 512,
              "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16",
              "bos_token_id": 1, "eos_token_id": 2}


def tiny_checkpoint(model: str, directory) -> str:
    """A tiny random ``model`` (a key of :data:`TINY_CONFIGS`) saved by transformers in ``directory``:
    weights drawn with std 0.1 from seed 0, so greedy decoding rarely meets a near-tie (vLLM's dummy
    weights give every token the same logit to six digits)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    settings = {**TINY_SIZES, **TINY_CONFIGS[model]}  # a model's own settings over the common sizes
    config = AutoConfig.for_model(settings.pop("model_type"), **settings)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(directory)
    return str(directory)


def fused_counts(worker) -> dict:
    """Worker RPC: tpfuse's call counts in this worker (``tpfuse.stats()``) and its rank."""
    import torch.distributed as dist

    import tpfuse

    return {"rank": dist.get_rank(), **tpfuse.stats()}


def main() -> None:
    import argparse
    import json
    import pathlib
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", choices=sorted(TINY_CONFIGS), default="llama")
    parser.add_argument("--tpfuse", action="store_true", help="with tpfuse's switch (else vLLM alone)")
    parser.add_argument("--max-tokens", type=int, default=None, help="tpfuse's fusion limit (tokens)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    from vllm import LLM, SamplingParams

    # tpfuse's switch, as a user turns it on (docs/vllm.md): vLLM's additional_config
    extra = {"tpfuse": {"max_tokens": args.max_tokens} if args.max_tokens else True} if args.tpfuse else {}
    llm = LLM(model=tiny_checkpoint(args.model, tempfile.mkdtemp(prefix=f"tiny-{args.model}-")),
              skip_tokenizer_init=True, tensor_parallel_size=2, dtype="bfloat16", max_model_len=256,
              max_num_seqs=4, max_num_batched_tokens=256, enforce_eager=False,
              compilation_config={"mode": "VLLM_COMPILE", "custom_ops": []}, additional_config=extra, seed=0)
    # One prompt at a time: vLLM batches requests as they arrive, and a batch of another size runs
    # another graph (fused or not), so two runs would not compute the same steps.
    greedy = SamplingParams(max_tokens=8, temperature=0.0, detokenize=False, logprobs=5)
    outputs = [llm.generate([{"prompt_token_ids": p}], greedy)[0].outputs[0] for p in PROMPTS]
    result = {
        "tokens": [list(o.token_ids) for o in outputs],
        # per step, the five best (token, logprob), best first: where two runs part, how near a tie it was
        "top": [[sorted(((t, lp.logprob) for t, lp in step.items()), key=lambda tl: -tl[1])[:5]
                  for step in o.logprobs] for o in outputs],
    }
    # One forward of 4 tokens and one of 40 (each a prompt's prefill): the calls each made, per rank.
    for name, prompt in (("forward of 4 tokens", [1, 2, 3, 4]), ("forward of 40 tokens", list(range(3, 43)))):
        llm.collective_rpc(_reset_stats)
        llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1, detokenize=False))
        result[name] = llm.collective_rpc(fused_counts)
    pathlib.Path(args.out).write_text(json.dumps(result))


def _reset_stats(worker) -> None:
    import tpfuse

    tpfuse.reset_stats()


if __name__ == "__main__":
    main()
