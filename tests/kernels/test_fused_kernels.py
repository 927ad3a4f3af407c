"""The fused decode-step kernels (kernels/triton/fused.py, ``--fused-kernels``) against
the op-by-op torch path they replace, and an engine that uses them. Without CUDA they
run in Triton's interpreter (fp32 and fp16; its bf16 is wrong), with CUDA on the GPU."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must be set before triton is imported

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from tests.kernel_reference import write_kv_cache_ref  # noqa: E402

fused = pytest.importorskip("llmserve.kernels.triton.fused")
triton_attention = pytest.importorskip("llmserve.kernels.triton.attention")

DEVICE = "cpu" if triton_attention.INTERPRETED else "cuda"
# bf16 on a GPU only: the interpreter computes it wrongly.
DTYPES = [torch.float32, torch.float16] + ([] if DEVICE == "cpu" else [torch.bfloat16])


def _exact_or_one_unit(out: torch.Tensor, ref: torch.Tensor) -> None:
    """fp32: a few ulps (sums in another order); 16-bit: one unit of the last place."""
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    else:
        tol = 1e-2 if out.dtype == torch.bfloat16 else 1e-3
        torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


# --- references: the default path's ops, in Hugging Face's rounding -----------------
def rms_norm_hf(x, weight, eps):
    """transformers' LlamaRMSNorm: fp32 statistics, the normalised row rounded to the
    dtype, then times the weight (rounded again)."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def rope_ref(x, cos, sin):
    from llmserve.model_executor.models.llama import apply_rotary
    return apply_rotary(x, cos, sin)


# --- residual add + RMSNorm ----------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,hidden", [(1, 576), (7, 576), (33, 96), (3, 4096)])
def test_add_rms_norm_matches_the_add_then_the_norm(tokens, hidden, dtype):
    g = torch.Generator().manual_seed(tokens * hidden)
    x = torch.randn(tokens, hidden, generator=g).to(dtype).to(DEVICE)
    residual = (4 * torch.randn(tokens, hidden, generator=g)).to(dtype).to(DEVICE)
    weight = (0.5 + torch.rand(hidden, generator=g)).to(dtype).to(DEVICE)
    x_before, res_before = x.clone(), residual.clone()

    normed, new_residual = fused.add_rms_norm(x, residual, weight, 1e-5)

    summed = x + residual  # rounded to the dtype, as the model's add is
    assert torch.equal(new_residual, summed)
    _exact_or_one_unit(normed, rms_norm_hf(summed, weight, 1e-5))
    assert torch.equal(x, x_before) and torch.equal(residual, res_before)  # out of place


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_without_a_residual(dtype):
    g = torch.Generator().manual_seed(1)
    x = (3 * torch.randn(5, 576, generator=g)).to(dtype).to(DEVICE)
    weight = torch.rand(576, generator=g).to(dtype).to(DEVICE)
    out = fused.rms_norm(x, weight, 1e-6)
    _exact_or_one_unit(out, rms_norm_hf(x, weight, 1e-6))
    if dtype == torch.float32:  # the default path's op agrees in fp32
        _exact_or_one_unit(out, F.rms_norm(x, (576,), weight, 1e-6))


def test_rms_norm_rounds_as_hugging_face_in_fp16():
    """The normalised row is rounded before the weight product (LlamaRMSNorm and the C
    kernel); rounding once after it, as F.rms_norm does, differs in many elements. So
    this fails if the kernel skipped that rounding."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(16, 576, generator=g).half().to(DEVICE)
    weight = (0.5 + 2 * torch.rand(576, generator=g)).half().to(DEVICE)
    out = fused.rms_norm(x, weight, 1e-5)
    hf = rms_norm_hf(x, weight, 1e-5)
    once = F.rms_norm(x.float(), (576,), weight.float(), 1e-5).half()
    assert (out != hf).float().mean() < 0.01
    assert (out != once).float().mean() > 0.05


def test_norm_of_an_empty_batch():
    x = torch.empty(0, 64, device=DEVICE)
    normed, res = fused.add_rms_norm(x, x, torch.ones(64, device=DEVICE), 1e-5)
    assert normed.shape == res.shape == (0, 64)


# --- rotary + KV write ---------------------------------------------------------------
def _rope_case(tokens, heads, kv_heads, head_dim, block_size, dtype, seed, padding=()):
    """A fused projection's output, cos/sin rows of random positions, and slots spread
    over a random permutation of the cache blocks (``padding``: tokens with slot -1)."""
    from llmserve.model_executor.models.llama import rope_inv_freq

    class Config:
        pass
    cfg = Config()
    cfg.head_dim, cfg.rope_theta, cfg.rope_scaling = head_dim, 10000.0, None
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, heads + 2 * kv_heads, head_dim, generator=g).to(dtype)
    positions = torch.randint(0, 4096, (tokens,), generator=g)
    freqs = torch.outer(positions.float(), rope_inv_freq(cfg))
    cos, sin = freqs.cos().unsqueeze(1), freqs.sin().unsqueeze(1)  # [T, 1, d/2] as the model
    num_blocks = tokens // block_size + 5
    # Distinct slots drawn from the whole pool: scattered over blocks and offsets.
    slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens]
    for t in padding:
        slots[t] = -1
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    return [t.to(DEVICE) for t in (qkv, cos, sin, slots.long(), cache)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,heads,kv_heads,head_dim", [
    (1, 9, 3, 64),     # SmolLM2-135M, one decode
    (13, 9, 3, 64),
    (5, 32, 8, 128),   # Llama-3-8B
    (19, 4, 4, 128),   # no GQA
    (6, 6, 1, 80),     # one KV head, a head_dim that is no power of two
])
def test_rope_and_write_kv_matches_rotary_then_cache_write(tokens, heads, kv_heads, head_dim,
                                                            dtype):
    qkv, cos, sin, slots, cache = _rope_case(tokens, heads, kv_heads, head_dim, 16, dtype,
                                             seed=tokens + heads + head_dim, padding=(2,)
                                             if tokens > 2 else ())
    expected = cache.clone()
    qk = rope_ref(qkv[:, :heads + kv_heads], cos, sin)
    q_ref, k_ref = qk.split([heads, kv_heads], dim=1)
    write_kv_cache_ref(k_ref, qkv[:, heads + kv_heads:], expected[0], expected[1], slots)

    q = fused.rope_and_write_kv(qkv, cos, sin, cache[0], cache[1], slots, heads)

    _exact_or_one_unit(q, q_ref)
    _exact_or_one_unit(cache, expected)  # written slots, and every other slot untouched
    untouched = torch.ones(cache.shape[1] * cache.shape[2], dtype=torch.bool, device=DEVICE)
    untouched[slots[slots >= 0]] = False
    flat = cache.view(2, -1, kv_heads, head_dim)
    assert torch.equal(flat[:, untouched], expected.view(2, -1, kv_heads, head_dim)[:, untouched])
    # V is copied bit for bit.
    live = slots >= 0
    assert torch.equal(flat[1, slots[live]], qkv[live, heads + kv_heads:])


def test_rope_and_write_kv_reads_a_strided_projection():
    """qkv as the attention layer hands it over: a view of the projection's rows."""
    qkv, cos, sin, slots, cache = _rope_case(4, 8, 2, 64, 16, torch.float32, seed=3)
    wide = torch.zeros(4, 14, 64, device=DEVICE)
    wide[:, :12] = qkv
    expected = cache.clone()
    q_ref = fused.rope_and_write_kv(qkv, cos, sin, expected[0], expected[1], slots, 8)
    q = fused.rope_and_write_kv(wide[:, :12], cos, sin, cache[0], cache[1], slots, 8)
    assert torch.equal(q, q_ref) and torch.equal(cache, expected)


def test_rope_and_write_kv_refuses_a_mismatched_projection():
    qkv, cos, sin, slots, cache = _rope_case(2, 8, 2, 64, 16, torch.float32, seed=4)
    with pytest.raises(ValueError, match="expected"):
        fused.rope_and_write_kv(qkv, cos, sin, cache[0], cache[1], slots, 6)


# --- SiLU x up -----------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,inter", [(1, 1536), (9, 1536), (3, 100), (2, 14336)])
def test_silu_and_mul_matches_the_split_and_two_ops(tokens, inter, dtype):
    g = torch.Generator().manual_seed(inter + tokens)
    gate_up = (3 * torch.randn(tokens, 2 * inter, generator=g)).to(dtype).to(DEVICE)
    gate, up = gate_up.split(inter, dim=-1)
    _exact_or_one_unit(fused.silu_and_mul(gate_up, inter), F.silu(gate) * up)


def test_silu_and_mul_refuses_a_wrong_width():
    with pytest.raises(ValueError, match="expected 2 x 7"):
        fused.silu_and_mul(torch.zeros(2, 10, device=DEVICE), 7)


# --- the engine --------------------------------------------------------------------------
ENGINE_DEVICE = "cpu" if triton_attention.INTERPRETED else "cuda"


def _engine(path, fused_kernels: bool):
    from llmserve.config import EngineConfig
    from llmserve.engine.llm_engine import LLMEngine
    return LLMEngine(EngineConfig(model=str(path), device=ENGINE_DEVICE, dtype="float32",
                                  attention_backend="triton", fused_kernels=fused_kernels,
                                  kv_cache_memory=4 << 20, max_num_seqs=4,
                                  enable_prefix_caching=False, num_threads=1))


def _greedy(engine, prompts, max_tokens=6):
    from llmserve import SamplingParams
    reqs = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                 ignore_eos=True)) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    engine.block_manager.check_all_free()
    return [r.sequences[0].output_token_ids for r in reqs]


# Three streams decoding together; 40 tokens span three 16-token blocks.
PROMPTS = [[5 + (7 * i) % 900 for i in range(n)] for n in (5, 40, 17)]


@pytest.mark.parametrize("kind", ["llama", "llama3"])  # MHA 4/2; GQA 6/2 + llama3 rope
def test_engine_greedy_tokens_are_the_same_with_fused_kernels(tiny_models, kind):
    plain = _greedy(_engine(tiny_models[kind], False), PROMPTS)
    assert _greedy(_engine(tiny_models[kind], True), PROMPTS) == plain


class _Counter:
    """Counts the calls of some module functions, still calling them."""

    def __init__(self, monkeypatch, module, names):
        self.calls = dict.fromkeys(names, 0)
        for name in names:
            real = getattr(module, name)

            def counted(*args, _name=name, _real=real, **kwargs):
                self.calls[_name] += 1
                return _real(*args, **kwargs)
            monkeypatch.setattr(module, name, counted)


FUSED_OPS = ("rms_norm", "add_rms_norm", "rope_and_write_kv", "silu_and_mul")


def test_enable_fused_kernels_routes_every_layer_through_them(tiny_llama, monkeypatch):
    """With the flag, each forward runs the fused kernels once per norm, attention and
    MLP, and the attention no longer stores K/V itself (a second write would cost a
    kernel and hide a fused write that missed). Without it, none of them runs."""
    from llmserve.model_executor.models.llama import MLP, Attention, RMSNorm
    engine = _engine(tiny_llama, True)
    model = engine.runner.model
    parts = [m for m in model.modules() if isinstance(m, (RMSNorm, Attention, MLP))]
    assert len(parts) == 2 * 4 + 1 and all(m.fused for m in parts)

    ops = _Counter(monkeypatch, fused, FUSED_OPS)
    writes = _Counter(monkeypatch, triton_attention, ["write_kv_cache"])
    forwards = _Counter(monkeypatch, type(model), ["forward"])
    _greedy(engine, PROMPTS[::2], max_tokens=3)  # 5 and 17 tokens: calls are counted
    n, layers = forwards.calls["forward"], model.config.num_hidden_layers
    assert n >= 3
    # The first layer's input norm has no residual to add; the final norm has one.
    assert ops.calls == {"rms_norm": n, "add_rms_norm": 2 * layers * n,
                         "rope_and_write_kv": layers * n, "silu_and_mul": layers * n}
    assert writes.calls["write_kv_cache"] == 0

    for counter in (ops, writes, forwards):
        counter.calls.update(dict.fromkeys(counter.calls, 0))
    plain = _engine(tiny_llama, False)
    assert not any(m.fused for m in plain.runner.model.modules()
                   if isinstance(m, (RMSNorm, Attention, MLP)))
    _greedy(plain, PROMPTS[::2], max_tokens=3)
    assert sum(ops.calls.values()) == 0
    assert writes.calls["write_kv_cache"] == layers * forwards.calls["forward"] > 0
