"""Int8 weight-only products of a few rows (``kernels/cpu/q8_rows.c``): the LM head of
a decode step. The same product as ATen's ``_weight_int8pack_mm`` on the same int8
weight and scales, on the ISA this machine has and on the AVX2 and plain builds."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

from llmserve.kernels.cpu import dispatch
from llmserve.kernels.cpu.dispatch import Q8_ROWS, Q8_ROWS_INT8X, Q8_ROWS_MAX
from llmserve.kernels.cpu.gemm import q8_rows
from llmserve.kernels.cpu.native import cpu_library
from llmserve.model_executor.layers import quantization
from llmserve.model_executor.layers.quantization import QuantizedLinear, weight_only_mm
from tests.cpu_dispatch import q8_rows_max

pytestmark = pytest.mark.skipif(cpu_library() is None, reason="no C compiler here")


@pytest.fixture(autouse=True)
def x_in_float32(monkeypatch):
    """q8_rows with x in float32 (rounded to int8 where the CPU has VNNI by default:
    tests/kernels/test_cpu_int8_panels.py)."""
    monkeypatch.setenv("LLMSERVE_CPU_INT8_ACTIVATIONS", "0")


BF16_ULP = 2 ** -7


def int8_linear(out_features: int, in_features: int, bias: bool, seed: int) -> QuantizedLinear:
    """Rows of very different magnitudes, so a scale read for the wrong row is far off."""
    torch.manual_seed(seed)
    linear = torch.nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        linear.weight.mul_(torch.randn(out_features, 1).mul(2).exp())
        if bias:
            linear.bias.normal_()
    return QuantizedLinear(linear, 8)


def aten_int8(x: torch.Tensor, lin: QuantizedLinear) -> torch.Tensor:
    y = weight_only_mm(x, lin.qweight, lin.scales, 8)
    return y if lin.bias is None else y + lin.bias


# The LM head's shape, widths off the 4-row tiles and the 16-row thread units, one
# k chunk, and a down projection's depth.
@pytest.mark.parametrize("out_features, in_features", [(49152, 576), (960, 576), (101, 64),
                                                       (7, 16), (576, 1536)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 12, 13, 40, 100])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("threads", [1, 3])
def test_q8_rows_matches_atens_int8_kernel(out_features, in_features, rows, bias, threads,
                                           monkeypatch):
    """The same float32 products, summed in another order: nearly every output the same
    bf16 value, the rest one rounding of the product apart, plus one of the sum with the
    bias (a wrong row, scale or tile is ~100 % off). One thread, and three (shares of
    16-row units that do not divide evenly); 12 rows and more: the panel GEMM where built
    (40: groups of 12 and a rest; 100: past a block of 96 rows; 101 and 7 outputs, and
    960 on 3 threads: rows past a thread's last whole panel)."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)  # what q8_rows asks
    lin = int8_linear(out_features, in_features, bias, seed=rows)
    x = torch.randn(rows, in_features).to(torch.bfloat16)
    limit = q8_rows_max()
    if limit is not None and rows > limit:  # no panel GEMM (AMX, Zen 4): quant_gemm's rows
        assert lin.kernel_for(x) not in (Q8_ROWS, Q8_ROWS_INT8X)
        return
    want, got = aten_int8(x, lin).float(), q8_rows(x, lin).float()
    product = weight_only_mm(x, lin.qweight, lin.scales, 8).float()
    slack = BF16_ULP * (product.abs() + want.abs()) + 1e-2
    assert ((got - want).abs() <= slack).all()
    assert (got == want).float().mean() > 0.95


def test_q8_rows_reads_strided_rows_and_leading_dims():
    lin = int8_linear(64, 32, False, seed=0)
    wide = torch.randn(2, 3, 48).to(torch.bfloat16)
    x = wide[..., :32]  # rows 48 apart
    got = q8_rows(x, lin)
    assert got.shape == (2, 3, 64)
    torch.testing.assert_close(got.float(), aten_int8(x.reshape(-1, 32).contiguous(), lin)
                               .view(2, 3, 64).float(), rtol=BF16_ULP, atol=1e-2)


@pytest.mark.parametrize("case", ["int4", "too many rows", "k not a multiple of 16",
                                  "float32 input"])
def test_q8_rows_declines_what_it_does_not_compute(case, monkeypatch):
    """Outside its domain it returns None, and the layer keeps ATen's kernel; past the
    rows the dispatch table gives it (the limit of builds without AVX-512), the layer
    does not take it."""
    bits, rows, k, dtype = 8, 1, 64, torch.bfloat16
    if case == "int4":
        bits = 4
    elif case == "too many rows":  # the limit of builds without AVX-512
        baseline = dataclasses.replace(dispatch.probe(), library_isa="baseline",
                                       bf16_gemm=False, amx_tiles=False, int8_x=False,
                                       int4_in_float32=False, quant_gemm_bits=frozenset())
        monkeypatch.setattr(dispatch, "probe", lambda: baseline)
        rows = Q8_ROWS_MAX + 1
    elif case == "k not a multiple of 16":
        k = 24
    else:
        dtype = torch.float32
    lin = QuantizedLinear(torch.nn.Linear(k, 64), bits)
    if case == "too many rows":
        assert lin.kernel_for(torch.randn(rows, k).to(dtype)) == dispatch.ATEN
        return
    assert q8_rows(torch.randn(rows, k).to(dtype), lin) is None


def test_the_lm_head_of_a_decode_step_takes_q8_rows(monkeypatch):
    """QuantizedLinear sends a few rows of an int8 weight here (not to ATen), and more
    rows elsewhere."""
    calls = []

    def spy(x, linear):
        calls.append(x.shape[0])
        return q8_rows(x, linear, int8_x=False)

    monkeypatch.setitem(quantization.KERNELS, Q8_ROWS, spy)  # what the layers bind
    lin = int8_linear(256, 64, True, seed=1)
    x = torch.randn(3, 64).to(torch.bfloat16)
    got = lin(x)
    assert calls == [3]
    torch.testing.assert_close(got.float(), aten_int8(x, lin).float(), rtol=BF16_ULP, atol=1e-2)
    calls.clear()
    many = torch.randn(64, 64).to(torch.bfloat16)
    got = lin(many)  # quant_gemm's tiles, or q8_rows (AVX-512), or ATen's kernel
    assert calls in ([], [64])  # asked only where the tiles did not take it...
    # quant_gemm rounds each dequantised weight to bf16 (2^-9 of it at most) before its
    # bf16 product: its sums may be off by that much of sum |x| |w|, and by one rounding
    weights = lin.qweight.float() * lin.scales.float().reshape(-1, 1)
    magnitude = many.float().abs() @ weights.abs().t()
    want = aten_int8(many, lin).float()
    slack = BF16_ULP * want.abs() + 2 ** -8 * magnitude + 1e-2
    assert ((got.float() - want).abs() <= slack).all()
    if q8_rows_max() is None:  # ...and taken with AVX-512 (the GEMM over panels)...
        assert lin.kernel_for(many) == Q8_ROWS
    else:  # ...declined without
        assert lin.kernel_for(many) != Q8_ROWS


def test_q8_rows_takes_any_number_of_rows_exactly_where_the_panel_gemm_is_built():
    """The library says whether it has the panel GEMM (AVX-512 or AVX2 builds; not the
    baseline ISA's), and the CPU's own kind decides the build. The row limit follows
    it where there is no bf16 arithmetic, or where x is rounded to int8 (Zen 4); an
    AMX Xeon using its tiles keeps ATen's kernel past Q8_ROWS_MAX, as before the panels
    were built there."""
    from llmserve.kernels.cpu.gemm import amx_tiles, native_gemm_available, rounds_x_to_int8
    from llmserve.kernels.cpu.native import panel_gemms_built
    from llmserve.platforms.cpu import cpu_features
    assert panel_gemms_built() == (cpu_features().aten_isa in ("AVX512", "AVX2"))
    unlimited = panel_gemms_built() and (rounds_x_to_int8() or not native_gemm_available())
    assert q8_rows_max() == (None if unlimited else Q8_ROWS_MAX)
    if amx_tiles():
        assert q8_rows_max() == Q8_ROWS_MAX


OTHER_BUILD_CHECK = """
import sys
import torch
from llmserve.kernels.cpu.gemm import q8_rows
from llmserve.model_executor.layers.quantization import QuantizedLinear, weight_only_mm
torch.manual_seed(0)
lin = QuantizedLinear(torch.nn.Linear(576, 1001), 8)  # 1001: every tile width
worst = 0.0
for rows in map(int, sys.argv[1:]):
    x = torch.randn(rows, 576).to(torch.bfloat16)
    want = (weight_only_mm(x, lin.qweight, lin.scales, 8) + lin.bias).float()
    got = q8_rows(x, lin).float()
    worst = max(worst, ((got - want).abs() / want.abs().clamp(min=1)).max().item())
print(worst)
"""


# The plain build takes at most Q8_ROWS_MAX rows; the AVX2 one any number, from 12 as a
# GEMM over 16-column panels (8 x 8 transposes) in groups of at most 6 rows as even as
# can be (13: 5, 4, 4; 21: 6, 5, 5, 5; 40: five of 6 and two of 5), past the block of
# 96 rows (100).
@pytest.mark.parametrize("isa, rows", [("avx2", (1, 3, 8, 12, 13, 21, 40, 100)),
                                       ("default", (1, 3, 8))])
def test_the_avx2_and_plain_builds_compute_the_same(isa, rows):
    """ATEN_CPU_CAPABILITY=avx2 builds the kernels for AVX2 + FMA, =default for the
    architecture's baseline (no vector intrinsics): both take their own code paths."""
    env = dict(os.environ, ATEN_CPU_CAPABILITY=isa)
    out = subprocess.run([sys.executable, "-c", OTHER_BUILD_CHECK, *map(str, rows)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert float(out.stdout.strip().splitlines()[-1]) <= BF16_ULP
