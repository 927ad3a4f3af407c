"""The model families beyond Llama (issue 31): Qwen3 (per-head q/k norms), Qwen3-MoE and
Mixtral (sparse mixtures of experts). Each random tiny checkpoint's greedy tokens equal
transformers' in float32 (a divergence only at a near-tie, ``tests/oracle.py``): with
chunked prefill, prefix caching, recompute preemption, the Triton attention in the
interpreter, and two tensor-parallel ranks. The experts run on their own tokens only,
load from both checkpoint layouts, and quantise like dense layers.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from llmserve import LLM, SamplingParams
from llmserve.distributed.shapes import check_tensor_parallel
from llmserve.model_executor.layers.fused_moe.layer import SparseMoeBlock
from llmserve.model_executor.layers.fused_moe.routing import softmax_top_k
from llmserve.model_executor.layers.quantization import QuantizedLinear
from tests.conftest import write_tiny_checkpoint
from tests.differential import reconfigure
from tests.oracle import assert_greedy_matches, load_hf, random_prompts

NEW_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
# (kind for write_tiny_checkpoint, config overrides)
FAMILIES = {
    "qwen3": ("qwen3", {}),
    # The router's top-k not renormalised, and a dense layer among the sparse ones.
    "qwen3_moe": ("qwen3_moe", dict(norm_topk_prob=False, mlp_only_layers=[1])),
    "qwen3_moe_norm": ("qwen3_moe", dict(norm_topk_prob=True)),
    "mixtral": ("mixtral", {}),
}


@pytest.fixture(scope="module")
def family_models(tmp_path_factory, builtin_path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {name: write_tiny_checkpoint(root / name, builtin_path, kind, seed=5, **overrides)
            for name, (kind, overrides) in FAMILIES.items()}


def prompts_of(seed: int, lengths=(1, 7, 17, 40, 129, 300)) -> list[list[int]]:
    return random_prompts(seed, lengths)


def assert_matches(llm: LLM, path: Path, prompts: list[list[int]]) -> None:
    assert_greedy_matches(llm, path, prompts)


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("budget, chunked", [(16, True), (2048, False)])
def test_greedy_tokens_equal_transformers(family_models, family, budget, chunked):
    path = family_models[family]
    llm = LLM(str(path), max_num_batched_tokens=budget, enable_chunked_prefill=chunked,
              kv_cache_memory=32 << 20)
    assert_matches(llm, path, prompts_of(len(family)))
    llm.engine.block_manager.check_all_free()


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "mixtral"])
def test_prefix_hits_and_recompute_preemption_keep_the_tokens(family_models, family):
    """Prompts sharing a long prefix, on a cache too small for all of them at once:
    later prompts start from cached blocks, and running ones are preempted and
    recomputed, without changing a token."""
    path = family_models[family]
    rng = random.Random(9)
    shared = [rng.randrange(3, 49152) for _ in range(64)]
    prompts = [shared + [rng.randrange(3, 49152) for _ in range(n)] for n in (3, 20, 45, 70)]
    llm = LLM(str(path), kv_cache_memory=16 << 20, max_num_batched_tokens=32)
    # 13 blocks of 16 tokens: the longest prompt and its output need 9 of them
    reconfigure(llm.engine, 13, 0, preemption_mode="recompute", watermark=0.0)
    assert_matches(llm, path, prompts)
    scheduler, blocks = llm.engine.scheduler, llm.engine.block_manager
    assert scheduler.num_preemptions > 0 and blocks.prefix_hits > 0
    blocks.check_all_free()


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "mixtral"])
def test_triton_attention_in_the_interpreter(family_models, family):
    path = family_models[family]
    llm = LLM(str(path), attention_backend="triton", kv_cache_memory=16 << 20,
              max_num_batched_tokens=32)
    # with the Triton backend, a MoE layer's experts run in the grouped Triton kernel
    blocks = [m for m in llm.engine.runner.model.modules() if isinstance(m, SparseMoeBlock)]
    assert all(b.w13 is not None and not b.experts for b in blocks)
    assert bool(blocks) == (family != "qwen3")
    assert_matches(llm, path, prompts_of(3, lengths=(5, 21, 40)))


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_two_tensor_parallel_ranks(family_models, family):
    """Heads and every expert's rows split over two ranks; the router replicated."""
    path = family_models[family]
    llm = LLM(str(path), tensor_parallel_size=2, kv_cache_memory=16 << 20,
              max_num_batched_tokens=32)
    try:
        assert_matches(llm, path, prompts_of(4, lengths=(3, 30, 70)))
    finally:
        llm.shutdown()


def test_each_expert_runs_on_the_tokens_routed_to_it_only(family_models):
    """The MoE block's work follows its active parameters: every expert call gets
    exactly the tokens whose top-k chose it, and an expert nobody chose never runs."""
    llm = LLM(str(family_models["mixtral"]), kv_cache_memory=16 << 20)
    block = llm.engine.runner.model.model.layers[0].mlp
    assert isinstance(block, SparseMoeBlock)
    calls: dict[int, torch.Tensor] = {}
    for e, expert in enumerate(block.experts):
        expert.register_forward_hook(lambda m, args, out, e=e: calls.__setitem__(e, args[0]))
    x = torch.randn(11, 64)
    with torch.no_grad():
        got = block(x)
        _, chosen = softmax_top_k(block.gate(x), block.top_k, True)
    for e in range(block.num_experts):
        routed = (chosen == e).any(dim=-1)
        if not routed.any():
            assert e not in calls
        else:
            assert torch.equal(calls[e], x[routed])
    assert sum(len(rows) for rows in calls.values()) == 11 * block.top_k
    # ... and the sum is the dense definition: every token's top-k experts, weighted.
    weights, chosen = softmax_top_k(block.gate(x), block.top_k, True)
    with torch.no_grad():
        want = torch.stack([sum(w * block.experts[int(e)](row[None])[0]
                                for w, e in zip(weights[t], chosen[t]))
                            for t, row in enumerate(x)])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_routing_renormalises_only_when_asked():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0], [0.0, 0.0, 3.0, 1.0]])
    raw, experts = softmax_top_k(logits, 2, renormalize=False)
    norm, same = softmax_top_k(logits, 2, renormalize=True)
    assert experts.tolist() == [[0, 1], [2, 3]] and torch.equal(experts, same)
    torch.testing.assert_close(raw, torch.softmax(logits, -1).gather(1, experts))
    torch.testing.assert_close(norm.sum(-1), torch.ones(2))
    assert (raw.sum(-1) < 1).all()


def test_fused_expert_tensors_load_as_per_expert_ones(family_models, tmp_path):
    """A checkpoint in transformers 5's in-memory layout (``experts.gate_up_proj``
    [experts, 2I, hidden], ``experts.down_proj`` [experts, hidden, I]) serves the
    same tokens as the per-expert one it was made from."""
    path = family_models["qwen3_moe_norm"]
    hf = load_hf(path)
    fused = tmp_path / "fused"
    fused.mkdir()
    state = {k: v.contiguous() for k, v in hf.state_dict().items() if k != "lm_head.weight"
             or not hf.config.tie_word_embeddings}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    save_file(state, fused / "model.safetensors", metadata={"format": "pt"})
    for f in path.iterdir():
        if f.suffix != ".safetensors":
            (fused / f.name).write_bytes(f.read_bytes())
    prompts = prompts_of(6, lengths=(4, 33))
    want = [o.outputs[0].token_ids for o in LLM(str(path), kv_cache_memory=16 << 20)
            .generate(prompts, GREEDY)]
    got = [o.outputs[0].token_ids for o in LLM(str(fused), kv_cache_memory=16 << 20)
           .generate(prompts, GREEDY)]
    assert got == want


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_experts_are_quantised_like_dense_layers(family_models, quantization):
    """Every expert projection (bf16 activations, int8/int4 weights) is quantised, and
    the model's prompt log-probabilities stay close to float32's."""
    path = str(family_models["mixtral"])
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    prompt = prompts_of(8, lengths=(60,))

    def prompt_logprobs(llm):
        out = llm.generate(prompt, params)[0].prompt_logprobs[1:]
        return torch.tensor([p.logprob for p in out])

    ref = prompt_logprobs(LLM(path, kv_cache_memory=16 << 20))
    llm = LLM(path, kv_cache_memory=16 << 20, quantization=quantization)
    for layer in llm.engine.runner.model.model.layers:
        for expert in layer.mlp.experts:
            assert isinstance(expert.gate_up_proj, QuantizedLinear)
            assert isinstance(expert.down_proj, QuantizedLinear)
            assert expert.gate_up_proj.bits == (8 if quantization == "int8" else 4)
    err = (prompt_logprobs(llm) - ref).abs().mean().item()
    assert err < (0.05 if quantization == "int8" else 0.3), err


def test_tensor_parallel_sizes_count_the_experts_rows(family_models):
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(family_models["qwen3_moe"])
    config.moe_intermediate_size = 30  # 30 rows split in 2, not in 4
    check_tensor_parallel(config, 2)
    with pytest.raises(ValueError, match="experts' intermediate size 30 is not divisible by 4"):
        check_tensor_parallel(config, 4)
