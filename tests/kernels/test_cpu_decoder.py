"""The decoder stack in C (``kernels/cpu/decoder.c``): its int4 matmul against ATen's
int4 kernel on the same packed weights, each layer (int4 and bf16) against the model's
own torch layer, and the engine using it only for the steps it covers."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys

import pytest
import torch

from llmserve import SamplingParams
from llmserve.kernels.cpu import decoder as cpu_decoder
from llmserve.kernels.cpu import dispatch, gemm
from llmserve.kernels.cpu.decoder import int4_pack_block_n, q4_matmul
from llmserve.model_executor.layers.quantization import QuantizedLinear, weight_only_mm
from llmserve.model_executor.models import native_decoder
from llmserve.model_executor.models.native_decoder import NativeDecoder
from llmserve.platforms.cpu import cpu_features
from tests.cpu_dispatch import quant_tiled_min_rows
from tests.forced_isa import run_as

pytestmark = pytest.mark.skipif(int4_pack_block_n() is None,
                                reason="ATen's int4 pack here is not a layout the kernel reads")

BF16_ULP = 2 ** -7  # relative spacing of bf16 numbers


def quantized(out_features: int, in_features: int, bias: bool, seed: int) -> QuantizedLinear:
    torch.manual_seed(seed)
    linear = torch.nn.Linear(in_features, out_features, bias=bias)
    if bias:
        linear.bias.data.normal_()
    return QuantizedLinear(linear, 4)


@pytest.mark.parametrize("out_features, in_features", [(960, 576), (128, 64), (3072, 576),
                                                       (576, 1536)])
# every tile size (1 to 8 tokens), a full tile plus one, and two full tiles; on AVX-512
# without bf16, from 16 the panel GEMM: a group of 12 and a rest (17), and past its block
# of 96 rows (100)
@pytest.mark.parametrize("tokens", [1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 17, 100])
@pytest.mark.parametrize("bias", [False, True])
def test_int4_matmul_matches_atens_kernel(out_features, in_features, tokens, bias):
    """Same packed weights, same math up to the float32 summation order: at most one
    bf16 rounding step apart (a wrong nibble, column or group is off by far more). x
    in float32 throughout (rounded to int8: tests/kernels/test_cpu_int8_panels.py)."""
    lin = quantized(out_features, in_features, bias, seed=tokens)
    x = torch.randn(tokens, in_features).to(torch.bfloat16)
    want, got = aten_int4(x, lin).float(), q4_matmul(x, lin, int8_x=False).float()
    torch.testing.assert_close(got, want, rtol=BF16_ULP, atol=1e-2)
    assert (got == want).float().mean() > 0.9  # nearly all bit-identical


def aten_int4(x: torch.Tensor, lin: QuantizedLinear) -> torch.Tensor:
    """ATen's weight-only int4 kernel itself (``lin(x)`` takes quant_gemm from 8 rows on)."""
    y = weight_only_mm(x, lin.qweight, lin.scales, 4)
    return y if lin.bias is None else y + lin.bias


AVX2_CHECK = """
import torch
from llmserve.model_executor.layers.quantization import QuantizedLinear, weight_only_mm
from llmserve.kernels.cpu.decoder import int4_pack_block_n, q4_matmul
from llmserve.kernels.cpu.dequant import int4_runs_in_float32
torch.manual_seed(0)
print(int4_pack_block_n(), int4_runs_in_float32())
worst = 0.0
for out_features, in_features in ((960, 576), (576, 1536)):
    lin = QuantizedLinear(torch.nn.Linear(in_features, out_features), 4)
    # the 4-row tiles (3, 5); from 16 the panel GEMM of 16-column panels: a group of 6
    # and a rest (17), past its block of 96 rows (100)
    for rows in (3, 5, 16, 17, 100):
        x = torch.randn(rows, in_features).to(torch.bfloat16)
        want = (weight_only_mm(x, lin.qweight, lin.scales, 4) + lin.bias).float()
        got = q4_matmul(x, lin, int8_x=False).float()  # (x rounded: test_cpu_int8_panels)
        err = (got - want).abs() / want.abs().clamp(min=1)
        worst = max(worst, err.max().item())
print(worst)
"""


def test_the_avx2_layout_is_read_on_an_avx2_machine():
    """ATEN_CPU_CAPABILITY=avx2 makes ATen pack int4 in blocks of 32 columns (and the
    kernel build for AVX2, with its panel GEMM): the kernel finds that layout and still
    matches ATen, tiles and panels, and int4 models run in float32 there."""
    lines = run_as("avx2", AVX2_CHECK)
    block_n, in_float32 = lines[-2].split()
    assert (block_n, in_float32) == ("32", "True")
    assert float(lines[-1]) <= BF16_ULP


@pytest.fixture(scope="module")
def int4_llm():
    from llmserve.entrypoints.llm import LLM
    llm = LLM(dtype="bfloat16", quantization="int4", kv_cache_memory=64 << 20)
    yield llm
    llm.shutdown()


@pytest.fixture
def rebind(int4_llm, monkeypatch):
    """``rebind()`` binds ``int4_llm``'s quantised layers and builds its C stack again for
    the CPU state the test set (AMX tiles, LLMSERVE_CPU_INT8_ACTIVATIONS: a model binds
    its kernels once, at load) and returns the stack; after the test, as they were."""
    model = int4_llm.engine.runner.model

    def bind(facts=None) -> NativeDecoder:
        for module in model.modules():
            if isinstance(module, QuantizedLinear):
                module.bind_kernels(facts)
        model.model.native_decoder = NativeDecoder.try_build(model)
        return model.model.native_decoder

    before = dispatch.probe()
    yield bind
    monkeypatch.undo()  # the environment back first: the stack reads its row limit
    bind(before)


def decode_step_inputs(llm, prompts: int, draft: int = 0):
    """A decode step of ``prompts`` running sequences, each with ``draft`` drafted
    tokens after its last one (speculative decoding's 1 + draft rows, causal among
    them): (model inputs, metadata)."""
    engine = llm.engine
    ids = engine.tokenize("Once upon a time, in a small village, there lived an old man who")
    for i in range(prompts):
        engine.add_request(ids + [i], SamplingParams(temperature=0, max_tokens=32,
                                                     ignore_eos=True))
    while any(s.num_output_tokens < 2 for s in engine.scheduler.running) \
            or engine.scheduler.waiting:
        engine.step()

    class Batch:
        seqs = list(engine.scheduler.running)
        num_new_tokens = [1 + draft] * prompts
    for seq in Batch.seqs:
        assert len(seq.block_table) * engine.runner.block_size >= seq.num_tokens + draft
        seq.spec_token_ids = [seq.token_ids[-1 - j] for j in range(draft)]
    inputs, _ = engine.runner.flatten(Batch)
    return engine.runner.build(inputs)


def run_layers(decoder: NativeDecoder, first: int, count: int, x, cos, sin,
               meta) -> torch.Tensor:
    """Layers ``first .. first + count - 1`` in C on a copy of ``x``."""
    x = x.clone().contiguous()
    tokens = x.shape[0]
    cos, sin = cos.reshape(tokens, -1).contiguous(), sin.reshape(tokens, -1).contiguous()
    layers = ctypes.byref(decoder.layers, first * ctypes.sizeof(cpu_decoder.StackLayer))
    rc = decoder._lib.stack_decode_layers(
        torch.get_num_threads(), ctypes.byref(decoder.dims), layers, count,
        x.data_ptr(), tokens, cos.data_ptr(), sin.data_ptr(), meta.slot_mapping.data_ptr(),
        meta.plan.decode_tables.data_ptr(), meta.plan.decode_tables.shape[1],
        meta.plan.decode_seq_lens.data_ptr())
    assert rc == 0
    return x


# 20 rows: the panel GEMM inside the stack, where built
@pytest.mark.parametrize("prompts, draft", [(1, 0), (3, 0), (1, 4), (2, 2), (20, 0)])
def test_each_layer_matches_the_torch_layer(int4_llm, prompts, draft):
    """Each layer in C computes what the model's torch layer does from the same input
    (norms, int4 projections, rotary and cache store, attention over the paged context,
    causal among a drafted decode's rows, SiLU): most layers bit for bit, the others
    where a float32 sum in another order rounded one bf16 value differently (relative
    error ~1e-3). The whole stack stays within the drift that such steps grow into over
    30 bf16 layers (a broken piece is off by ~100 %)."""
    from llmserve.model_executor.layers.attention import forward_context
    model = int4_llm.engine.runner.model.model
    decoder = model.native_decoder
    assert isinstance(decoder, NativeDecoder)
    ids, pos, meta = decode_step_inputs(int4_llm, prompts, draft)
    assert meta.plan.all_rows_native and len(ids) == prompts * (1 + draft)
    # Where quant_gemm takes this many rows (AMX, Zen 4: from 8), in both: bit for bit
    tiled = 0 < decoder.quant_gemm_rows() <= len(ids)
    try:
        with torch.inference_mode(), forward_context(meta):
            x = x0 = model.embed_tokens(ids)
            cos, sin = model.rotary(pos)
            exact = 0
            for i, layer in enumerate(model.layers):
                out, residual = layer(None, x, cos, sin)
                want = residual + out  # the residual stream after the layer
                got = run_layers(decoder, i, 1, x, cos, sin, meta)
                rel = ((got.float() - want.float()).norm() / want.float().norm()).item()
                assert rel < 5e-3, (i, rel)
                assert torch.equal(got, want) or not tiled, i
                exact += torch.equal(got, want)
                x = want
            assert exact >= len(model.layers) // 4  # the same computation, not a lookalike
            got = run_layers(decoder, 0, len(model.layers), x0, cos, sin, meta)
            rel = (got.float() - x.float()).norm() / x.float().norm()
            assert rel < 0.05, rel
    finally:
        for req in list(int4_llm.engine.requests):
            int4_llm.engine.abort(req)


def test_the_whole_stack_on_an_avx2_machine_matches_the_torch_layers():
    """The layer-by-layer check above in a process acting as an AVX2-only machine
    (ATEN_CPU_CAPABILITY=avx2): the C stack with that build's own int4 tiles, its
    16-column panels (20 rows) and its attention passes for bf16 caches, against the
    torch layers there. (A wrong nibble shift in the AVX2 tile fails 4 of its 5 cases.)"""
    env = dict(os.environ, ATEN_CPU_CAPABILITY="avx2")
    test = f"{__file__}::test_each_layer_matches_the_torch_layer"
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test],
                         env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "5 passed" in out.stdout


def test_the_engine_runs_small_steps_in_c_only(int4_llm, monkeypatch):
    """Steps of up to max_native_tokens rows run in C (decodes, short prompts); longer
    prefills and bigger decode batches op by op; generation is greedy-stable either
    way."""
    decoder = int4_llm.engine.runner.model.model.native_decoder
    assert decoder is not None
    # (where quant_gemm runs the stack's products of many rows there is no limit: below)
    monkeypatch.setattr(decoder, "quant_gemm_rows", lambda: 0)
    # up to 128 rows on some CPUs, none where x is rounded to int8: the test's batches
    # stay short
    monkeypatch.setattr(native_decoder, "max_native_tokens", lambda block_n: 16)
    limit = native_decoder.max_native_tokens(decoder.dims.block_n)
    monkeypatch.setattr(decoder, "row_limit", limit)  # what the stack bound
    sizes = []
    real_run = NativeDecoder.run
    monkeypatch.setattr(NativeDecoder, "run",
                        lambda self, x, *a: sizes.append(x.shape[0]) or real_run(self, x, *a))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    many = limit + 2
    outs = int4_llm.generate([f"Count to {i}:" for i in range(many)], params)
    assert all(len(o.outputs[0].token_ids) == 6 for o in outs)
    assert sizes == [], "a decode batch above the limit ran in C"
    one = int4_llm.generate(["The capital of France is"], params)[0].outputs[0].token_ids
    # A prompt of at most the limit too, then every decode step.
    assert sizes == [len(int4_llm.engine.tokenize("The capital of France is"))] + [1] * 5
    sizes.clear()
    longer = int4_llm.engine.tokenize("The capital of France is Paris, and the capital "
                                      "of Spain is Madrid, said the teacher. " * 3)
    assert len(longer) > limit
    int4_llm.generate([{"prompt_token_ids": longer}], params)
    assert sizes == [1] * 5  # the prefill ran op by op
    monkeypatch.setattr(int4_llm.engine.runner.model.model, "native_decoder", None)
    op_by_op = int4_llm.generate(["The capital of France is"], params)[0].outputs[0].token_ids
    assert one[:3] == op_by_op[:3]  # bf16 rounding may part them later, not at once


def assert_the_stack_is_the_torch_layers(llm, prompts: int, draft: int = 0):
    """Every layer in C, and the whole stack, equal to the model's torch layers bit for
    bit on a decode step of ``prompts`` sequences with ``draft`` drafted tokens each.
    Returns the step's metadata."""
    from llmserve.model_executor.layers.attention import forward_context
    model = llm.engine.runner.model.model
    decoder = model.native_decoder
    ids, pos, meta = decode_step_inputs(llm, prompts, draft)
    try:
        with torch.inference_mode(), forward_context(meta):
            x = x0 = model.embed_tokens(ids)
            cos, sin = model.rotary(pos)
            for i, layer in enumerate(model.layers):
                out, residual = layer(None, x, cos, sin)
                want = residual + out
                assert torch.equal(run_layers(decoder, i, 1, x, cos, sin, meta), want), i
                x = want
            assert torch.equal(run_layers(decoder, 0, len(model.layers), x0, cos, sin, meta), x)
    finally:
        for req in list(llm.engine.requests):
            llm.engine.abort(req)
    return meta


QUANT_GEMM_STACK = pytest.mark.skipif(not gemm.quant_tiled_available(4),
                                      reason="quant_gemm needs AVX512-BF16")


@QUANT_GEMM_STACK
def test_an_int4_stack_takes_quant_gemm_for_many_rows_bit_for_bit(int4_llm, monkeypatch,
                                                                  rebind):
    """Where the per-op path's int4 products of many rows are quant_gemm's (AMX, Zen 4,
    with x not rounded to int8), the stack's are too: from quant_tiled_min_rows() every
    layer equals the torch layer bit for bit, and the engine runs decode steps of any
    size in C."""
    monkeypatch.setenv("LLMSERVE_CPU_INT8_ACTIVATIONS", "0")
    decoder = rebind()
    untiled_amx = cpu_features().amx_bf16 and not gemm.amx_tiles()  # AMX not granted
    assert decoder.quant_gemm_rows() == quant_tiled_min_rows() == (24 if untiled_amx else 8)
    meta = assert_the_stack_is_the_torch_layers(int4_llm, 40)
    assert decoder.applies(40, meta) and decoder.applies(1000, meta)
    if gemm.amx_tiles():  # without the tiles quant_gemm takes 24 rows and more, op by op
        try:              # and in C: 17-23 rows (past the tiles' 16) stay op by op
            gemm.amx_tiles(False)
            decoder = rebind()
            assert decoder.quant_gemm_rows() == 24
            assert decoder.applies(16, meta) and decoder.applies(24, meta)
            assert not decoder.applies(20, meta)
        finally:
            gemm.amx_tiles(True)
            decoder = rebind()
    monkeypatch.setattr(decoder, "quant_gemm_rows", lambda: 0)  # the tiles' limit alone
    assert not decoder.applies(40, meta)


INT8_STACK = pytest.mark.skipif(not (gemm.quant_tiled_available(4)
                                     and cpu_decoder.int8_activations()),
                                reason="needs quant_gemm and the int8 panels (AVX-512 "
                                       "VNNI with bf16 arithmetic: Zen 4, AMX)")


@INT8_STACK
@pytest.mark.parametrize("tiles", ["amx", "none"])
def test_an_int4_stack_rounds_x_exactly_where_the_per_op_path_does(int4_llm, tiles,
                                                                   monkeypatch, rebind):
    """Without AMX tiles in use (Zen 4) x is rounded to int8: from 3 rows the stack's
    int4 products are the per-op path's int8 panels, bit for bit, and steps of up to
    MAX_NATIVE_TOKENS_INT8_X rows run in C. With the tiles x stays bf16 in both paths
    (the stack's own tiles, then quant_gemm from 8 rows, which takes steps of any
    size)."""
    if tiles == "amx" and not gemm.amx_tiles():
        pytest.skip("no AMX tiles here (CPU, compiler or OS)")
    monkeypatch.delenv("LLMSERVE_CPU_INT8_ACTIVATIONS", raising=False)
    was = gemm.amx_tiles()
    try:
        gemm.amx_tiles(tiles == "amx")
        decoder = rebind()
        assert decoder.dims.int8_x == (tiles == "none")
        assert decoder.quant_gemm_rows() == (8 if tiles == "amx" else 0)
        meta = assert_the_stack_is_the_torch_layers(int4_llm, 12)
        limit = native_decoder.MAX_NATIVE_TOKENS_INT8_X
        assert decoder.applies(16, meta) and decoder.applies(limit, meta)
        assert decoder.applies(limit + 1, meta) == (tiles == "amx")  # quant_gemm: any
        monkeypatch.setattr(decoder, "quant_gemm_rows", lambda: 0)
        assert decoder.applies(limit, meta) == (tiles == "none")
    finally:
        gemm.amx_tiles(was)


@pytest.mark.skipif(not cpu_decoder.int8_activations(),
                    reason="the library has no int8 panels here (AVX-512 VNNI or AVX2)")
def test_a_long_prompt_runs_in_c_where_x_is_rounded_to_int8(monkeypatch):
    """Where x is rounded to int8 the stack's products are the per-op path's int8
    panels, so a prompt step of any size runs in C (a 300-token prompt in one step, past
    the 128 rows other CPU kinds stop at), with the tokens the per-op path gives."""
    from llmserve.entrypoints.llm import LLM
    monkeypatch.delenv("LLMSERVE_CPU_INT8_ACTIVATIONS", raising=False)
    was, llm = gemm.amx_tiles(), None
    try:
        gemm.amx_tiles(False)  # (on an AMX Xeon: route as a Zen 4 does)
        assert gemm.rounds_x_to_int8()
        llm = LLM(dtype="bfloat16", quantization="int4", kv_cache_memory=64 << 20,
                  enable_prefix_caching=False)
        assert llm.engine.runner.model.model.native_decoder is not None
        sizes = []
        real_run = NativeDecoder.run
        monkeypatch.setattr(NativeDecoder, "run",
                            lambda self, x, *a: sizes.append(x.shape[0]) or real_run(self, x, *a))
        prompt = llm.engine.tokenize("A long prompt, of many tokens, for the stack. " * 30)[:300]
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        in_c = llm.generate([{"prompt_token_ids": prompt}], params)[0].outputs[0].token_ids
        assert sizes == [300] + [1] * 7
        llm.engine.runner.model.model.native_decoder = None
        op_by_op = llm.generate([{"prompt_token_ids": prompt}], params)[0].outputs[0].token_ids
        assert in_c == op_by_op
    finally:
        if llm is not None:
            llm.shutdown()
        gemm.amx_tiles(was)


BF16_STACK = pytest.mark.skipif(dispatch.gemm_backend() != "native",
                                reason="bf16 linears stay on oneDNN here (no AVX512-BF16)")


@pytest.fixture(scope="module")
def bf16_llm():
    from llmserve.entrypoints.llm import LLM
    llm = LLM(dtype="bfloat16", quantization="none", kv_cache_memory=64 << 20)
    yield llm
    llm.shutdown()


@BF16_STACK
@pytest.mark.parametrize("prompts, draft", [(1, 0), (2, 2), (40, 0)])
def test_a_bf16_stack_computes_the_torch_layers_bit_for_bit(bf16_llm, prompts, draft):
    """A bf16 model's projections in C are gemm.c's products on the same packed panels
    (AMX tiles from 2 rows where granted), and the ops between them the per-op path's own
    kernels: every layer, and the whole stack, equal to the torch layers bit for bit, at
    1 row, a drafted decode's rows, and 40 rows (past every int4 limit)."""
    decoder = bf16_llm.engine.runner.model.model.native_decoder
    assert isinstance(decoder, NativeDecoder) and decoder.dims.block_n == 0
    assert_the_stack_is_the_torch_layers(bf16_llm, prompts, draft)


@BF16_STACK
def test_a_bf16_model_runs_every_decode_step_in_c(bf16_llm, monkeypatch):
    """No row limit for a bf16 stack: decode batches past the int4 limits and short
    prompts run in C, and greedy tokens are those of the per-op path, token for token."""
    sizes = []
    real_run = NativeDecoder.run
    monkeypatch.setattr(NativeDecoder, "run",
                        lambda self, x, *a: sizes.append(x.shape[0]) or real_run(self, x, *a))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [f"Count to {i}:" for i in range(40)]
    in_c = [o.outputs[0].token_ids for o in bf16_llm.generate(prompts, params)]
    assert 40 in sizes  # a decode step of 40 rows
    monkeypatch.setattr(bf16_llm.engine.runner.model.model, "native_decoder", None)
    op_by_op = [o.outputs[0].token_ids for o in bf16_llm.generate(prompts, params)]
    assert in_c == op_by_op


def test_a_bf16_model_on_onednn_keeps_the_per_op_path(monkeypatch):
    """oneDNN's packed weights (LLMSERVE_BF16_GEMM=onednn, and the default where gemm.c
    lacks AVX512-BF16) are opaque to C: the stack is not built, and says why."""
    from llmserve.entrypoints.llm import LLM
    monkeypatch.setenv("LLMSERVE_BF16_GEMM", "onednn")
    llm = LLM(dtype="bfloat16", quantization="none", kv_cache_memory=16 << 20)
    try:
        model = llm.engine.runner.model
        assert model.model.native_decoder is None
        assert "neither int4 nor packed for gemm.c" in native_decoder.unsupported(model)
        out = llm.generate(["Hi"], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 3
    finally:
        llm.shutdown()


@pytest.mark.parametrize("kwargs", [dict(dtype="bfloat16", quantization="int8"),
                                    dict(dtype="float32", quantization="int4")])
def test_other_modes_keep_the_per_op_path(kwargs):
    from llmserve.entrypoints.llm import LLM
    llm = LLM(kv_cache_memory=16 << 20, **kwargs)
    try:
        assert llm.engine.runner.model.model.native_decoder is None
        out = llm.generate(["Hi"], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 3
    finally:
        llm.shutdown()


def tiny_qwen2(seed: int = 0, quantization: str = "int4"):
    """A random Qwen2-shaped model (QKV biases, head_dim 128, GQA group 2), int4 or bf16
    (``"none"``: packed for gemm.c), with a bound bf16 cache of random contents: shapes
    the built-in model does not have."""
    from transformers import Qwen2Config

    from llmserve.model_executor.layers.backends import backends_for, bind_backends
    from llmserve.model_executor.layers.cpu_linear import pack_linears
    from llmserve.model_executor.layers.quantization import quantize_model
    from llmserve.model_executor.models.llama import LlamaForCausalLM, RotaryEmbedding
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=512, hidden_size=256, intermediate_size=512,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, tie_word_embeddings=False)
    config.head_dim = 64 if seed else 128
    config.num_attention_heads = 256 // config.head_dim * 2
    config.num_key_value_heads = config.num_attention_heads // 2
    model = LlamaForCausalLM(config, 256).to(torch.bfloat16)
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_()
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight.uniform_(0.5, 1.5)
    model.model.rotary = RotaryEmbedding(config, 256)
    model.fuse()
    if quantization == "none":
        pack_linears(model)
    else:
        quantize_model(model, quantization)
    # the implementations an engine binds at load: the per-op path's C kernels
    bind_backends(model, backends_for(torch.device("cpu"), torch.bfloat16, fused=False,
                                      triton_attention=False))
    cache = torch.randn(2, 2, 24, 16, config.num_key_value_heads, config.head_dim)
    model.bind_kv_cache(cache.to(torch.bfloat16))
    return model.eval()


@pytest.mark.parametrize("quantization", [
    "int4", pytest.param("int4-quant_gemm", marks=QUANT_GEMM_STACK),
    pytest.param("none", marks=BF16_STACK)])
@pytest.mark.parametrize("seed", [0, 1], ids=["head_dim128", "head_dim64"])
def test_qwen2_shapes_with_biases_match_the_torch_layers(seed, quantization, monkeypatch):
    """Biases, head_dim 128 or 64 (4 or 8 query heads), contexts of 1 to 48 tokens
    (partial blocks), five sequences (a 4-token tile plus one): the C stack computes what
    the torch layers compute; bit for bit where both take gemm.c's products (bf16, every
    projection in gemm.c; int4 with quant_gemm from 1 row in both: float32 biases added
    before the one rounding)."""
    from llmserve.kernels.cpu.attention import make_cpu_plan
    from llmserve.model_executor.layers.attention import AttentionMetadata, forward_context
    monkeypatch.setenv("LLMSERVE_BF16_GEMM", "native")  # gemm.c for every bf16 width
    if quantization == "int4-quant_gemm":  # quant_gemm for the 5 rows, op by op and in C
        facts = dispatch.probe()
        here = (dispatch.cpu_kind(facts), dispatch.x_format(facts))
        monkeypatch.setitem(dispatch.TABLE, here, {
            **dispatch.TABLE[here], 4: (dispatch.Route(dispatch.QUANT_GEMM, 1),)})
    model = tiny_qwen2(seed, quantization.removesuffix("-quant_gemm"))
    decoder = NativeDecoder.try_build(model)
    assert decoder is not None
    seq_lens, block_size = [1, 5, 17, 33, 48], 16
    free = iter(torch.randperm(24).tolist())
    tables = [[next(free) for _ in range(-(-n // block_size))] for n in seq_lens]
    positions = [n - 1 for n in seq_lens]
    slots = [t[p // block_size] * block_size + p % block_size for t, p in zip(tables, positions)]
    width = max(map(len, tables))
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=torch.arange(6, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables],
                                  dtype=torch.int32),
        max_query_len=1, max_seq_len=max(seq_lens),
        plan=make_cpu_plan(list(range(6)), seq_lens, tables, block_size, 24, native=True))
    x = torch.randn(5, 256).to(torch.bfloat16)
    with torch.inference_mode(), forward_context(meta):
        cos, sin = model.model.rotary(torch.tensor(positions))
        out, residual = None, x
        for layer in model.model.layers:
            out, residual = layer(out, residual, cos, sin)
        want = residual + out
        assert decoder.applies(5, meta)
        # float64 tables: run() hands the C side float32 whatever it is given
        got = decoder.run(x.clone(), cos.double(), sin.double(), meta)
    rel = (got.float() - want.float()).norm() / want.float().norm()
    assert rel < 1e-2, rel
    if quantization != "int4":
        assert torch.equal(got, want)


def test_rebinding_the_cache_drops_the_native_stack():
    """The stack points into the cache it was built on: binding another one drops it
    (the model runner builds it after its final bind)."""
    model = tiny_qwen2()
    model.model.native_decoder = NativeDecoder.try_build(model)
    assert model.model.native_decoder is not None
    model.bind_kv_cache(torch.zeros(2, 2, 4, 16, 2, 128, dtype=torch.bfloat16))
    assert model.model.native_decoder is None


def test_the_row_limit_follows_the_cpu_kind(monkeypatch):
    """2048 rows where x is rounded to int8 (the stack's products are then the per-op
    path's int8 panels, AVX2's 32-column pack too: whole prompt steps); 16 rows where
    quant_gemm's tiles take the per-op path (bf16 CPUs), 128 where they do not run and
    the library has its panel GEMM (AVX-512 without bf16, and AVX2's pack with x in
    float32); without the panels, 32 and (AVX2) 8."""
    monkeypatch.setattr(native_decoder, "rounds_x_to_int8", lambda: True)
    monkeypatch.setattr(native_decoder, "panel_gemms_built", lambda: True)
    monkeypatch.setattr(native_decoder, "quant_tiled_available", lambda bits: True)
    assert native_decoder.max_native_tokens(64) == native_decoder.MAX_NATIVE_TOKENS_INT8_X
    assert native_decoder.max_native_tokens(32) == 2048
    monkeypatch.setattr(native_decoder, "panel_gemms_built", lambda: False)  # no panels:
    assert native_decoder.max_native_tokens(32) == 8  # nothing rounds x in the stack
    monkeypatch.setattr(native_decoder, "panel_gemms_built", lambda: True)
    monkeypatch.setattr(native_decoder, "rounds_x_to_int8", lambda: False)
    assert native_decoder.max_native_tokens(64) == native_decoder.MAX_NATIVE_TOKENS == 16
    monkeypatch.setattr(native_decoder, "quant_tiled_available", lambda bits: False)
    monkeypatch.setattr(native_decoder, "panel_gemms_built", lambda: True)
    monkeypatch.setattr(native_decoder, "native_gemm_available", lambda: True)
    assert native_decoder.max_native_tokens(64) == 32  # bf16 CPU, quant_gemm kept out
    monkeypatch.setattr(native_decoder, "native_gemm_available", lambda: False)
    assert native_decoder.max_native_tokens(64) == 128
    assert native_decoder.max_native_tokens(32) == 128  # MAX_NATIVE_TOKENS_AVX2_PANELS
    monkeypatch.setattr(native_decoder, "panel_gemms_built", lambda: False)
    assert native_decoder.max_native_tokens(64) == 32  # MAX_NATIVE_TOKENS_TILES_ONLY
    assert native_decoder.max_native_tokens(32) == native_decoder.MAX_NATIVE_TOKENS_AVX2 == 8
