"""Decoding the way users decode: what tpfuse.compile returns stands in for what it was given.

- A compiled module keeps the model's attributes and methods; one it lacks raises the model's own error.
- Hugging Face ``generate()`` (2 gloo ranks, a tiny Llama under ``tp_plan="auto"`` made here) through each
  documented path: HF's own decode compilation with ``tpfuse.compile_config`` over a static cache, the
  wrapper's ``generate``, and ``model.forward = tpfuse.compile(model.forward)``. Each returns the full
  sequence, every decode step runs every site fused, and the tokens are eager ``generate()``'s or part
  only at a near-tie (:func:`tpfuse.demo.is_near_tie`).
- gpt-fast's way: a compiled ``decode_one_token(model, x, input_pos)`` fuses every site of every step.
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn

import tpfuse
from tpfuse.testing import fused_calls

LIMIT, HIDDEN, PROMPT, NEW_TOKENS = 16, 64, 5, 4


# --- the wrapper stands in for the model (no ranks, nothing compiled) ---------------------------------

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.config = {"hidden": 8}

    def forward(self, x):
        return self.proj(x)

    def describe(self):
        return f"model with {self.proj.in_features} inputs"


def test_compiled_model_reaches_the_models_attributes():
    model = Model()
    compiled = tpfuse.compile(model)
    assert compiled.config is model.config and compiled.proj is model.proj
    assert compiled.describe() == "model with 8 inputs"
    assert list(compiled.state_dict()) == list(model.state_dict())  # the model's keys, no prefix
    assert compiled.eval() is compiled  # a method returning the model returns the wrapper
    compiled.note = "set through the wrapper"
    assert model.note == "set through the wrapper"
    assert isinstance(compiled.tpfuse_backend, tpfuse.compiler.TpfuseBackend)


def test_missing_attribute_raises_the_models_own_error():
    model = Model()
    with pytest.raises(AttributeError) as expected:
        model.generate_nothing  # noqa: B018
    with pytest.raises(AttributeError) as got:
        tpfuse.compile(model).generate_nothing  # noqa: B018
    assert str(got.value) == str(expected.value) and "'Model' object has no attribute" in str(got.value)


def test_compile_takes_functions_and_bound_methods():
    def decode_one_token(model, x):
        """Doc kept."""
        return model(x)

    compiled = tpfuse.compile(decode_one_token)
    assert compiled.__name__ == "decode_one_token" and compiled.__doc__ == "Doc kept."
    assert compiled.__wrapped__ is decode_one_token
    model = Model()
    assert tpfuse.compile(model.forward).__wrapped__ == model.forward
    with pytest.raises(TypeError, match="a module, a function or a bound method"):
        tpfuse.compile(3)


def test_compile_config_refuses_what_cannot_fuse():
    model = Model()
    with pytest.raises(ValueError, match="eps a graph input"):
        tpfuse.compile_config(model, dynamic=True)
    model.proj.register_full_backward_hook(lambda *_: None)
    with pytest.raises(ValueError, match="proj carry backward hooks"):
        tpfuse.compile_config(model)
    assert tpfuse.compile_config(Model()).backend is not None


# --- Hugging Face generate() on 2 ranks -------------------------------------------------------------

def _save_llama(rank, world_size, path):
    import transformers

    if rank == 0:
        config = transformers.LlamaConfig(
            hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=128,
            pad_token_id=None, bos_token_id=None, eos_token_id=None)
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    dist.barrier()


def _communicator():
    """A communicator that waits out a peer still compiling: generate() compiles its decode graph between
    fused calls, and one rank of a loaded CI machine can take longer than the default wait."""
    tpfuse.get_communicator(max_tokens=LIMIT, hidden=HIDDEN, wait_timeout_s=300)


def _greedy(generate, ids, **kwargs):
    """generate()'s tokens and per-step logits (float), greedy."""
    out = generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
                   return_dict_in_generate=True, **kwargs)
    return out.sequences, torch.stack([s.float() for s in out.logits], 1)


def _generate_paths(rank, world_size, path, paths):
    """Per path: (sequences, fused kernel calls during generate(), near-tie verdict where tokens part)."""
    from transformers import AutoModelForCausalLM

    from tpfuse.demo import is_near_tie

    _communicator()
    ids = torch.randint(0, 256, (2, PROMPT), generator=torch.Generator().manual_seed(1))
    results = {}
    for name in paths:
        torch._dynamo.reset()
        model = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=torch.bfloat16)
        with torch.no_grad():
            expected, expected_logits = _greedy(model.generate, ids)
        kwargs = {}
        if name == "compile_config":  # generate()'s own compilation, decode steps only
            model.generation_config.compile_config = tpfuse.compile_config(model, mode=None)
            generate, kwargs = model.generate, {"cache_implementation": "static"}
        elif name == "wrapper":  # the model's own calls go through the compiled call, prefill included
            generate = tpfuse.compile(model).generate
        else:  # Hugging Face's idiom
            model.forward = tpfuse.compile(model.forward)
            generate = model.generate
        tpfuse.reset_stats()
        got, logits = _greedy(generate, ids, **kwargs)
        calls = fused_calls(backends=("triton",))
        parted = None
        if not torch.equal(got, expected):  # where they part, was eager's choice a near-tie?
            step = next(i for i in range(NEW_TOKENS)
                        if not torch.equal(got[:, PROMPT + i], expected[:, PROMPT + i]))
            first, second = expected_logits[:, step].topk(2, -1).values.unbind(-1)
            noise = (logits[:, step] - expected_logits[:, step]).abs().max().item()
            parted = is_near_tie((first - second).min().item(), noise, expected_logits.abs().max().item())
        results[name] = (got.tolist(), expected.tolist(), calls, parted)
    return results


# Sites a forward: the attention's and the MLP's all-reduce of 2 layers.
SITES = 4


def _check_generate(per_rank, name, fused_forwards):
    got, expected, calls, parted = per_rank[0][name]
    assert all(r[name][0] == got for r in per_rank), "ranks generated different tokens"
    assert len(got[0]) == PROMPT + NEW_TOKENS, got  # the full sequence
    assert got == expected or parted is True, (got, expected, parted)
    assert all(r[name][2] == SITES * fused_forwards for r in per_rank), [r[name][2] for r in per_rank]


def test_hugging_face_generate_with_compile_config(rank_pool, tmp_path):
    pool = rank_pool(2)
    pool.run(_save_llama, str(tmp_path))
    per_rank = pool.run(_generate_paths, str(tmp_path), ["compile_config"], timeout=900)
    # Prefill runs eagerly (unfused), each of the other NEW_TOKENS - 1 forwards decodes fused.
    _check_generate(per_rank, "compile_config", NEW_TOKENS - 1)


@pytest.mark.extended  # two more compilations of the same model (prefill and decode graphs each)
def test_hugging_face_generate_through_the_wrapper_and_a_compiled_forward(rank_pool, tmp_path):
    pool = rank_pool(2)
    pool.run(_save_llama, str(tmp_path))
    per_rank = pool.run(_generate_paths, str(tmp_path), ["wrapper", "forward"], timeout=1200)
    for name in ("wrapper", "forward"):  # prefill (2 x 5 tokens, under the limit) fuses too
        _check_generate(per_rank, name, NEW_TOKENS)


# --- gpt-fast: a compiled decode step ---------------------------------------------------------------

def decode_one_token(model, x, input_pos):
    """gpt-fast's decode step: one token per sequence at ``input_pos``, the next one greedily."""
    logits = model(x, input_pos)
    return logits[:, -1].argmax(-1, keepdim=True)


def _gpt_fast_decode(rank, world_size):
    from tpfuse.models import Transformer

    _communicator()
    model = Transformer.build("tiny", n_layers=2)
    compiled = tpfuse.compile(decode_one_token)
    prompt = torch.randint(0, 256, (1, PROMPT), generator=torch.Generator().manual_seed(2))
    tokens = {}
    calls = []
    with torch.no_grad():
        for name, step in (("eager", decode_one_token), ("compiled", compiled)):
            model.setup_caches(max_batch=1, max_seq=PROMPT + NEW_TOKENS)
            out = [model(prompt, torch.arange(PROMPT))[:, -1].argmax(-1, keepdim=True)]
            for i in range(NEW_TOKENS - 1):
                tpfuse.reset_stats()
                out.append(step(model, out[-1], torch.tensor([PROMPT + i])))
                calls.append(fused_calls(backends=("triton",)))
            tokens[name] = torch.cat(out, 1).tolist()
    reports = [[str(s) for s in graph] for graph in compiled.tpfuse_backend.reports]
    return tokens, calls[NEW_TOKENS - 1:], reports


def test_gpt_fast_compiled_decode_one_token_fuses_every_site(rank_pool):
    per_rank = rank_pool(2).run(_gpt_fast_decode, timeout=900)
    tokens, calls, reports = per_rank[0]
    assert all(r[0]["compiled"] == tokens["compiled"] for r in per_rank)
    assert tokens["compiled"] == tokens["eager"], tokens
    assert len(reports) == 1 and len(reports[0]) == SITES and all(": fused (" in s
                                                                  for s in reports[0]), reports
    assert all(c == SITES for r in per_rank for c in r[1]), [r[1] for r in per_rank]  # every decode step
