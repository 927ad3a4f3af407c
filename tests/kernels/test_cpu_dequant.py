"""int4 on CPUs without bf16 arithmetic (``kernels/cpu/dequant``): the weight written
out in float32 from ATen's pack (both its layouts), products of many rows through the
C panel GEMM or the float32 GEMM over it, where the layer takes those paths, and
``--dtype auto`` storing an int4-served GGUF in bf16 there."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from llmserve.config import EngineConfig
from llmserve.kernels.cpu import dequant, dispatch
from llmserve.kernels.cpu.decoder import int4_pack_block_n
from llmserve.kernels.cpu.dequant import q4_dequant_mm, q4_weight_f32
from llmserve.kernels.cpu.dispatch import DEQUANT_MIN_ROWS, INT4_DEQUANT, INT4_F32, PANEL_MIN_ROWS
from llmserve.kernels.cpu.native import cpu_library
from llmserve.model_executor.layers import quantization
from llmserve.model_executor.layers.quantization import (
    KERNELS,
    QuantizedLinear,
    _quantize_int4,
    bf16_storage_for_int4,
    weight_only_mm,
)
from tests.forced_isa import run_as

pytestmark = pytest.mark.skipif(int4_pack_block_n() is None or cpu_library() is None,
                                reason="no C kernels, or an int4 pack layout they do not read")


@pytest.fixture(autouse=True)
def x_in_float32(monkeypatch):
    """These paths with x in float32 (rounded to int8 by default on AVX-512 VNNI and AVX2
    builds: tests/kernels/test_cpu_int8_panels.py)."""
    monkeypatch.setenv("LLMSERVE_CPU_INT8_ACTIVATIONS", "0")


BF16_ULP = 2 ** -7  # relative spacing of bf16 numbers


HERE = dispatch.probe()


def without_bf16(int4_in_float32: bool = True) -> dispatch.CpuFacts:
    """This machine's facts as an AVX-512 CPU without bf16 arithmetic (no quant_gemm) with
    x not rounded to int8, where int4 runs in float32 (or, ``False``, does not)."""
    return dataclasses.replace(HERE, library_isa="avx512", bf16_gemm=False,
                               amx_tiles=False, int8_x=False, quant_gemm_bits=frozenset(),
                               int4_in_float32=int4_in_float32)
SHAPES = [(960, 576), (128, 64), (3072, 576), (576, 1536)]


def linear_pair(out_features: int, in_features: int, bias: bool = False, seed: int = 0):
    torch.manual_seed(seed)
    linear = torch.nn.Linear(in_features, out_features, bias=bias)
    if bias:
        linear.bias.data.normal_()
    return linear, QuantizedLinear(linear, 4)


def reference_weight(linear: torch.nn.Linear) -> torch.Tensor:
    """W [N, K] from the int4 codes and the bf16 (scale, zero) table the layer stores,
    in float64: w = (q - 8) scale + zero."""
    codes, scales_zeros = _quantize_int4(linear.weight.detach().float(), 32)
    table = scales_zeros.double()  # [K / 32, N, 2]
    scale = table[..., 0].t().repeat_interleave(32, dim=1)  # [N, K]
    zero = table[..., 1].t().repeat_interleave(32, dim=1)
    return (codes.double() - 8) * scale + zero


@pytest.mark.parametrize("out_features, in_features", SHAPES)
def test_the_weight_comes_back_in_float32(out_features, in_features):
    """Every weight where the codes and the table put it: a wrong nibble, column block
    or group is off by a whole scale step; the rest is float32's own rounding."""
    linear, q4 = linear_pair(out_features, in_features)
    want = reference_weight(linear)
    got = q4_weight_f32(q4).double().t()
    step = (want.abs().amax() / 7).item()  # about one code step at the largest scale
    assert got.shape == (out_features, in_features)
    assert (got - want).abs().max().item() < 1e-5 * step


@pytest.mark.parametrize("out_features, in_features", SHAPES)
@pytest.mark.parametrize("rows", [PANEL_MIN_ROWS, 77, 200, DEQUANT_MIN_ROWS])
@pytest.mark.parametrize("bias", [False, True])
def test_many_rows_match_atens_kernel(out_features, in_features, rows, bias):
    """The panel GEMM (below DEQUANT_MIN_ROWS) or the float32 GEMM over the dequantised
    weight, and ATen's int4 kernel on the same pack: the same products up to the
    float32 summation order and one bf16 rounding."""
    _, q4 = linear_pair(out_features, in_features, bias, seed=rows)
    x = torch.randn(rows, in_features).to(torch.bfloat16)
    want = weight_only_mm(x, q4.qweight, q4.scales, 4).float()
    if bias:
        want = want + q4.bias.float()
    q4.bind_kernels(without_bf16())  # the panel GEMM or the float32 copy, by rows
    got = q4(x)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    torch.testing.assert_close(got.float(), want, rtol=2 * BF16_ULP, atol=2e-2)


def test_a_range_of_columns_is_that_slice_of_the_whole():
    _, q4 = linear_pair(3072, 576)
    whole = q4_weight_f32(q4).clone()
    assert torch.equal(q4_weight_f32(q4, 128, 1024), whole[:, 128:1024])


def test_a_weight_too_big_for_the_scratch_goes_in_chunks(monkeypatch):
    """The same product, a few columns at a time, with the scratch never bigger."""
    _, q4 = linear_pair(3072, 576, bias=True)
    x = torch.randn(DEQUANT_MIN_ROWS, 576).to(torch.bfloat16)
    whole = q4_dequant_mm(x, q4)
    # 256 columns: whole blocks of either layout (64 or 32 columns)
    monkeypatch.setattr(dequant, "MAX_SCRATCH_BYTES", 256 * 576 * 4)
    monkeypatch.setattr(dequant, "_local", type(dequant._local)())  # a fresh scratch
    assert dequant.column_step(576, 3072) == 256
    # equal up to a bf16 rounding that a differently blocked float32 sum may flip
    torch.testing.assert_close(q4_dequant_mm(x, q4), whole, rtol=BF16_ULP, atol=1e-3)
    assert dequant._local.buf.numel() == 576 * 256


def test_a_shape_off_the_pack_grid_is_refused(monkeypatch):
    """80 columns are no whole number of either layout's blocks (64 or 32)."""
    _, q4 = linear_pair(80, 64)
    with pytest.raises(ValueError, match="shape unsupported"):
        q4_weight_f32(q4)
    monkeypatch.setattr(dispatch, "probe", without_bf16)
    assert linear_pair(64, 64)[1].kernel_for(torch.zeros(64, 64)) == INT4_F32
    q4.bind_kernels()
    assert q4.kernel_for(torch.zeros(64, 64)) not in (INT4_F32, INT4_DEQUANT)


@pytest.fixture
def calls(monkeypatch):
    """The layers built on a CPU without bf16 arithmetic (quant_gemm's tiles never run
    there), with every call to the float32 paths counted."""
    monkeypatch.setattr(dispatch, "probe", without_bf16)
    seen = []
    for name in (INT4_F32, INT4_DEQUANT):
        def counted(x, linear, _kernel=KERNELS[name]):
            seen.append(x.shape[0])
            return _kernel(x, linear)
        monkeypatch.setitem(KERNELS, name, counted)
    return seen


def test_the_layer_takes_the_many_row_paths_from_their_row_thresholds(calls, monkeypatch):
    """From PANEL_MIN_ROWS the C panel GEMM, from DEQUANT_MIN_ROWS the float32 copy;
    fewer rows keep ATen's kernel, which reads the packed bytes."""
    copies = []
    real_copy = dequant.q4_weight_f32
    monkeypatch.setattr(dequant, "q4_weight_f32",
                        lambda *a: copies.append(1) or real_copy(*a))
    _, q4 = linear_pair(960, 576)
    x = torch.randn(DEQUANT_MIN_ROWS, 576)
    y = q4(x[:PANEL_MIN_ROWS])
    assert calls == [PANEL_MIN_ROWS] and y.dtype == torch.float32 and not copies
    q4(x[:PANEL_MIN_ROWS - 1])
    assert calls == [PANEL_MIN_ROWS]
    q4(x)
    assert calls == [PANEL_MIN_ROWS, DEQUANT_MIN_ROWS] and copies == [1]


def test_cpus_with_bf16_arithmetic_never_take_it(calls, monkeypatch):
    monkeypatch.setattr(dispatch, "probe", lambda: without_bf16(int4_in_float32=False))
    _, q4 = linear_pair(960, 576)
    q4(torch.randn(64, 576))
    assert calls == []


def test_int8_weights_never_take_it(calls):
    linear = torch.nn.Linear(576, 960)
    QuantizedLinear(linear, 8)(torch.randn(64, 576))
    assert calls == []


GGUF_Q4 = {"Q4_1": 106168320}  # what the converter records for the built-in model


@pytest.mark.parametrize("requested, types, device, tp, want", [
    ("auto", GGUF_Q4, "cpu", 1, True),
    ("none", GGUF_Q4, "cpu", 1, False),      # asked for unquantised
    ("auto", None, "cpu", 1, False),         # not a GGUF
    ("auto", {"Q4_K": 1, "Q6_K": 1}, "cpu", 1, False),  # 6-bit layers: no int4
    ("auto", GGUF_Q4, "cpu", 2, False),      # tensor parallel
    ("auto", GGUF_Q4, "cuda", 1, False),
])
def test_bf16_storage_only_for_an_int4_served_gguf(monkeypatch, requested, types, device,
                                                   tp, want):
    monkeypatch.setattr(quantization, "int4_runs_in_float32", lambda: True)
    assert bf16_storage_for_int4(requested, types, device, tp) is want
    monkeypatch.setattr(quantization, "int4_runs_in_float32", lambda: False)
    assert not bf16_storage_for_int4(requested, types, device, tp)


def test_the_dtype_is_the_cpus_choice_only_without_an_override(monkeypatch):
    """LLMSERVE_CPU_DTYPE (which the test suite sets) and an explicit --dtype are kept
    as they are: only the CPU's own choice may become bf16 storage for int4."""
    assert not EngineConfig(dtype="auto", device="cpu").dtype_from_cpu  # the suite's pin
    assert not EngineConfig(dtype="float32", device="cpu").dtype_from_cpu
    monkeypatch.delenv("LLMSERVE_CPU_DTYPE")
    assert EngineConfig(dtype="auto", device="cpu").dtype_from_cpu
    assert not EngineConfig(dtype="bfloat16", device="cpu").dtype_from_cpu


def test_the_builtin_model_is_served_int4_on_a_cpu_without_bf16(monkeypatch):
    """The engine's own resolution: dtype auto (the CPU's float32) becomes bf16 storage
    and quantization auto int4; its decode steps run in the C stack."""
    from llmserve import LLM, SamplingParams
    monkeypatch.delenv("LLMSERVE_CPU_DTYPE")
    monkeypatch.setattr(quantization, "int4_runs_in_float32", lambda: True)
    monkeypatch.setattr("llmserve.platforms.cpu.auto_dtype", lambda device: "float32")
    with LLM(max_num_seqs=4, kv_cache_memory=8 << 20, device="cpu") as llm:
        config = llm.engine.config
        assert (config.dtype, config.quantization) == ("bfloat16", "int4")
        assert llm.engine.runner.model.model.native_decoder is not None  # the C stack
        out = llm.generate(["The capital of France is"],
                           SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 8


AVX2_CHECK = """
import torch
from llmserve.model_executor.layers.quantization import QuantizedLinear
from llmserve.kernels.cpu.decoder import int4_pack_block_n
from llmserve.kernels.cpu.dequant import q4_weight_f32
torch.manual_seed(0)
lin = QuantizedLinear(torch.nn.Linear(576, 960), 4)
eye = torch.eye(576, dtype=torch.bfloat16)
want = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, lin.qweight, 32, lin.scales).float()
print(int4_pack_block_n())
print(((q4_weight_f32(lin) - want).abs() / want.abs().clamp(min=1e-3)).max().item())
"""


def test_the_avx2_layout_is_read_on_an_avx2_machine():
    """ATEN_CPU_CAPABILITY=avx2: ATen packs in 32-column blocks, dequant.c reads them
    (against ATen's own product with the identity, rounded once to bf16)."""
    block_n, err = run_as("avx2", AVX2_CHECK)[-2:]
    assert block_n == "32"
    assert float(err) <= BF16_ULP


def test_the_int8_row_thresholds_are_the_c_kernels():
    """The layer's int4 products round x from the row count the C kernel's int8 path
    starts at (decoder.c's Q4_INT8_ROWS, which the library reports: 1 in an AVX2 build,
    dequant.INT8_MIN_ROWS in an AVX-512 VNNI one), and gemm.Q8_INT8_MIN_ROWS states
    q8_rows.c's: a C change alone would misroute quietly."""
    import re
    from pathlib import Path

    from llmserve.kernels.cpu import gemm
    from llmserve.kernels.cpu.native import cpu_library, panel_int8_built

    def define(source: str, name: str) -> int:
        text = (Path(dequant.__file__).parent / source).read_text()
        return int(re.search(rf"#define {name} (\d+)", text).group(1))
    text = (Path(dequant.__file__).parent / "decoder.c").read_text()
    assert [int(n) for n in re.findall(r"#define Q4_INT8_ROWS (\d+)", text)] == [
        1, dispatch.INT8X_ROWS]  # the AVX2 build's, then the others'
    if panel_int8_built():
        rounding = dataclasses.replace(dispatch.probe(), int8_x=True, amx_tiles=False)
        assert (dispatch.route(4, (dispatch.INT4_INT8X,), rounding).first
                == cpu_library().q4_int8_min_rows())
    assert define("q8_rows.c", "Q8_INT8_ROWS") == gemm.Q8_INT8_MIN_ROWS
