"""The multi-LoRA Triton kernels (kernels/triton/lora.py) against a dense per-row oracle
and against their PyTorch references. Without CUDA they run on CPU in Triton's
interpreter (fp32 and fp16; its bf16 is wrong); with CUDA on the GPU, bf16 included."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must be set before triton is imported

import pytest  # noqa: E402

lora = pytest.importorskip("llmserve.kernels.triton.lora")
triton_attention = pytest.importorskip("llmserve.kernels.triton.attention")

INTERPRETED = triton_attention.INTERPRETED
DEVICE = "cpu" if INTERPRETED else "cuda"
# bf16 on a GPU only: the interpreter computes it wrongly.
DTYPES = [torch.float32, torch.float16] + ([] if INTERPRETED else [torch.bfloat16])
NUM_SLOTS = 4  # slot 1 is never used by a segment: its weights must not matter
PADDING_ROWS = 3  # rows past the last segment, as a CUDA graph's padded batch has


def make_segments(seed: int) -> tuple[list[int], list[int]]:
    """Random (lengths, slots) with what every batch here must hold: one-token decodes,
    a prefill longer than one 64-row tile, a -1 segment, a slot used twice."""
    g = torch.Generator().manual_seed(seed)
    lens = [1, 1, 1, 70] + torch.randint(1, 40, (4,), generator=g).tolist()
    slots = [0, -1, 2, 2] + [[-1, 0, 2, 3][i] for i in
                             torch.randint(0, 4, (4,), generator=g).tolist()]
    order = torch.randperm(len(lens), generator=g).tolist()
    return [lens[i] for i in order], [slots[i] for i in order]


def seg_tensors(lens: list[int], slots: list[int]):
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    return (torch.tensor(starts, dtype=torch.int32, device=DEVICE),
            torch.tensor(slots, dtype=torch.int32, device=DEVICE))


def slot_of_each_row(lens: list[int], slots: list[int]) -> torch.Tensor:
    """[T] the slot of every row (padding rows: -1), built from the Python lists."""
    per_row = [s for n, s in zip(lens, slots) for _ in range(n)] + [-1] * PADDING_ROWS
    return torch.tensor(per_row, device=DEVICE)


def make_weights(k: int, out_sizes: list[int], rank: int, dtype, seed: int):
    """a [S, n*R, K] and one b [S, N_i, R] per slice, scaled so the LoRA delta is about
    as large as the base output. Slot 3 is a lower-rank adapter zero-padded to R."""
    g = torch.Generator().manual_seed(seed)
    n = len(out_sizes)
    a = torch.randn(NUM_SLOTS, n * rank, k, generator=g) / k ** 0.5
    bs = [torch.randn(NUM_SLOTS, size, rank, generator=g) / rank ** 0.5 for size in out_sizes]
    low = rank // 2
    for i in range(n):
        a[3, i * rank + low:(i + 1) * rank] = 0
        bs[i][3, :, low:] = 0
    return a.to(dtype).to(DEVICE), [b.to(dtype).to(DEVICE) for b in bs]


def dense_oracle(y, x, a, bs, row_slots, rank):
    """y + x @ A.T @ B.T with each row's own adapter gathered per row (no segments),
    in float64; rows of slot -1 keep y."""
    use = row_slots >= 0
    slot = row_slots.clamp(min=0)
    xa = torch.einsum("tk,trk->tr", x.double(), a.double()[slot]) * use[:, None]
    deltas = [torch.einsum("tr,tnr->tn", xa[:, i * rank:(i + 1) * rank], b.double()[slot])
              for i, b in enumerate(bs)]
    return xa, y.double() + torch.cat(deltas, dim=1) * use[:, None]


def apply_lora(y, x, a, bs, starts, slots, max_seg_len, shrink, expand):
    """One LoRA linear: shrink once, expand once per output slice; y in place."""
    xa = shrink(x, a, starts, slots, max_seg_len)
    rank = bs[0].shape[2]
    out_offset = 0
    for i, b in enumerate(bs):
        expand(y, xa, b, starts, slots, max_seg_len, i * rank, out_offset)
        out_offset += b.shape[1]
    return xa


def run_kernels(y, x, a, bs, starts, slots, max_seg_len):
    return apply_lora(y, x, a, bs, starts, slots, max_seg_len, lora.lora_shrink,
                      lora.lora_expand)


def run_reference(y, x, a, bs, starts, slots, max_seg_len):
    return apply_lora(y, x, a, bs, starts, slots, max_seg_len, lora.lora_shrink_reference,
                      lora.lora_expand_reference)


def tolerance(dtype) -> dict:
    """fp32: sums in another order; 16-bit: one unit in the last place of y."""
    return {torch.float32: dict(rtol=1e-5, atol=1e-5),
            torch.float16: dict(rtol=1e-3, atol=2e-3),
            torch.bfloat16: dict(rtol=1e-2, atol=2e-2)}[dtype]


def make_case(out_sizes, rank, dtype, seed, k=100):
    lens, slots = make_segments(seed)
    starts, seg_slots = seg_tensors(lens, slots)
    tokens = sum(lens) + PADDING_ROWS
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(tokens, k, generator=g).to(dtype).to(DEVICE)
    y = torch.randn(tokens, sum(out_sizes), generator=g).to(dtype).to(DEVICE)
    a, bs = make_weights(k, out_sizes, rank, dtype, seed + 2)
    return dict(lens=lens, slots=slots, starts=starts, seg_slots=seg_slots, x=x, y=y, a=a,
                bs=bs, max_seg_len=max(lens))


# K = 100 and N_i of 40/24/72 are off the 64-wide tiles; R = 8 is below tl.dot's 16
# (and n*R = 8 below the shrink's smallest column tile).
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rank, out_sizes", [(8, [40, 24, 72]), (8, [72]), (16, [72]),
                                             (64, [40, 24, 72])])
def test_lora_linear_equals_the_dense_per_row_oracle(rank, out_sizes, dtype):
    case = make_case(out_sizes, rank, dtype, seed=rank + len(out_sizes))
    row_slots = slot_of_each_row(case["lens"], case["slots"])
    want_xa, want_y = dense_oracle(case["y"], case["x"], case["a"], case["bs"], row_slots,
                                   rank)
    y, y_before = case["y"].clone(), case["y"].clone()
    xa = run_kernels(y, case["x"], case["a"], case["bs"], case["starts"], case["seg_slots"],
                     case["max_seg_len"])

    assert xa.dtype == torch.float32 and xa.shape == (y.shape[0], len(out_sizes) * rank)
    # The products of dtype values are exact in float32: xa is close for every dtype.
    torch.testing.assert_close(xa, want_xa.float(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(y.float(), want_y.to(dtype).float(), **tolerance(dtype))
    untouched = row_slots < 0
    assert untouched.sum() >= PADDING_ROWS + 1  # a -1 segment and the padding
    assert (xa[untouched] == 0).all()
    assert torch.equal(y[untouched], y_before[untouched])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", [7, 8, 9])  # three random batches
def test_kernels_equal_their_references(seed, dtype):
    """Same inputs through the Triton launches and the PyTorch loop: the fp32 xa, then
    y after every slice (one rounding each, so 16-bit results agree to one unit)."""
    case = make_case([40, 24, 72], 16, dtype, seed=seed)
    y_kernel, y_ref = case["y"].clone(), case["y"].clone()
    args = (case["x"], case["a"], case["bs"], case["starts"], case["seg_slots"],
            case["max_seg_len"])
    xa = run_kernels(y_kernel, *args)
    xa_ref = run_reference(y_ref, *args)
    torch.testing.assert_close(xa, xa_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y_kernel.float(), y_ref.float(), **tolerance(dtype))


def test_each_segment_reads_only_its_own_slot():
    """Changing one slot's A and B changes every row of that slot's segments and no
    other row; changing the unused slot 1 changes nothing."""
    case = make_case([40, 24, 72], 8, torch.float32, seed=11)
    row_slots = slot_of_each_row(case["lens"], case["slots"])
    args = (case["x"], case["a"], case["bs"], case["starts"], case["seg_slots"],
            case["max_seg_len"])
    y_base = case["y"].clone()
    xa_base = run_kernels(y_base, *args)

    for slot in (0, 2, 1):
        a = case["a"].clone()
        a[slot] += 0.5
        bs = [b.clone() for b in case["bs"]]
        for b in bs:
            b[slot] *= -2
        y = case["y"].clone()
        xa = run_kernels(y, case["x"], a, bs, *args[3:])
        mine = row_slots == slot
        assert torch.equal(xa[~mine], xa_base[~mine])
        assert torch.equal(y[~mine], y_base[~mine])
        if slot == 1:
            assert not mine.any()
        else:
            assert mine.any()
            assert (xa[mine] != xa_base[mine]).any(dim=1).all()
            assert (y[mine] != y_base[mine]).any(dim=1).all()


def test_a_decode_only_batch_and_a_strided_output():
    """One-token segments only (16-row tiles, max_seg_len 1), y a column window of a
    wider buffer (row stride != N), rank 8 over two slices."""
    lens, slots = [1] * 6, [2, -1, 0, 2, 3, 0]
    starts, seg_slots = seg_tensors(lens, slots)
    g = torch.Generator().manual_seed(5)
    tokens, k, out_sizes = 6 + PADDING_ROWS, 100, [40, 24]
    x = torch.randn(tokens, k, generator=g).to(DEVICE)
    wide = torch.randn(tokens, 80, generator=g).to(DEVICE)
    a, bs = make_weights(k, out_sizes, 8, torch.float32, seed=6)
    y = wide[:, 10:74]
    outside = torch.cat([wide[:, :10], wide[:, 74:]], dim=1).clone()
    want_xa, want_y = dense_oracle(y, x, a, bs, slot_of_each_row(lens, slots), 8)

    xa = run_kernels(y, x, a, bs, starts, seg_slots, 1)

    torch.testing.assert_close(xa, want_xa.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y, want_y.float(), rtol=1e-5, atol=1e-5)
    assert torch.equal(torch.cat([wide[:, :10], wide[:, 74:]], dim=1), outside)


def test_an_all_base_model_batch_leaves_y_alone():
    lens, slots = [3, 1], [-1, -1]
    starts, seg_slots = seg_tensors(lens, slots)
    x = torch.randn(4 + PADDING_ROWS, 32, device=DEVICE)
    y = torch.randn(4 + PADDING_ROWS, 16, device=DEVICE)
    y_before = y.clone()
    a, bs = make_weights(32, [16], 8, torch.float32, seed=1)
    xa = run_kernels(y, x, a, bs, starts, seg_slots, 3)
    assert (xa == 0).all() and torch.equal(y, y_before)


def test_mismatched_shapes_are_refused_clearly():
    starts, slots = seg_tensors([2], [0])
    x = torch.randn(2, 32, device=DEVICE)
    a, (b,) = make_weights(32, [16], 8, torch.float32, seed=1)
    with pytest.raises(ValueError, match="disagree"):
        lora.lora_shrink(x, a[:, :, :16], starts, slots, 2)
    with pytest.raises(ValueError, match="seg_starts"):
        lora.lora_shrink(x, a, starts[:1], slots, 2)
    xa = lora.lora_shrink(x, a, starts, slots, 2)
    y = torch.zeros(2, 16, device=DEVICE)
    with pytest.raises(ValueError, match="outside y"):
        lora.lora_expand(y, xa, b, starts, slots, 2, 0, 8)
    with pytest.raises(ValueError, match="outside xa"):
        lora.lora_expand(y, xa, b, starts, slots, 2, 4, 0)
    with pytest.raises(ValueError, match="float32"):
        lora.lora_expand(y, xa.half(), b, starts, slots, 2, 0, 0)


@pytest.mark.skipif(INTERPRETED, reason="CUDA graphs need a GPU")
def test_both_launches_replay_in_a_cuda_graph():
    """Captured once; new segments and slots copied into the same tensors before a
    replay give the new batch's result (nothing was read back at capture)."""
    dtype = torch.bfloat16
    case = make_case([40, 24, 72], 16, dtype, seed=3)
    # The next batch: the same number of segments and rows, other lengths and slots.
    lens, slots = case["lens"][::-1], case["slots"][1:] + case["slots"][:1]
    other = dict(case, lens=lens, slots=slots, x=torch.randn_like(case["x"]),
                 y=torch.randn_like(case["y"]))
    other["starts"], other["seg_slots"] = seg_tensors(lens, slots)
    max_seg_len = case["max_seg_len"]
    x, y, starts, seg_slots = (case["x"].clone(), case["y"].clone(), case["starts"].clone(),
                               case["seg_slots"].clone())
    run_kernels(y.clone(), x, case["a"], case["bs"], starts, seg_slots, max_seg_len)  # compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        xa = run_kernels(y, x, case["a"], case["bs"], starts, seg_slots, max_seg_len)
    for src in (case, other):
        x.copy_(src["x"])
        y.copy_(src["y"])
        starts.copy_(src["starts"])
        seg_slots.copy_(src["seg_slots"])
        graph.replay()
        want_y = src["y"].clone()
        want_xa = run_reference(want_y, src["x"], case["a"], case["bs"], src["starts"],
                                src["seg_slots"], max_seg_len)
        torch.testing.assert_close(xa, want_xa, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(y.float(), want_y.float(), **tolerance(dtype))


# Compiled ahead of time for CUDA targets in a process without the interpreter: catches
# what only the GPU lowering rejects (tl.dot shapes and dtypes, input_precision, shared
# memory) on a machine without a GPU. The sizes are the launchers' largest tiles; float32
# models (IEEE dots) for Hopper only, to keep the compile time down.
AOT_COMPILE = r"""
import sys
import triton
from llmserve.kernels.triton import lora
try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    ASTSource(fn=lora._shrink_kernel, signature={}, constexprs={})
except (ImportError, TypeError) as error:
    print("this triton has another compile API:", error)
    sys.exit(3)

PTRS = ("seg_starts_ptr", "seg_slots_ptr")
for dt, ieee, arches in (("fp32", True, (90,)), ("bf16", False, (80, 90))):
    shrink = dict(IEEE=ieee, BLOCK_M=64, BLOCK_N=lora.SHRINK_BLOCK_N,
                  BLOCK_K=lora.SHRINK_BLOCK_K)
    expand = dict(IEEE=ieee, BLOCK_M=64, BLOCK_N=lora.EXPAND_BLOCK_N, BLOCK_R=64)
    for fn, ptrs, consts in (
            (lora._shrink_kernel, dict(x_ptr="*" + dt, a_ptr="*" + dt, out_ptr="*fp32"),
             shrink),
            (lora._expand_kernel, dict(y_ptr="*" + dt, xa_ptr="*fp32", b_ptr="*" + dt),
             expand)):
        sig = {name: ptrs.get(name, "*i32" if name in PTRS else "i32")
               for name in fn.arg_names}
        sig.update({name: "constexpr" for name in consts})
        for arch in arches:
            src = ASTSource(fn=fn, signature=sig, constexprs=consts)
            kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32))
            assert kernel.asm["cubin"], (fn.__name__, dt, arch)
            print(fn.__name__, dt, arch, "shared", kernel.metadata.shared)
"""


@pytest.mark.skipif(not INTERPRETED, reason="on a GPU the other tests run the real thing")
def test_kernels_compile_for_ampere_and_hopper():
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    done = subprocess.run([sys.executable, "-c", AOT_COMPILE], env=env, capture_output=True,
                          text=True, timeout=600, cwd=Path(__file__).resolve().parents[2])
    if done.returncode == 3:
        pytest.skip(done.stdout.strip())
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("shared") == 6
