"""Dense bf16 linears on packed weights (``kernels/cpu_linear``), in oneDNN's layout
or in our own GEMM's (``gemm.c``): the same product as ``F.linear``, and the engine
packing exactly the dense projections."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from llmserve import LLM, SamplingParams
from llmserve.kernels.cpu import dispatch
from llmserve.kernels.cpu.decoder import int4_pack_block_n
from llmserve.kernels.cpu.dispatch import QUANT_GEMM, gemm_backend
from llmserve.kernels.cpu.gemm import (
    amx_tiles,
    native_gemm_available,
    packing_available,
    quant_gemm,
    quant_tiled_available,
)
from llmserve.model_executor.layers.cpu_linear import (
    NativeLinear,
    PackedLinear,
    pack_linears,
)
from llmserve.model_executor.layers.quantization import QuantizedLinear, weight_only_mm
from llmserve.worker import model_builder
from tests.cpu_dispatch import quant_tiled_min_rows

pytestmark = pytest.mark.skipif(not packing_available(),
                                reason="oneDNN has no bf16 kernels on this CPU")
needs_native = pytest.mark.skipif(not native_gemm_available(),
                                  reason="gemm.c needs AVX512-BF16")
BACKENDS = [PackedLinear, pytest.param(NativeLinear, marks=needs_native)]


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


ON_GRID = [(960, 576), (576, 1536), (80, 24), (16, 2), (1552, 64)]
OFF_GRID = [(100, 23)]  # the native kernel refuses it (see the refusal test): oneDNN only
SHAPES_BY_BACKEND = ([(PackedLinear, *shape) for shape in ON_GRID + OFF_GRID]
                     + [pytest.param(NativeLinear, *shape, marks=needs_native)
                        for shape in ON_GRID])


@pytest.mark.parametrize("backend, out_features, in_features", SHAPES_BY_BACKEND)
@pytest.mark.parametrize("rows", [1, 5, 13, 64, 130, 250])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_computes_the_dense_product(backend, rows, bias, out_features,
                                                  in_features):
    """As accurate as F.linear against a float32 reference, and equal to it up to
    bf16 rounding (a wrong layout or a dropped bias is off by ~100 %). The shapes take
    the native kernel's edges: row tiles of 1-6, chunks of 112 rows, groups of 1-4
    panels, 97 panels split over the threads; 100 x 23, off its grid, is oneDNN's."""
    assert_dense_product(backend, rows, bias, out_features, in_features)


def assert_dense_product(backend, rows: int, bias: bool, out_features: int,
                         in_features: int) -> None:
    torch.manual_seed(rows)
    linear = torch.nn.Linear(in_features, out_features, bias=bias).to(torch.bfloat16)
    if bias:
        linear.bias.data.normal_()
    x = torch.randn(rows, in_features).to(torch.bfloat16)
    reference = F.linear(x.float(), linear.weight.float(),
                         None if linear.bias is None else linear.bias.float())
    dense = F.linear(x, linear.weight, linear.bias)
    packed = backend(linear)(x)
    assert packed.shape == dense.shape and packed.dtype == torch.bfloat16
    assert relative_error(packed, reference) <= 2 * relative_error(dense, reference) + 1e-3
    assert relative_error(packed, dense) < 1e-2


@needs_native
@pytest.mark.parametrize("out_features, in_features", [(960, 576), (576, 1536), (1552, 64)])
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 64, 130])
@pytest.mark.parametrize("bias", [False, True])
def test_native_linear_computes_the_dense_product_both_tile_kinds(rows, bias, out_features,
                                                                  in_features, tile_kind):
    """gemm.c's dense product through AMX tiles (K a multiple of 32: the packed panels
    are B tiles as they are) and through VDPBF16PS: as accurate as F.linear. Rows of
    1-16 are one AMX tile, 17 a full one and a single row, 130 several."""
    assert_dense_product(NativeLinear, rows, bias, out_features, in_features)


@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_linear_takes_any_leading_shape_and_no_rows(backend):
    linear = torch.nn.Linear(24, 48).to(torch.bfloat16)
    packed = backend(linear)
    x = torch.randn(2, 3, 24).to(torch.bfloat16)
    assert relative_error(packed(x), linear(x)) < 1e-2
    assert packed(x[0, :0]).shape == (0, 48)


@needs_native
def test_native_linear_reads_strided_rows_and_refuses_what_it_cannot_take():
    """Rows of a wider tensor (a column slice: row stride > in_features) are read in
    place; a float32 input or a shape off the kernel's grid is an error, not garbage."""
    linear = torch.nn.Linear(64, 32).to(torch.bfloat16)
    wide = torch.randn(9, 100).to(torch.bfloat16)
    x = wide[:, 10:74]
    assert relative_error(NativeLinear(linear)(x), linear(x.contiguous())) < 1e-2
    with pytest.raises(TypeError):
        NativeLinear(linear)(x.float())
    with pytest.raises(ValueError):
        NativeLinear(torch.nn.Linear(24, 40).to(torch.bfloat16))  # 40 % 16 != 0
    with pytest.raises(ValueError):
        NativeLinear(torch.nn.Linear(23, 48).to(torch.bfloat16))  # odd in_features


@needs_native
@pytest.mark.parametrize("forced", [False, True])
def test_pack_linears_mixes_backends_by_shape(monkeypatch, forced):
    """Native where the shape is on the kernel's grid and (unless forced) within what was
    measured; oneDNN for the rest; every product still right. On an AMX CPU without
    the tile grant the default is oneDNN (its tile kernels) for every shape."""
    monkeypatch.setenv("LLMSERVE_BF16_GEMM", "native" if forced else "auto")
    amx_default = not forced and gemm_backend() != "native"
    torch.manual_seed(0)
    shapes = {"fits": (24, 16 * 4 * torch.get_num_threads()), "few_panels": (24, 16),
              "off_grid": (24, 40), "odd_in": (23, 48), "wide_in": (4098, 16 * 8)}
    model = torch.nn.ModuleDict({name: torch.nn.Linear(i, o).to(torch.bfloat16)
                                 for name, (i, o) in shapes.items()})
    plain = {name: torch.nn.Linear(i, o).to(torch.bfloat16) for name, (i, o) in shapes.items()}
    for name in shapes:
        plain[name].load_state_dict(model[name].state_dict())
    assert pack_linears(model) == len(shapes)
    native = ({"fits", "few_panels", "wide_in"} if forced
              else set() if amx_default else {"fits"})
    for name, (i, _) in shapes.items():
        assert isinstance(model[name], NativeLinear if name in native else PackedLinear), name
        x = torch.randn(7, i).to(torch.bfloat16)
        assert relative_error(model[name](x), plain[name](x)) < 1e-2, name
    with pytest.raises(ValueError):
        model["fits"](torch.randn(2, 25).to(torch.bfloat16))  # the wrong width


def test_the_backend_is_chosen_from_the_cpu_and_can_be_forced(monkeypatch):
    monkeypatch.setenv("LLMSERVE_BF16_GEMM", "onednn")
    assert gemm_backend() == "onednn"
    monkeypatch.setenv("LLMSERVE_BF16_GEMM", "native")
    assert gemm_backend() == ("native" if native_gemm_available() else "onednn")
    monkeypatch.setenv("LLMSERVE_BF16_GEMM", "fastest")
    with pytest.raises(ValueError):
        gemm_backend()


@needs_native
def test_the_default_backend_follows_the_cpu_kind(monkeypatch):
    """gemm.c without AMX (Zen 4) and with the AMX tiles granted (Sapphire Rapids);
    oneDNN's AMX kernels on an AMX CPU whose tiles Linux does not grant, where gemm.c
    would fall back to its slower VDPBF16PS tiles."""
    monkeypatch.setenv("LLMSERVE_BF16_GEMM", "auto")
    for amx_cpu, granted, backend in ((False, False, "native"), (True, True, "native"),
                                      (True, False, "onednn")):
        facts = dataclasses.replace(dispatch.probe(), amx_cpu=amx_cpu, amx_tiles=granted)
        assert gemm_backend(facts) == backend, (amx_cpu, granted)


def test_an_avx2_build_has_no_native_gemm_and_keeps_onednn():
    """ATEN_CPU_CAPABILITY=avx2 (CI acting as an AVX2-only machine) builds the kernel
    library for AVX2, where gemm.c is a stub that says so: linears stay on oneDNN
    even when forced, and a NativeLinear is refused, never garbage from the stub."""
    check = ("import torch\n"
             "from llmserve.kernels.cpu import dispatch, gemm\n"
             "from llmserve.model_executor.layers.cpu_linear import NativeLinear\n"
             "print(gemm.native_gemm_available(), dispatch.gemm_backend())\n"
             "try:\n"
             "    NativeLinear(torch.nn.Linear(32, 32).to(torch.bfloat16))\n"
             "except RuntimeError:\n"
             "    print('refused')\n")
    env = dict(os.environ, ATEN_CPU_CAPABILITY="avx2", LLMSERVE_BF16_GEMM="native")
    out = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "onednn", "refused"]


def test_the_quant_tiles_crossover_follows_the_cpu_kind(monkeypatch):
    """Where quant_gemm starts to pay, per CPU kind as measured (gemm.py): over ATen's
    kernels, 8 rows without AMX and with AMX tiles, 24 on an AMX CPU multiplying
    without them; where x is rounded to int8 (the int8 panels built, AMX tiles not in
    use), never; and the tiles are not kept off by oneDNN computing the dense bf16
    linears there."""
    from llmserve.kernels.cpu import decoder, gemm
    for panels, amx_cpu, tiles, rows in (
            (False, False, False, 8), (False, True, True, 8), (False, True, False, 24),
            (True, True, True, 8), (True, True, False, None), (True, False, False, None)):
        monkeypatch.setattr(decoder, "int8_activations", lambda on=panels: on)
        monkeypatch.setattr(decoder, "amx_tiles", lambda on=tiles: on)
        assert gemm.rounds_x_to_int8() == (panels and not tiles)
        facts = dataclasses.replace(dispatch.probe(), bf16_gemm=True, amx_cpu=amx_cpu,
                                    amx_tiles=tiles, int8_x=gemm.rounds_x_to_int8())
        assert quant_tiled_min_rows(facts) == rows
    if native_gemm_available() and int4_pack_block_n() == 64:
        assert quant_tiled_available(4) and quant_tiled_available(8)


@pytest.fixture(params=["amx", "avx512"])
def tile_kind(request):
    """gemm.c's multiply (quant_gemm's and the dense one) both ways where this CPU has
    AMX (only AVX512-BF16 elsewhere: the amx case is then skipped, with the reason)."""
    if request.param == "amx" and not amx_tiles():
        pytest.skip("no AMX tiles here (CPU, compiler or OS)")
    was = amx_tiles()
    amx_tiles(request.param == "amx")
    yield request.param
    amx_tiles(was)


needs_quant_tiled = pytest.mark.skipif(not quant_tiled_available(4),
                                       reason="quant_gemm needs AVX512-BF16 and ATen's "
                                              "AVX-512 int4 pack")


def quantized_linear(bits: int, out_features: int, in_features: int, bias: bool,
                     seed: int) -> QuantizedLinear:
    """Columns (and int4 groups) of very different magnitudes, so that a scale or zero
    read from the wrong column, panel or group is ~100 % off, not lost in rounding."""
    torch.manual_seed(seed)
    linear = torch.nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        spread = torch.randn(out_features, in_features // 32, 1).mul(1.5).exp()
        linear.weight.mul_(spread.expand(-1, -1, 32).reshape(out_features, in_features))
        if bias:
            linear.bias.normal_(std=0.1)
    return QuantizedLinear(linear, bits)


def aten_product(x: torch.Tensor, lin: QuantizedLinear) -> torch.Tensor:
    want = weight_only_mm(x, lin.qweight, lin.scales, lin.bits).float()
    return want if lin.bias is None else want + lin.bias.float()


@needs_quant_tiled
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 6, 7, 8, 40, 113, 300])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("out_features, in_features", [(960, 576), (576, 1536), (64, 32),
                                                       (192, 96)])
def test_quant_gemm_computes_atens_weight_only_product(bits, rows, bias, out_features,
                                                       in_features, tile_kind):
    """The same quantised weights as ATen's kernels read them (int4: nibbles, 64-column
    blocks, groups of 32, scale and zero; int8: per-column scales, the 16 x 16
    transposes), dequantised to bf16 once: within bf16 rounding of ATen's product (a
    wrong nibble, column, panel or group is off by ~100 %)."""
    lin = quantized_linear(bits, out_features, in_features, bias, seed=rows)
    x = torch.randn(rows, in_features).to(torch.bfloat16)
    want = aten_product(x, lin)
    got = quant_gemm(x, lin)
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    assert relative_error(got, want) < 1e-2
    if rows >= 6:  # column by column too: one column's wrong scale cannot hide
        column_error = (got.float() - want).norm(dim=0) / want.norm(dim=0).clamp(min=1e-6)
        assert column_error.max() < 0.03


@needs_quant_tiled
@pytest.mark.parametrize("bits, out_features", [(4, 96), (8, 24)])
def test_quantized_linears_off_the_grid_stay_on_aten(bits, out_features):
    """Output widths the tiles do not take (int4: whole 64-column blocks; int8: 16) and
    a wrong input width fall back to ATen, whatever the row count."""
    lin = quantized_linear(bits, out_features, 64, bias=False, seed=2)
    x = torch.randn(40, 64).to(torch.bfloat16)
    assert lin.kernel_for(x) != QUANT_GEMM
    assert torch.equal(lin(x), weight_only_mm(x, lin.qweight, lin.scales, bits))
    wide = quantized_linear(bits, 128, 64, bias=False, seed=3)
    assert wide.kernel_for(torch.randn(40, 32).to(torch.bfloat16)) != QUANT_GEMM


@needs_quant_tiled
def test_an_int8_lm_head_shape_and_strided_rows():
    """The LM head's shape (49152 x 576, as in both quantised modes) from rows of a
    wider tensor, as the engine's sampled hidden rows may be."""
    lin = quantized_linear(8, 49152, 576, bias=False, seed=1)
    wide = torch.randn(5, 600).to(torch.bfloat16)
    x = wide[:, 3:579]
    assert relative_error(quant_gemm(x, lin), aten_product(x.contiguous(), lin)) < 1e-2


@needs_quant_tiled
@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_linears_take_the_tiles_from_enough_rows(bits, monkeypatch):
    """A QuantizedLinear multiplies by quant_gemm from quant_tiled_min_rows() rows on
    (any leading shape; the input's dtype kept), by ATen's kernel below (x not rounded
    to int8: the int8 panels' own crossover is test_cpu_int8_panels')."""
    monkeypatch.setenv("LLMSERVE_CPU_INT8_ACTIVATIONS", "0")
    least = quant_tiled_min_rows()
    lin = quantized_linear(bits, 128, 64, bias=True, seed=0)
    many = torch.randn(2, least, 64).to(torch.bfloat16)
    few = torch.randn(least - 1, 64).to(torch.bfloat16)
    assert lin.kernel_for(few) != QUANT_GEMM
    assert torch.equal(lin(many[0]), quant_gemm(many[0], lin))  # exactly the least
    assert torch.equal(lin(many), quant_gemm(many, lin))
    assert torch.equal(lin(many.float()), quant_gemm(many, lin).float())
    aten = weight_only_mm(few, lin.qweight, lin.scales, bits) + lin.bias  # the bf16 add
    assert torch.equal(lin(few), aten)


def first_token_logprobs(llm: LLM) -> list[tuple[int, float]]:
    params = SamplingParams(temperature=0, max_tokens=2, logprobs=5, ignore_eos=True)
    out = llm.generate(["The quick brown fox"], params)[0].outputs[0]
    return out.logprobs[0].top


@pytest.mark.parametrize("backend", ["onednn", pytest.param("native", marks=needs_native)])
@pytest.mark.parametrize("kind", ["qwen2", "llama3"])
def test_the_engine_packs_its_dense_projections_and_computes_the_same(tiny_models, kind,
                                                                      backend, monkeypatch):
    """A bf16 CPU engine packs every dense projection and the LM head (tied to the
    embedding in llama3, whose lookups keep the plain rows) for the chosen backend.
    Its first token's distribution is the unpacked engine's (biases, qwen2, included),
    up to bf16 rounding: a near-tie may pick the other token, never one far behind."""
    monkeypatch.setenv("LLMSERVE_BF16_GEMM", backend)
    expected = NativeLinear if backend == "native" else PackedLinear
    llm = LLM(str(tiny_models[kind]), dtype="bfloat16", quantization="none",
              kv_cache_memory=16 << 20)
    try:
        model = llm.engine.runner.model
        layer = model.model.layers[0]
        for module in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                       layer.mlp.gate_up_proj, layer.mlp.down_proj, model.lm_head):
            assert isinstance(module, expected)
        packed = first_token_logprobs(llm)
    finally:
        llm.shutdown()
    monkeypatch.setattr(model_builder, "packing_applies", lambda device, dtype: False)
    llm = LLM(str(tiny_models[kind]), dtype="bfloat16", quantization="none",
              kv_cache_memory=16 << 20)
    try:
        assert type(llm.engine.runner.model.lm_head) is torch.nn.Linear
        dense = first_token_logprobs(llm)
    finally:
        llm.shutdown()
    dense_logprob = dict(dense)
    assert packed[0][0] in dense_logprob
    assert dense_logprob[packed[0][0]] >= dense[0][1] - 0.05
    torch.testing.assert_close([p for _, p in packed], [p for _, p in dense],
                               rtol=0.02, atol=0.05)


def test_quantised_projections_are_left_alone(tiny_llama):
    llm = LLM(str(tiny_llama), dtype="bfloat16", quantization="int8",
              kv_cache_memory=16 << 20)
    try:
        model = llm.engine.runner.model
        assert isinstance(model.model.layers[0].self_attn.qkv_proj, QuantizedLinear)
        assert isinstance(model.lm_head, QuantizedLinear)
        assert not any(isinstance(m, (PackedLinear, NativeLinear)) for m in model.modules())
    finally:
        llm.shutdown()
