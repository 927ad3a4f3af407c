"""int4 and int8 products with x rounded to int8 (``panel_int8.h``: AVX-512 VNNI and
AVX2): the C kernels' result (decoder.c's int4
products, q8_rows.c's int8 LM head) is the product of the int8-rounded x with the
dequantised weight, where it applies and only there.

The oracle rounds x as the kernel documents it (per row and group of 32: d = max|x| /
127, codes round(x / d) to nearest even) and multiplies in float64: the kernel sums the
same products exactly in integers and scales them in float32, so the two agree but for
a rare last-bit rounding of the bf16 output. Each build is checked where the machine
can run it: the one at hand in-process, the others in a subprocess, the VNNI kernels
built for an Ice Lake Xeon (``LLMSERVE_CPU_MARCH``) where the CPU has AVX-512 VNNI but
the build at hand does not (a CPU without it cannot run them) and the AVX2 ones under
``ATEN_CPU_CAPABILITY=avx2`` (every x86 machine here can)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

from llmserve.kernels.cpu import decoder, dispatch, gemm
from llmserve.kernels.cpu.decoder import int4_pack_block_n, q4_matmul
from llmserve.kernels.cpu.dequant import q4_weight_f32
from llmserve.kernels.cpu.dispatch import INT4_DEQUANT, INT4_F32, INT4_INT8X, QUANT_GEMM
from llmserve.kernels.cpu.gemm import Q8_INT8_MIN_ROWS, q8_rows
from llmserve.kernels.cpu.native import (
    cpu_library,
    panel_int8_block_n,
    panel_int8_built,
    q4_int8_min_rows,
    q8_rows_int8_built,
)
from llmserve.model_executor.layers.quantization import KERNELS, QuantizedLinear, weight_only_mm
from llmserve.model_executor.models.native_decoder import quant_gemm_rows
from tests.cpu_dispatch import quant_tiled_min_rows

# the fewest rows this build rounds x for (int4: 1 on AVX2, 3 on AVX-512 VNNI)
MIN_ROWS = {4: q4_int8_min_rows() or dispatch.INT8X_ROWS, 8: Q8_INT8_MIN_ROWS}
SHAPES = {4: [(960, 576), (128, 64), (3072, 576), (576, 1536), (192, 96)],  # 96: k % 64 == 32
          8: [(4096, 576), (128, 64), (960, 1536)]}  # int8: an LM head's rows


def cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        return set(next((line for line in f if line.startswith("flags")), "").split())


def has_vnni() -> bool:
    return {"avx512_vnni", "avx512bw", "avx512f"} <= cpu_flags()


def has_avx2() -> bool:
    return {"avx2", "fma"} <= cpu_flags()


pytestmark = pytest.mark.skipif(cpu_library() is None or int4_pack_block_n() is None
                                or not has_avx2(),
                                reason="needs the C kernels, ATen's int4 pack and AVX2")


def quantized(out_features: int, in_features: int, bias: bool, seed: int,
              bits: int = 4) -> QuantizedLinear:
    torch.manual_seed(seed)
    linear = torch.nn.Linear(in_features, out_features, bias=bias)
    if bias:
        linear.bias.data.normal_()
    return QuantizedLinear(linear, bits)


def product(x: torch.Tensor, lin: QuantizedLinear, int8_x: bool) -> torch.Tensor:
    """The C kernel's product: decoder.c's for int4, q8_rows.c's for int8."""
    return q4_matmul(x, lin, int8_x=int8_x) if lin.bits == 4 else q8_rows(x, lin, int8_x=int8_x)


def weight_t(lin: QuantizedLinear) -> torch.Tensor:
    """W^T in float64: int4 dequantised by dequant.c, int8 codes times their row's scale."""
    if lin.bits == 4:
        return q4_weight_f32(lin).double()
    return (lin.qweight.double() * lin.scales.double()[:, None]).t()


def rounded_to_int8(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel sees it: each group of 32 of a row as int8 codes times its step."""
    rows, k = x.shape
    groups = x.float().view(rows, k // 32, 32)
    step = groups.abs().amax(-1) / 127
    inverse = torch.where(step > 0, 1 / step, torch.zeros_like(step))
    codes = torch.round(groups * inverse[..., None])
    assert codes.abs().max() <= 127
    return (codes.double() * step[..., None].double()).view(rows, k)


def int8_oracle(x: torch.Tensor, lin: QuantizedLinear) -> torch.Tensor:
    """The product of the rounded x with the dequantised weight (float64), rounded to
    bf16, then + bias rounded again, as the kernels store it."""
    y = (rounded_to_int8(x) @ weight_t(lin)).float().to(torch.bfloat16)
    return y if lin.bias is None else y + lin.bias


def check_products(cases) -> list[float]:
    """For each (bits, out, in, rows, bias): the share of outputs bit-identical to the
    oracle, the largest difference from it in bf16 steps, and the share identical to
    the float32 path's (the rounding of x must show)."""
    results = []
    for bits, out_features, in_features, rows, bias in cases:
        lin = quantized(out_features, in_features, bias, seed=rows, bits=bits)
        x = torch.randn(rows, in_features).to(torch.bfloat16)
        x[0, :32] = 0  # a group of zeros: step 0, codes 0
        x[-1, 32:64] *= 1000  # a group far larger than its neighbours
        got, want = product(x, lin, int8_x=True), int8_oracle(x, lin)
        steps = (bf16_order(got) - bf16_order(want)).abs()
        # Where a sum cancels (the large group's row), float32's own rounding of its
        # terms may reach past one bf16 step of the small result; with a bias, one
        # step of the product (rounded before the bias is added) and the second
        # rounding may be two or more of the result.
        exact = rounded_to_int8(x) @ weight_t(lin)
        magnitude = rounded_to_int8(x).abs() @ weight_t(lin).abs()
        cancelled = ((got.double() - want.double()).abs()
                     <= torch.maximum(1e-6 * magnitude, exact.abs() * 2 ** -6))
        steps = torch.where(cancelled, torch.zeros_like(steps), steps).max().item()
        float_path = product(x, lin, int8_x=False)
        results.append(((got == want).float().mean().item(), steps,
                        (got == float_path).float().mean().item()))
    return results


def bf16_order(y: torch.Tensor) -> torch.Tensor:
    """bf16 values as integers in the order of the values: neighbours differ by 1."""
    bits = y.view(torch.int16).int()
    return torch.where(bits < 0, -(bits & 0x7FFF), bits)


# the fewest rows each takes and one more (AVX2's int4: 1 and 2 rows straight from the
# pack, q4_row_int8), a group of 6 (AVX2: 4) and a rest, past the block of 96 rows, and
# a long prefill chunk
CASES = [(bits, n, k, rows, bias) for bits in SHAPES for n, k in SHAPES[bits]
         for rows in (MIN_ROWS[bits], MIN_ROWS[bits] + 1, 6, 17, 100, 500)
         for bias in (False, True)]


def cases_of_this_build() -> list[tuple]:
    """CASES this process's build rounds x for: the int8 LM head's only where built."""
    return [case for case in CASES if case[0] == 4 or q8_rows_int8_built()]


# each build's int8 panels: the int4 block they read, and how a machine that does not
# build them by default builds them (an outer ATEN_CPU_CAPABILITY or LLMSERVE_CPU_MARCH,
# as when the whole suite acts as an AVX2 machine, must not change which)
BUILDS = {"vnni": (64, {"LLMSERVE_CPU_MARCH": "icelake-server",
                        "ATEN_CPU_CAPABILITY": "avx512"}),
          "avx2": (32, {"ATEN_CPU_CAPABILITY": "avx2"})}
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SUBPROCESS = """
import json, sys
sys.path.insert(0, {root!r})
import tests.kernels.test_cpu_int8_panels as here
print(json.dumps(here.{check}()))
"""


def run_with(env_changes: dict, check: str):
    """This module's ``check()`` in a fresh Python with ``env_changes`` (its JSON), the
    switch LLMSERVE_CPU_INT8_ACTIVATIONS at its default, and the CPU as the host's
    plus ``env_changes``: an ISA forced on the whole suite (the AVX2 emulation's
    variables) would otherwise turn an emulated Zen 4 into an AVX2 build."""
    env = {key: value for key, value in os.environ.items()
           if key not in ("LLMSERVE_CPU_MARCH", "LLMSERVE_CPU_INT8_ACTIVATIONS",
                          "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS",
                          "ONEDNN_MAX_CPU_ISA")}
    env.update(env_changes)
    out = subprocess.run([sys.executable, "-c", SUBPROCESS.format(root=ROOT, check=check)],
                         env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def in_build(build: str, check: str, monkeypatch):
    """This module's ``check()`` where the library is the ``build`` kind: here if it is,
    else in a subprocess (skipped where the CPU cannot run that build)."""
    block_n, env_changes = BUILDS[build]
    if panel_int8_block_n() == block_n:
        monkeypatch.delenv("LLMSERVE_CPU_INT8_ACTIVATIONS", raising=False)
        return json.loads(json.dumps(globals()[check]()))
    if build == "vnni" and not has_vnni():
        pytest.skip("the CPU has no AVX-512 VNNI")
    return run_with(env_changes, check)


def products_check() -> list:
    """(cases, check_products of them) on this process's build."""
    cases = cases_of_this_build()
    return [cases, check_products(cases)]


@pytest.mark.parametrize("build", BUILDS)
def test_the_product_is_that_of_x_rounded_to_int8(build, monkeypatch):
    """Nearly every output bit-identical to the oracle, none more than one bf16 step
    off; and far from bit-identical to the float32 path (a missed scale, group,
    nibble or int8 offset is off by many steps; a kernel that skipped the rounding
    would match the float32 path). The int8 LM head too (AVX2: as two int4 weights)."""
    cases, results = in_build(build, "products_check", monkeypatch)
    assert {case[0] for case in cases} == {4, 8}
    for case, (identical, steps, as_float) in zip(cases, results):
        assert identical > 0.99 and steps <= 1, (case, identical, steps)
        assert as_float < 0.9, (case, as_float)


def int16_limit_check() -> bool:
    """A group at the AVX2 build's int16 limit: every int16 lane of the first pair of k
    sums 16 products of 15 x 127 (30,480 of 32,767: a group of 64 would wrap). The
    weight is 1 along k but for -1 at each group's last k (int4 codes 15 and 0), x all
    ones (codes 127)."""
    weight = torch.ones(64, 576)
    weight[:, 31::32] = -1
    linear = torch.nn.Linear(576, 64, bias=False)
    linear.weight.data.copy_(weight)
    lin = QuantizedLinear(linear, 4)
    assert weight_t(lin).unique().numel() == 2  # codes 0 and 15 only
    x = torch.ones(5, 576).to(torch.bfloat16)  # the AVX2 build: 4 rows in assembly, 1 in C
    # and 1-2 rows alone (AVX2: straight from the pack)
    return all(torch.equal(q4_matmul(x[:rows], lin, int8_x=True), int8_oracle(x[:rows], lin))
               for rows in (5, 1, 2))


@pytest.mark.parametrize("build", BUILDS)
def test_a_group_at_the_int16_limit_sums_exactly(build, monkeypatch):
    assert in_build(build, "int16_limit_check", monkeypatch)


def same_bits_check() -> list[int]:
    """Int4 products of 3 rows; 6 (on AVX2 a group of 4, in assembly, and a rest of 2);
    37 (groups of 6 and of 4 and their rests); 200 (past the block of 96); and int8 LM
    heads of 4, 5, 7 and 21 rows (AVX2: rests of 1 and 3 in C) and 110 (past the block),
    as bf16 bit patterns."""
    torch.manual_seed(0)
    outputs = []
    for n, k, rows in ((960, 576, 3), (576, 576, 6), (3072, 576, 37), (576, 1536, 200)):
        lin = quantized(n, k, True, seed=rows)
        outputs.append(q4_matmul(torch.randn(rows, k).to(torch.bfloat16), lin, int8_x=True))
    for n, k, rows in ((4096, 576, 4), (128, 64, 5), (960, 1536, 7), (4096, 576, 21),
                       (128, 576, 110)):
        head = quantized(n, k, rows % 2 == 1, seed=rows, bits=8)
        outputs.append(q8_rows(torch.randn(rows, k).to(torch.bfloat16), head, int8_x=True))
    return torch.cat([y.view(torch.int16).flatten() for y in outputs]).tolist()


def test_the_avx2_and_vnni_builds_compute_the_same_bits(monkeypatch):
    """Both builds sum the same integers and scale them by the same float32 operations
    in the same order: their int4 products and int8 LM heads are bit-identical."""
    assert (in_build("vnni", "same_bits_check", monkeypatch)
            == in_build("avx2", "same_bits_check", monkeypatch))


def avx2_routing_check() -> dict:
    """What an AVX2 build does by default: the int4 products of every row count round x
    (the torch layer and q4_matmul alike); the int8 LM head from 4 rows."""
    lin = quantized(960, 576, False, seed=1)
    head = quantized(4096, 576, False, seed=0, bits=8)
    x = torch.randn(400, 576).to(torch.bfloat16)
    return {
        "int8_activations": decoder.int8_activations(),
        "q8_rows_int8_built": q8_rows_int8_built(),
        "layer rounds from 1 row": all(
            lin.kernel_for(x[:rows]) == INT4_INT8X
            and torch.equal(lin(x[:rows]), q4_matmul(x[:rows], lin, int8_x=True))
            and torch.equal(q4_matmul(x[:rows], lin), q4_matmul(x[:rows], lin, int8_x=True))
            for rows in (1, 2, 3, 16, 400)),
        "1 row rounds": not torch.equal(q4_matmul(x[:1], lin, int8_x=True),
                                        q4_matmul(x[:1], lin, int8_x=False)),
        "LM head rounds from 4 rows": all(
            not torch.equal(q8_rows(x[:rows], head, int8_x=True),
                            q8_rows(x[:rows], head, int8_x=False))
            for rows in (Q8_INT8_MIN_ROWS, 20)),
        "3 LM head rows keep float32": torch.equal(q8_rows(x[:3], head, int8_x=True),
                                                   q8_rows(x[:3], head, int8_x=False)),
    }


def test_an_avx2_build_rounds_x_by_default(monkeypatch):
    assert in_build("avx2", "avx2_routing_check", monkeypatch) == {
        "int8_activations": True, "q8_rows_int8_built": True,
        "layer rounds from 1 row": True, "1 row rounds": True,
        "LM head rounds from 4 rows": True, "3 LM head rows keep float32": True}


def rows_alone_check() -> list[bool]:
    """Whether each row's int4 product is bit for bit the same alone (AVX2: 1 row
    straight from the pack), in pairs, and among 7 rows (the panels), with and without a
    bias, for weights of 30, 96, 18, 4 and 6 blocks of 32 columns over the threads."""
    results = []
    for n, k, bias in ((960, 576, False), (3072, 576, True), (576, 1536, True),
                       (128, 64, False), (192, 96, True)):
        lin = quantized(n, k, bias, seed=n + k)
        x = torch.randn(7, k).to(torch.bfloat16)
        together = q4_matmul(x, lin, int8_x=True)
        alone = torch.cat([q4_matmul(x[i:i + 1], lin, int8_x=True) for i in range(7)])
        pairs = torch.cat([q4_matmul(x[i:i + 2], lin, int8_x=True) for i in range(0, 6, 2)])
        results += [torch.equal(alone, together), torch.equal(pairs, together[:6])]
    return results


@pytest.mark.parametrize("build", BUILDS)
def test_a_row_alone_computes_what_it_does_among_others(build, monkeypatch):
    """A decode step of one sequence (AVX2: q4_row_int8 from the pack) and a batch
    (the panels) give each row the same bits: the same integers, scaled alike."""
    results = in_build(build, "rows_alone_check", monkeypatch)
    if build == "avx2":
        assert all(results), results
    else:  # the VNNI build keeps 1-2 rows in float32: alone differs from among 7
        assert not any(results[0::2]), results


def mismatch_check() -> list:
    return [decoder.int8_activations(), panel_int8_block_n(), int4_pack_block_n()]


def test_a_vnni_build_under_atens_avx2_pack_keeps_x_in_float32():
    """The VNNI panels read 64-column blocks: where ATen packs 32 (a forced AVX2 ATen
    with an AVX-512 build) nothing rounds, in Python's routing as in C's."""
    if not has_vnni():
        pytest.skip("the CPU has no AVX-512 VNNI: the VNNI build cannot run here")
    assert run_with({"LLMSERVE_CPU_MARCH": "icelake-server", "ATEN_CPU_CAPABILITY": "avx2"},
                    "mismatch_check") == [False, 64, 32]


needs_kernel_here = pytest.mark.skipif(not panel_int8_built(),
                                       reason="this build has no int8 panels (checked above "
                                              "as the other builds)")


@needs_kernel_here
@pytest.mark.parametrize("bits, rows", [(bits, rows) for bits in MIN_ROWS
                                        for rows in range(1, MIN_ROWS[bits])])
def test_fewer_rows_keep_x_in_float32(bits, rows):
    """Below MIN_ROWS the tiles stream the weight: exactly the float32 path."""
    lin = quantized(960, 576, False, seed=rows, bits=bits)
    x = torch.randn(rows, 576).to(torch.bfloat16)
    assert torch.equal(product(x, lin, True), product(x, lin, False))


@needs_kernel_here
@pytest.mark.parametrize("out_features, in_features", [(960, 48), (936, 576)])
def test_an_int8_weight_off_the_panels_grid_keeps_x_in_float32(out_features, in_features):
    """The int8 panels take k in multiples of 64 and n of their panel's columns (32;
    16 on AVX2): other shapes keep the float32 path, whole."""
    lin = quantized(out_features, in_features, False, seed=0, bits=8)
    x = torch.randn(20, in_features).to(torch.bfloat16)
    assert torch.equal(q8_rows(x, lin, int8_x=True), q8_rows(x, lin, int8_x=False))


@needs_kernel_here
def test_it_is_the_default_unless_switched_off(monkeypatch, without_amx_tiles):
    monkeypatch.delenv("LLMSERVE_CPU_INT8_ACTIVATIONS", raising=False)
    lin = quantized(960, 576, True, seed=0)  # bound for the default
    x = torch.randn(40, 576).to(torch.bfloat16)
    head = quantized(960, 576, True, seed=0, bits=8)
    assert decoder.int8_activations()
    assert torch.equal(lin(x), q4_matmul(x, lin, int8_x=True))
    assert torch.equal(q4_matmul(x, lin), q4_matmul(x, lin, int8_x=True))
    assert torch.equal(q8_rows(x, head), q8_rows(x, head, int8_x=True))
    monkeypatch.setenv("LLMSERVE_CPU_INT8_ACTIVATIONS", "0")
    assert not decoder.int8_activations()
    assert torch.equal(q4_matmul(x, lin), q4_matmul(x, lin, int8_x=False))
    few = x[:8]  # (where quant_gemm is built, more rows are not q8_rows' without rounding)
    assert torch.equal(q8_rows(few, head), q8_rows(few, head, int8_x=False))


@pytest.fixture
def without_amx_tiles():
    """quant_gemm without AMX tiles (as on Zen 4; a no-op where there are none)."""
    was = gemm.amx_tiles()
    gemm.amx_tiles(False)
    yield
    gemm.amx_tiles(was)


@needs_kernel_here
@pytest.mark.parametrize("rows", [MIN_ROWS[4], 16, 384, 600])
def test_the_layer_rounds_x_from_int8_min_rows_on(rows, monkeypatch, without_amx_tiles):
    """The torch layer takes the int8 panels for any number of rows from int8_min_rows()
    (long prefill chunks too, where x in float32 goes to MKL, and where gemm.c's
    quant_gemm multiplies by bf16 dot products: Zen 4, an AMX Xeon without its tiles);
    the C decoder stack reads the same setting, so prefill and decode steps round
    alike."""
    monkeypatch.delenv("LLMSERVE_CPU_INT8_ACTIVATIONS", raising=False)
    lin = quantized(960, 576, False, seed=rows)
    x = torch.randn(rows, 576).to(torch.bfloat16)
    assert lin.kernel_for(x) != QUANT_GEMM
    assert lin.kernel_for(x) == INT4_INT8X
    assert torch.equal(lin(x), q4_matmul(x, lin, int8_x=True))
    assert torch.equal(KERNELS[lin.kernel_for(x)](x, lin), q4_matmul(x, lin, int8_x=True))
    if MIN_ROWS[4] > 1:  # (AVX2 builds round from 1 row: nothing below)
        assert lin.kernel_for(x[:MIN_ROWS[4] - 1]) != INT4_INT8X


def test_amx_tiles_keep_x_in_bf16(monkeypatch):
    """Where AMX tiles are in use x is not rounded at any row count: quant_gemm's tiles
    from 8 rows, ATen's kernel and q8_rows' float32 tiles below, as before the int8
    panels were built here (a switch between the two at some row count would make a
    prompt's logits depend on how many of its tokens a step computes)."""
    if not gemm.amx_tiles():
        pytest.skip("no AMX tiles here (CPU, compiler or OS)")
    monkeypatch.delenv("LLMSERVE_CPU_INT8_ACTIVATIONS", raising=False)
    assert decoder.int8_activations() and not gemm.rounds_x_to_int8()
    lin = quantized(960, 576, False, seed=4)
    head = quantized(4096, 576, False, seed=4, bits=8)
    assert quant_tiled_min_rows() == 8 and quant_gemm_rows([lin]) == 8
    x = torch.randn(8, 576).to(torch.bfloat16)
    few = x[:7]
    assert lin.kernel_for(few) not in (INT4_INT8X, INT4_F32, INT4_DEQUANT)
    assert torch.equal(lin(few), weight_only_mm(few, lin.qweight, lin.scales, 4))  # ATen's
    assert torch.equal(lin(x), gemm.quant_gemm(x, lin))
    assert torch.equal(q4_matmul(few, lin), q4_matmul(few, lin, int8_x=False))
    assert torch.equal(head(few), q8_rows(few, head, int8_x=False))
    assert not torch.equal(head(few), q8_rows(few, head, int8_x=True))
    assert torch.equal(head(x), gemm.quant_gemm(x, head))


@needs_kernel_here
def test_an_int8_weight_off_the_int8_grid_keeps_quant_gemms_crossover(monkeypatch,
                                                                      without_amx_tiles):
    """An LM head whose width the int8 panels do not take (n % 32 == 16: a vocabulary
    of 32,016, say) is not declined by quant_gemm for them: it keeps the crossover
    quant_gemm has over the float32 kernels."""
    if not gemm.quant_tiled_available(8):
        pytest.skip("quant_gemm needs AVX512-BF16")
    monkeypatch.delenv("LLMSERVE_CPU_INT8_ACTIVATIONS", raising=False)
    monkeypatch.setenv("LLMSERVE_BF16_GEMM", "native")  # any shape, not only those measured
    assert gemm.rounds_x_to_int8() and quant_tiled_min_rows() is None
    least = quant_tiled_min_rows(dataclasses.replace(dispatch.probe(), int8_x=False))
    head = quantized(944, 576, False, seed=5, bits=8)
    x = torch.randn(least, 576).to(torch.bfloat16)
    assert torch.equal(head(x), gemm.quant_gemm(x, head))
    assert head.kernel_for(x[:least - 1]) != QUANT_GEMM


def has_avx512_bf16() -> bool:
    return {"avx512_bf16", "avx512_vnni"} <= cpu_flags()


def without_amx_routing_check() -> list:
    """What a CPU with AVX512-BF16 and VNNI but no AMX (Zen 4) takes: no AMX in the
    features or the build, quant_gemm built, x rounded to int8, and quant_gemm then
    taking no int4 or int8 product."""
    from llmserve.platforms.cpu import cpu_features
    lin = quantized(960, 576, False, seed=2)
    x = torch.randn(600, 576).to(torch.bfloat16)
    return [cpu_features().amx_bf16, gemm.amx_tiles(), gemm.quant_tiled_available(4),
            gemm.rounds_x_to_int8(), quant_tiled_min_rows(),
            torch.equal(lin(x), q4_matmul(x, lin, int8_x=True))]


def test_an_amx_xeon_told_no_amx_routes_as_zen_4():
    """``ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16`` leaves AMX out of oneDNN, of the CPU's
    features and of our kernels' build: how an AMX host measures a Zen 4's routing (on
    a Zen 4 it is its own)."""
    if not has_avx512_bf16():
        pytest.skip("the CPU has no AVX512-BF16 with VNNI")
    assert run_with({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"},
                    "without_amx_routing_check") == [False, False, True, True, None, True]


def without_bf16_routing_check() -> list:
    """What an AVX-512 VNNI build without bf16 arithmetic (Ice Lake) takes: no
    quant_gemm, x rounded from 3 rows at every count (the torch layer, long prefill
    chunks too), the C stack up to 2048 rows (whole prompt steps)."""
    from llmserve.model_executor.models.native_decoder import max_native_tokens
    lin = quantized(960, 576, False, seed=3)
    x = torch.randn(600, 576).to(torch.bfloat16)
    return [gemm.quant_tiled_available(4), decoder.int8_activations(), max_native_tokens(64),
            torch.equal(lin(x), q4_matmul(x, lin, int8_x=True))]


def test_an_ice_lake_build_rounds_x_without_quant_gemm():
    """The Ice Lake build's routing, wherever the CPU can run it (on AMX and Zen 4 the
    build at hand has bf16 arithmetic, so this runs in a subprocess built for Ice Lake)."""
    if not has_vnni():
        pytest.skip("the CPU has no AVX-512 VNNI")
    assert run_with(BUILDS["vnni"][1], "without_bf16_routing_check") == [False, True, 2048, True]
