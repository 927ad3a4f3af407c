"""gpt-oss (issue 31): a random tiny GptOssForCausalLM (float32, 4 experts top-2, one
sliding layer and one full, a window shorter than the prompts, YaRN, random non-zero
sinks and biases, a SwiGLU limit its activations reach) gives greedy tokens equal to
transformers' (a divergence only at a near-tie, ``tests/oracle.py``): on the CPU path,
chunked or not, with prefix hits and recompute preemption, the Triton attention in the
interpreter and two tensor-parallel ranks. The router, the experts' clamped SwiGLU,
MXFP4 checkpoints and YaRN on other families are checked on their own.
"""

from __future__ import annotations

import json
import math
import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from llmserve import LLM, SamplingParams
from llmserve.model_executor.layers.fused_moe.routing import top_k_softmax
from llmserve.model_executor.layers.quantization import QuantizedLinear
from llmserve.model_executor.models.gpt_oss import GptOssMoeBlock
from tests.conftest import TOKENIZER_FILES, write_tiny_checkpoint
from tests.differential import reconfigure
from tests.oracle import assert_greedy_matches, load_hf, random_prompts

NEW_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
WINDOW = 24  # layer 0's; layer 1 sees the whole context
LIMIT = 1.0  # the SwiGLU clamp, low enough that random activations pass it
YARN = dict(rope_type="yarn", rope_theta=150000.0, factor=8.0, beta_fast=32.0,
            beta_slow=1.0, truncate=False, original_max_position_embeddings=64)


def write_gpt_oss_checkpoint(out: Path, builtin: Path, seed: int = 3) -> Path:
    """A random 2-layer gpt-oss, saved by transformers (its fused expert layout),
    with the built-in model's tokenizer. Biases and sinks are drawn non-zero (they
    start at zero), so each of them changes the tokens."""
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(seed)
    config = GptOssConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"], max_position_embeddings=512,
        rms_norm_eps=1e-5, initializer_range=0.08, swiglu_limit=LIMIT, rope_parameters=YARN,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    model = GptOssForCausalLM(config)
    stds = {"sinks": 1.0, "router.bias": 0.5, "gate_up_proj_bias": 0.3, "q_proj.bias": 0.3,
            "k_proj.bias": 0.3, "v_proj.bias": 0.3, "o_proj.bias": 0.05,
            "down_proj_bias": 0.05}
    with torch.no_grad():
        for name, p in model.named_parameters():
            std = next((s for suffix, s in stds.items() if name.endswith(suffix)), None)
            if std is not None:
                p.normal_(0, std)
            elif name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (builtin / name).exists():
            shutil.copy(builtin / name, out / name)
    return out


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory, builtin_path) -> Path:
    return write_gpt_oss_checkpoint(tmp_path_factory.mktemp("gpt_oss") / "ckpt", builtin_path)


def prompts_of(seed: int, lengths=(1, 7, 30, 129, 200)) -> list[list[int]]:
    return random_prompts(seed, lengths)


def assert_matches(llm: LLM, path: Path, prompts: list[list[int]]) -> None:
    assert_greedy_matches(llm, path, prompts, min_distinct_tokens=4)


@pytest.mark.parametrize("budget, chunked", [(16, True), (2048, False)])
def test_greedy_tokens_equal_transformers(gpt_oss, budget, chunked):
    """Prompts up to 8x the window; chunks of 16 tokens cross it."""
    llm = LLM(str(gpt_oss), max_num_batched_tokens=budget, enable_chunked_prefill=chunked,
              kv_cache_memory=32 << 20)
    assert_matches(llm, gpt_oss, prompts_of(1))
    llm.engine.block_manager.check_all_free()


def test_prefix_hits_and_recompute_preemption_keep_the_tokens(gpt_oss):
    rng = random.Random(9)
    shared = [rng.randrange(3, 49152) for _ in range(64)]
    prompts = [shared + [rng.randrange(3, 49152) for _ in range(n)] for n in (3, 20, 45, 70)]
    llm = LLM(str(gpt_oss), kv_cache_memory=16 << 20, max_num_batched_tokens=32)
    reconfigure(llm.engine, 13, 0, preemption_mode="recompute", watermark=0.0)
    assert_matches(llm, gpt_oss, prompts)
    scheduler, blocks = llm.engine.scheduler, llm.engine.block_manager
    assert scheduler.num_preemptions > 0 and blocks.prefix_hits > 0
    blocks.check_all_free()


def test_triton_attention_in_the_interpreter(gpt_oss):
    """Sinks and the window in the Triton kernels; the experts stay on the per-expert
    path (the grouped kernel computes neither their biases nor their clamp)."""
    llm = LLM(str(gpt_oss), attention_backend="triton", kv_cache_memory=16 << 20,
              max_num_batched_tokens=32)
    blocks = [m for m in llm.engine.runner.model.modules() if isinstance(m, GptOssMoeBlock)]
    assert len(blocks) == 2 and all(b.w13 is None and len(b.experts) == 4 for b in blocks)
    assert_matches(llm, gpt_oss, prompts_of(3, lengths=(5, 40)))


def test_two_tensor_parallel_ranks(gpt_oss):
    """Heads (with their sinks and biases) and every expert's rows split over two
    ranks; the router replicated; the row-parallel biases added once."""
    llm = LLM(str(gpt_oss), tensor_parallel_size=2, kv_cache_memory=16 << 20,
              max_num_batched_tokens=32)
    try:
        assert_matches(llm, gpt_oss, prompts_of(4, lengths=(3, 30, 70)))
    finally:
        llm.shutdown()


def test_router_takes_the_softmax_after_the_top_k():
    """transformers' GptOssTopKRouter's weights and choices; an unchosen expert's
    logit changes nothing."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter

    torch.manual_seed(0)
    router = GptOssTopKRouter(GptOssConfig(hidden_size=16, num_local_experts=6,
                                           num_experts_per_tok=2))
    with torch.no_grad():
        router.weight.normal_()
        router.bias.normal_()
    x = torch.randn(9, 16)
    logits, want_weights, want_experts = router(x)
    weights, experts = top_k_softmax(logits, 2)
    assert torch.equal(experts, want_experts)
    torch.testing.assert_close(weights, want_weights)
    torch.testing.assert_close(weights.sum(-1), torch.ones(9))
    lowered = logits.clone()
    lowered.scatter_(1, logits.topk(4).indices[:, 2:], -30.0)  # unchosen experts only
    assert torch.equal(top_k_softmax(lowered, 2)[0], weights)


def test_experts_equal_transformers_and_reach_the_clamp(gpt_oss):
    """The loaded MoE block (router bias, interleaved gate/up de-interleaved, biases,
    clamped SwiGLU) equals transformers' GptOssMLP, on activations past the limit."""
    hf = load_hf(gpt_oss)
    llm = LLM(str(gpt_oss), kv_cache_memory=16 << 20)
    ours = llm.engine.runner.model.model.layers[1].mlp
    theirs = hf.model.layers[1].mlp
    x = torch.randn(13, 64) * 3
    with torch.no_grad():
        got, want = ours(x), theirs(x[None])[0][0]
        gate_up = torch.stack([x @ theirs.experts.gate_up_proj[e] for e in range(4)])
    assert (gate_up[..., 0::2] > LIMIT).any() and (gate_up[..., 1::2].abs() > LIMIT).any()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


_reference: dict[str, torch.Tensor] = {}


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_experts_quantise_with_their_biases(gpt_oss, quantization):
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    prompt = prompts_of(8, lengths=(60,))

    def prompt_logprobs(llm):
        out = llm.generate(prompt, params)[0].prompt_logprobs[1:]
        return torch.tensor([p.logprob for p in out])

    if "float32" not in _reference:
        _reference["float32"] = prompt_logprobs(LLM(str(gpt_oss), kv_cache_memory=16 << 20))
    ref = _reference["float32"]
    llm = LLM(str(gpt_oss), kv_cache_memory=16 << 20, quantization=quantization)
    for layer in llm.engine.runner.model.model.layers:
        for expert in layer.mlp.experts:
            for proj in (expert.gate_up_proj, expert.down_proj):
                assert isinstance(proj, QuantizedLinear) and proj.bias is not None
                assert proj.bits == (8 if quantization == "int8" else 4)
    err = (prompt_logprobs(llm) - ref).abs().mean().item()
    assert err < (0.05 if quantization == "int8" else 0.3), err


# --- MXFP4 ---------------------------------------------------------------------------
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                     -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def random_mxfp4(experts: int, rows: int, cols: int, gen: torch.Generator):
    """Random MXFP4 codes for an ``[experts, rows, cols]`` tensor, packed as the released
    checkpoints are (two values a byte, low nibble first; one E8M0 exponent per 32),
    and the float values they stand for, ``[experts, cols, rows]`` (transformers'
    parameter layout)."""
    codes = torch.randint(0, 16, (experts, rows, cols // 32, 32), generator=gen)
    exps = torch.randint(127 - 6, 127 - 2, (experts, rows, cols // 32), generator=gen)
    values = E2M1[codes] * torch.exp2(exps.float() - 127)[..., None]
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return blocks, exps.to(torch.uint8), values.reshape(experts, rows, cols).transpose(1, 2)


def test_mxfp4_checkpoint_is_dequantised_at_load(gpt_oss, tmp_path):
    """The same model with its experts in MXFP4 (``*_blocks``/``*_scales`` and
    ``quantization_config``) loads the weights the codes stand for, and serves
    transformers' tokens of the float checkpoint holding those weights."""
    gen = torch.Generator().manual_seed(0)
    state = load_file(gpt_oss / "model.safetensors")
    dense, packed = tmp_path / "dense", tmp_path / "mxfp4"
    packed_state = dict(state)
    for name in [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        e, cols, rows = state[name].shape  # x @ [cols, rows]: MXFP4 groups the cols
        blocks, scales, values = random_mxfp4(e, rows, cols, gen)
        state[name] = values.contiguous()
        del packed_state[name]
        packed_state[name + "_blocks"], packed_state[name + "_scales"] = blocks, scales
    for out, tensors in ((dense, state), (packed, packed_state)):
        shutil.copytree(gpt_oss, out)
        save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((packed / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
        "lm_head"]}
    (packed / "config.json").write_text(json.dumps(config))

    llm = LLM(str(packed), kv_cache_memory=16 << 20)
    expert = llm.engine.runner.model.model.layers[0].mlp.experts[1]
    gate_up = state["model.layers.0.mlp.experts.gate_up_proj"][1]  # [hidden, 2I] interleaved
    torch.testing.assert_close(expert.gate_up_proj.weight,
                               torch.cat([gate_up[:, 0::2].t(), gate_up[:, 1::2].t()]),
                               rtol=0, atol=0)
    torch.testing.assert_close(expert.down_proj.weight,
                               state["model.layers.0.mlp.experts.down_proj"][1].t(),
                               rtol=0, atol=0)
    assert_matches(llm, dense, prompts_of(6, lengths=(4, 33)))


# --- YaRN ----------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_yarn_rotary_equals_transformers_on_other_families(tmp_path, builtin_path, kind):
    """A YaRN-scaled Llama or Qwen2: the cos/sin tables equal transformers' bit for
    bit, with its attention factor, and greedy tokens equal past the original context."""
    from transformers import AutoConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

    from llmserve.model_executor.models.llama import RotaryEmbedding

    yarn = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64,
                beta_fast=32.0, beta_slow=1.0)
    path = write_tiny_checkpoint(tmp_path / kind, builtin_path, kind, seed=2,
                                 rope_scaling=yarn, max_position_embeddings=256)
    config = AutoConfig.from_pretrained(path)
    assert config.rope_parameters["rope_type"] == "yarn"
    if getattr(config, "head_dim", None) is None:  # Qwen2's (the engine sets it so too)
        config.head_dim = config.hidden_size // config.num_attention_heads
    ours = RotaryEmbedding(config, 300)
    positions = torch.arange(300)
    rotary = LlamaRotaryEmbedding if kind == "llama" else Qwen2RotaryEmbedding
    cos, sin = rotary(config)(torch.zeros(1, dtype=torch.float32), positions[None])
    half = cos.shape[-1] // 2
    assert torch.equal(ours.cos, cos[0, :, :half]) and torch.equal(ours.sin, sin[0, :, :half])
    factor = 0.1 * math.log(4.0) + 1  # YaRN's default attention factor: not 1
    torch.testing.assert_close(ours.cos ** 2 + ours.sin ** 2,
                               torch.full_like(ours.cos, factor ** 2))
    llm = LLM(str(path), kv_cache_memory=16 << 20)
    assert_matches(llm, path, prompts_of(7, lengths=(10, 150)))


def test_only_gpt_oss_mxfp4_passes_the_quantization_check(gpt_oss):
    """MXFP4 is served for gpt-oss only; any other pre-quantised config is refused by
    name, as before."""
    from transformers import AutoConfig

    from llmserve.errors import ModelLoadError
    from llmserve.model_executor.models.supported import check_model_config

    config = AutoConfig.from_pretrained(gpt_oss)
    config.quantization_config = {"quant_method": "mxfp4"}
    check_model_config(config, 2048)
    config.quantization_config = {"quant_method": "fp8"}
    with pytest.raises(ModelLoadError, match="quantization_config"):
        check_model_config(config, 2048)
    config.quantization_config = {"quant_method": "mxfp4"}
    config.architectures = ["LlamaForCausalLM"]
    with pytest.raises(ModelLoadError, match="quantization_config"):
        check_model_config(config, 2048)


# gpt-oss-20b's config.json as released (transformers 4.55's format: rope_scaling).
GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
    "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu",
    "hidden_size": 2880, "initial_context_length": 4096, "initializer_range": 0.02,
    "intermediate_size": 2880, "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072, "model_type": "gpt_oss", "num_attention_heads": 64,
    "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 8,
    "num_local_experts": 32, "output_router_logits": False, "pad_token_id": 199999,
    "quantization_config": {"modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
        "lm_head"], "quant_method": "mxfp4"},
    "rms_norm_eps": 1e-05, "rope_scaling": {
        "beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
        "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128,
    "swiglu_limit": 7.0, "tie_word_embeddings": False, "use_cache": True, "vocab_size": 201088,
}


def test_the_released_config_passes_and_names_the_released_tensors(tmp_path):
    """gpt-oss-20b's config passes the start-up checks, and the model it builds (on the
    meta device) has a parameter of the released checkpoint's name, shape and dtype for
    each of a layer's tensors (MXFP4 blocks [experts, rows, cols/32, 16] uint8)."""
    from transformers import AutoConfig

    from llmserve.model_executor.model_loader.weights import empty_model_init
    from llmserve.model_executor.models.gpt_oss import GptOssForCausalLM
    from llmserve.model_executor.models.supported import check_model_config

    (tmp_path / "config.json").write_text(json.dumps(GPT_OSS_20B))
    config = AutoConfig.from_pretrained(tmp_path)
    check_model_config(config, 131072)
    with empty_model_init():
        model = GptOssForCausalLM(config, 4096)
    params = {model.param_name(name): name for name in (
        "model.layers.0.mlp.experts.gate_up_proj_blocks",
        "model.layers.0.mlp.experts.gate_up_proj_scales",
        "model.layers.0.mlp.experts.gate_up_proj_bias",
        "model.layers.0.mlp.experts.down_proj_blocks",
        "model.layers.0.mlp.experts.down_proj_scales",
        "model.layers.0.mlp.experts.down_proj_bias",
        "model.layers.0.mlp.router.weight", "model.layers.0.mlp.router.bias",
        "model.layers.0.self_attn.sinks", "model.layers.0.self_attn.q_proj.bias")}
    shapes = {name: (tuple(p.shape), p.dtype) for name, p in model.named_parameters()
              if name in params}
    released = {
        "gate_up_proj_blocks": ((32, 5760, 90, 16), torch.uint8),
        "gate_up_proj_scales": ((32, 5760, 90), torch.uint8),
        "gate_up_proj_bias": ((32, 5760), torch.float32),
        "down_proj_blocks": ((32, 2880, 90, 16), torch.uint8),
        "down_proj_scales": ((32, 2880, 90), torch.uint8),
        "down_proj_bias": ((32, 2880), torch.float32),
        "router.weight": ((32, 2880), torch.float32), "router.bias": ((32,), torch.float32),
        "sinks": ((64,), torch.float32), "q_proj.bias": ((4096,), torch.float32)}
    for ours, theirs in params.items():
        want = next(v for k, v in released.items() if theirs.endswith(k))
        assert shapes.get(ours) == want, (theirs, ours, shapes.get(ours))
    assert [layer.self_attn.sliding_window for layer in model.model.layers[:2]] == [128, None]
    assert model.model.rotary.cos.shape == (4096, 32)
