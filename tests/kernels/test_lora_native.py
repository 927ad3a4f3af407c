"""The C kernel of the CPU multi-LoRA (kernels/cpu/lora.c through lora.py's
``lora_add``) against the segment reference and the torch path: groups of any size,
order and padding, ranks below the gathered rank, one to three slices whose widths
are not multiples of the kernel's 16 lanes, float32 and bf16, and the AVX2 build."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from llmserve.kernels.cpu import lora as cpu_lora
from llmserve.kernels.cpu import native
from llmserve.kernels.triton.lora import lora_expand_reference, lora_shrink_reference

pytestmark = pytest.mark.skipif(native.cpu_library() is None,
                                reason="no C compiler: the torch path only")

RANKS = [8, 3, 1, 6]  # slot s's rank; the gathered rank is the step's largest


def make_weights(outs: list[int], k: int, dtype: torch.dtype, big_r: int = 8):
    """Stacked slots as LoRALinear keeps them: zero past each slot's rank."""
    n = len(outs)
    a = torch.zeros(len(RANKS), n * big_r, k)
    b = [torch.zeros(len(RANKS), o, big_r) for o in outs]
    for slot, r in enumerate(RANKS):
        for i in range(n):
            a[slot, i * big_r:i * big_r + r] = torch.randn(r, k)
            b[i][slot, :, :r] = torch.randn(outs[i], r)
    return a.to(dtype), [bi.to(dtype) for bi in b]


def segments(lengths: list[int], slots: list[int]):
    """The batch's starts, and its rows grouped by slot (-1: the base model's)."""
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    groups: dict[int, list[int]] = {}
    for i, slot in enumerate(slots):
        if slot >= 0:
            groups.setdefault(slot, []).extend(range(starts[i], starts[i + 1]))
    return starts, groups


def reference(y, x, a, b, starts, slots, big_r=8):
    want = y.clone()
    seg_starts, seg_slots = torch.tensor(starts), torch.tensor(slots)
    longest = max(s1 - s0 for s0, s1 in zip(starts, starts[1:]))
    xa = lora_shrink_reference(x, a, seg_starts, seg_slots, longest)
    offset = 0
    for i, bi in enumerate(b):
        lora_expand_reference(want, xa, bi, seg_starts, seg_slots, longest, i * big_r, offset)
        offset += bi.shape[1]
    return want


def torch_path(monkeypatch, y, x, a, b, plan):
    with monkeypatch.context() as m:
        m.setattr(cpu_lora, "_native_applies", lambda *args: False)
        got = y.clone()
        cpu_lora.lora_add(got, x, a, b, plan, cache={})
    return got


CASES = [
    ([4, 4, 4, 4], [0, 1, 2, 3]),  # decodes laid out by adapter: one span
    ([1, 3, 1, 2, 1, 5], [2, 0, -1, 2, 1, 3]),  # uneven groups: the torch path pads
    ([40, 1, 25, 1, 1], [1, 1, -1, 3, 1]),  # a long group whose rows are not contiguous
    ([1], [2]),  # one row, one adapter of rank 1 (a single tile, one thread)
    ([7, 9], [3, 3]),  # one slot of rank 6: the gathered rank is below the stacked 8
]
SLICES = [[40], [24, 5], [33, 16, 16]]  # o/down, gate/up, q/k/v; tails past 16 lanes


@pytest.mark.parametrize("lengths, slots", CASES)
@pytest.mark.parametrize("outs", SLICES, ids=lambda outs: f"{len(outs)}slices")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_c_kernel_equals_the_reference_and_the_torch_path(monkeypatch, lengths, slots,
                                                              outs, dtype):
    torch.manual_seed(len(lengths) * 10 + len(outs))
    k = 37  # a tail past the 16-lane blocks of the dot products
    a, b = make_weights(outs, k, dtype)
    starts, groups = segments(lengths, slots)
    x = torch.randn(starts[-1], k).to(dtype)
    y = torch.randn(starts[-1], sum(outs)).to(dtype)
    plan = cpu_lora.CPULoRAPlan.build(groups, RANKS)
    cache: dict = {}
    got = y.clone()
    cpu_lora.lora_add(got, x, a, b, plan, cache)
    (weights,) = cache.values()
    assert len(weights) == 4 and weights[1].shape == (len(groups), plan.rank, sum(outs))
    base_rows = [r for i, s in enumerate(slots) if s < 0 for r in range(starts[i], starts[i + 1])]
    assert torch.equal(got[base_rows], y[base_rows])  # the base model's rows untouched
    assert not torch.equal(got, y)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    want = reference(y, x, a, b, starts, slots)
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * 10)
    torch.testing.assert_close(got.float(), torch_path(monkeypatch, y, x, a, b, plan).float(),
                               rtol=tol, atol=tol * 10)


def test_bf16_rows_round_once_from_the_float32_sum():
    """y + delta in float32, rounded to bf16 once: the float32 computation on the same
    inputs, rounded, within one bf16 step of rounding (sums in another order)."""
    torch.manual_seed(1)
    a, b = make_weights([64, 32], 128, torch.bfloat16)
    starts, groups = segments([5, 3], [0, 3])
    x = torch.randn(8, 128).bfloat16()
    y = torch.randn(8, 96).bfloat16()
    got = y.clone()
    cpu_lora.lora_add(got, x, a, b, cpu_lora.CPULoRAPlan.build(groups, RANKS), cache={})
    exact = reference(y.float(), x.float(), a.float(), [bi.float() for bi in b], starts,
                      [0, 3])
    ulp = exact.abs() * 2.0 ** -7
    assert ((got.float() - exact).abs() <= ulp + 1e-6).all()


def test_float32_weights_of_bf16_rows_give_the_same_sums():
    """The gathered copy may be float32 or bf16: bf16 weights widen exactly."""
    torch.manual_seed(2)
    a, b = make_weights([48, 16, 16], 64, torch.bfloat16)
    _, groups = segments([4, 4, 4], [0, 1, 3])
    plan = cpu_lora.CPULoRAPlan.build(groups, RANKS)
    x, y = torch.randn(12, 64).bfloat16(), torch.randn(12, 80).bfloat16()
    results = []
    for dtype in (torch.bfloat16, torch.float32):
        got = y.clone()
        *_, args = cpu_lora.gather_native_weights(a, b, plan, dtype)
        native.lora_add_rows(got, x, plan.rows_args(), args)
        results.append(got)
    assert torch.equal(results[0], results[1])


def test_the_gathered_weights_are_reused_until_the_slots_change():
    torch.manual_seed(3)
    a, b = make_weights([16], 32, torch.float32)
    x, y = torch.randn(4, 32), torch.zeros(4, 16)
    cache: dict = {}
    first = cpu_lora.CPULoRAPlan.build({0: [0, 1], 1: [2, 3]}, RANKS)
    cpu_lora.lora_add(y, x, a, b, first, cache)
    (weights,) = cache.values()
    cpu_lora.lora_add(y, x, a, b, cpu_lora.CPULoRAPlan.build({0: [0, 1], 1: [2, 3]}, RANKS),
                      cache)
    assert next(iter(cache.values())) is weights  # same slots: not gathered again
    cpu_lora.lora_add(y, x, a, b, cpu_lora.CPULoRAPlan.build({2: [0, 1, 2, 3]}, RANKS), cache)
    assert len(cache) == 1 and next(iter(cache.values())) is not weights


def test_inputs_that_do_not_fit_are_refused_and_leave_y_alone():
    a, b = make_weights([16], 32, torch.float32)
    plan = cpu_lora.CPULoRAPlan.build({0: [0], 1: [3]}, RANKS)
    *_, args = cpu_lora.gather_native_weights(a, b, plan)
    with pytest.raises(ValueError, match="one dtype"):
        native.lora_add_rows(torch.zeros(4, 16).bfloat16(), torch.zeros(4, 32),
                             plan.rows_args(), args)
    for x, y in [(torch.ones(3, 32), torch.zeros(3, 16)),  # row 3 is past the batch
                 (torch.ones(4, 31), torch.zeros(4, 16)),  # K is not the weights'
                 (torch.ones(4, 32), torch.zeros(4, 17))]:  # nor N
        with pytest.raises(ValueError, match="do not fit"):
            native.lora_add_rows(y, x, plan.rows_args(), args)
        assert not y.any()


def test_without_the_kernels_lora_add_keeps_the_torch_path(monkeypatch):
    """No compiler (cpu_library() None): the torch ops, with their own weights."""
    torch.manual_seed(4)
    a, b = make_weights([24, 8], 32, torch.float32)
    starts, groups = segments([2, 1, 3], [0, -1, 1])
    x, y = torch.randn(6, 32), torch.randn(6, 32)
    monkeypatch.setattr(native, "cpu_library", lambda: None)
    cache: dict = {}
    got = y.clone()
    cpu_lora.lora_add(got, x, a, b, cpu_lora.CPULoRAPlan.build(groups, RANKS), cache)
    (weights,) = cache.values()
    assert len(weights) == 2  # the torch path's float32 A and block-diagonal B
    torch.testing.assert_close(got, reference(y, x, a, b, starts, [0, -1, 1]))


AVX2_CHECK = """
import torch
from llmserve.kernels.cpu import lora, native
assert '-march=haswell' in native._march()
torch.manual_seed(0)
outs, k = [33, 16, 16], 100
a = torch.randn(4, 24, k).bfloat16()
b = [torch.randn(4, o, 8).bfloat16() for o in outs]
groups = {0: [0, 1, 2, 3, 4], 2: [5], 1: [7, 6], 3: [8, 9, 10, 11, 12, 13, 14, 15, 16]}
x, y = torch.randn(17, k).bfloat16(), torch.randn(17, 65).bfloat16()
plan = lora.CPULoRAPlan.build(groups, [8, 8, 8, 8])
got, want = y.clone(), y.clone()
lora.lora_add(got, x, a, b, plan, cache={})
assert native.cpu_library() is not None
lora._native_applies = lambda *args: False
lora.lora_add(want, x, a, b, plan, cache={})
print(((got.float() - want.float()).abs() / (1 + want.float().abs())).max().item())
"""


def test_the_avx2_build_computes_the_same():
    """ATEN_CPU_CAPABILITY=avx2 (how CI acts as an AVX2-only machine) builds lora.c for
    AVX2 + FMA: the same sums as the torch path."""
    env = dict(os.environ, ATEN_CPU_CAPABILITY="avx2")
    out = subprocess.run([sys.executable, "-c", AVX2_CHECK], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert float(out.stdout.strip().splitlines()[-1]) < 2e-2
