"""The CPU paged-attention path against the plain reference, on random block tables,
mixed prefill + decode batches, GQA groups and fp32/bf16 caches."""

from __future__ import annotations

import ctypes
import os
import random
import re
import shutil
import subprocess
import sys

import pytest
import torch

from llmserve.kernels.cpu import native as cpu_native
from llmserve.kernels.cpu.attention import make_cpu_plan, paged_attention_cpu
from tests.kernel_reference import unified_attention_ref

# Decodes in the compiled C kernel (native) and in torch: both must match the oracle.
# CI machines have a C compiler, so the native kernel must build there.
PATHS = [pytest.param(False, id="torch"), pytest.param(True, id="native")]


@pytest.fixture(autouse=True)
def _native_kernel_builds():
    assert cpu_native.cpu_library() is not None, "the CPU decode kernel did not build"


def random_batch(rng, seqs, heads, kv_heads, head_dim, block_size, dtype):
    """seqs: (query_len, seq_len) pairs. Blocks are scattered over a bigger pool."""
    num_blocks = sum(-(-s // block_size) for _, s in seqs) + 7
    pool = list(range(num_blocks))
    rng.shuffle(pool)
    tables, starts = [], [0]
    for q_len, seq_len in seqs:
        n = -(-seq_len // block_size)
        tables.append([pool.pop() for _ in range(n)])
        starts.append(starts[-1] + q_len)
    torch.manual_seed(rng.randrange(1 << 30))
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim).to(dtype)
    q = torch.randn(starts[-1], heads, head_dim).to(dtype)
    return q, k_cache, v_cache, tables, starts, [s for _, s in seqs]


@pytest.mark.parametrize("native", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 4, 32), (8, 2, 64), (9, 3, 64),
                                                       (6, 1, 128), (4, 2, 80)])
@pytest.mark.parametrize("block_size", [4, 16])
def test_mixed_batches_match_the_reference(native, dtype, heads, kv_heads, head_dim, block_size):
    rng = random.Random(heads * 100 + kv_heads + block_size)
    seqs = [(1, 37), (12, 12), (1, 1), (5, 70), (1, 523), (30, 95), (1, 16)]
    q, k_cache, v_cache, tables, starts, lens = random_batch(
        rng, seqs, heads, kv_heads, head_dim, block_size, dtype)
    plan = make_cpu_plan(starts, lens, tables, block_size, k_cache.shape[0], native)
    assert plan.native == native
    got = paged_attention_cpu(q, torch.stack([k_cache, v_cache]), plan, scale=head_dim ** -0.5)
    width = max(map(len, tables))
    table_tensor = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    want = unified_attention_ref(q.float(), k_cache.float(), v_cache.float(),
                                 torch.empty_like(q, dtype=torch.float32),
                                 query_start_loc=torch.tensor(starts),
                                 seq_lens=torch.tensor(lens), block_tables=table_tensor,
                                 max_query_len=30, max_seq_len=523, scale=head_dim ** -0.5)
    assert got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("native", PATHS)
def test_decode_only_and_prefill_only_batches(native):
    rng = random.Random(3)
    for seqs in ([(1, 5), (1, 300)], [(7, 7), (3, 40)]):
        q, k_cache, v_cache, tables, starts, lens = random_batch(rng, seqs, 4, 2, 16, 16,
                                                                 torch.float32)
        plan = make_cpu_plan(starts, lens, tables, 16, k_cache.shape[0], native)
        assert plan.decode_only == all(n == 1 for n, _ in seqs)
        got = paged_attention_cpu(q, torch.stack([k_cache, v_cache]), plan, scale=0.25)
        width = max(map(len, tables))
        want = unified_attention_ref(
            q, k_cache, v_cache, torch.empty_like(q), query_start_loc=torch.tensor(starts),
            seq_lens=torch.tensor(lens),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
            max_query_len=7, max_seq_len=300, scale=0.25)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_short_prefill_chunks_attend_row_by_row_in_c(dtype, monkeypatch):
    """Native plans give each token of a prefill chunk with a short context its own
    query row over its causal prefix (cached prefix included), and leave long contexts
    to SDPA (a long chunk, or a short chunk after a long cached prefix): both match the
    reference, in one batch with decodes."""
    from llmserve.kernels.cpu import attention as cpu_attention
    monkeypatch.setattr(cpu_attention, "MAX_ROWWISE_CONTEXT", 40)
    rng = random.Random(11)
    seqs = [(1, 30), (8, 8), (5, 40), (45, 45), (9, 50)]  # the last two: SDPA
    q, k_cache, v_cache, tables, starts, lens = random_batch(rng, seqs, 9, 3, 64, 16, dtype)
    plan = make_cpu_plan(starts, lens, tables, 16, k_cache.shape[0], native=True)
    assert plan.native and not plan.decode_only
    assert plan.decode_q_rows.tolist() == [0, *range(1, 9), *range(9, 14)]
    assert plan.decode_seq_lens.tolist() == [30, *range(1, 9), *range(36, 41)]
    assert [(start, end) for start, end, *_ in plan.prefills] == [(14, 59), (59, 68)]
    got = paged_attention_cpu(q, torch.stack([k_cache, v_cache]), plan, scale=0.125)
    width = max(map(len, tables))
    want = unified_attention_ref(
        q.float(), k_cache.float(), v_cache.float(), torch.empty_like(q, dtype=torch.float32),
        query_start_loc=torch.tensor(starts), seq_lens=torch.tensor(lens),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        max_query_len=45, max_seq_len=50, scale=0.125)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


def test_native_decode_reads_strided_queries():
    """q as the engine passes it: a view into the fused QKV projection's output."""
    rng = random.Random(5)
    seqs = [(1, 40), (1, 200), (1, 3)]
    _, k_cache, v_cache, tables, starts, lens = random_batch(rng, seqs, 8, 2, 64, 16,
                                                             torch.bfloat16)
    qkv = torch.randn(3, 8 + 2 * 2, 64).to(torch.bfloat16)
    q = qkv[:, :8]
    cache, blocks = torch.stack([k_cache, v_cache]), k_cache.shape[0]
    native = paged_attention_cpu(q, cache, make_cpu_plan(starts, lens, tables, 16, blocks, True),
                                 0.125)
    plain = paged_attention_cpu(q.contiguous(), cache,
                                make_cpu_plan(starts, lens, tables, 16, blocks), 0.125)
    torch.testing.assert_close(native.float(), plain.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (16, 2, 128)])
def test_native_decode_of_a_large_batch(dtype, heads, kv_heads, head_dim):
    """Enough sequences that the kernel gives each thread whole sequences (all their KV
    heads in turn, the first one prefetching for the others): the same attention."""
    rng = random.Random(heads + head_dim)
    seqs = [(1, rng.randrange(1, 120)) for _ in range(8 * torch.get_num_threads() + 3)]
    q, k_cache, v_cache, tables, starts, lens = random_batch(rng, seqs, heads, kv_heads,
                                                             head_dim, 16, dtype)
    cache, blocks = torch.stack([k_cache, v_cache]), k_cache.shape[0]
    native = paged_attention_cpu(q, cache, make_cpu_plan(starts, lens, tables, 16, blocks, True),
                                 head_dim ** -0.5)
    plain = paged_attention_cpu(q, cache, make_cpu_plan(starts, lens, tables, 16, blocks),
                                head_dim ** -0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(native.float(), plain.float(), atol=tol, rtol=tol)


def test_whole_sequence_mode_with_empty_and_uneven_contexts():
    """Enough sequences for the claim-ahead mode (each thread takes whole sequences and
    prefetches the next one's rows): contexts of very different lengths (a short one
    followed by a long one, whose lookahead stops partway) and empty contexts (a
    caller's padding rows: zeros) all come out right."""
    rng = random.Random(21)
    lens = [3, 400, 0, 17, 1, 250, 0, 90] * 2 + [33]
    seqs = [(1, max(n, 1)) for n in lens]
    q, k_cache, v_cache, tables, starts, _ = random_batch(rng, seqs, 9, 3, 64, 16,
                                                         torch.bfloat16)
    cache, blocks = torch.stack([k_cache, v_cache]), k_cache.shape[0]
    plan = make_cpu_plan(starts, [max(n, 1) for n in lens], tables, 16, blocks, True)
    out = torch.full_like(q, 7.0)
    cpu_native.paged_decode(q, out, cache, plan.decode_q_rows, plan.decode_tables,
                            torch.tensor(lens, dtype=torch.int32), 0.125)
    plain = paged_attention_cpu(q, cache, make_cpu_plan(starts, [max(n, 1) for n in lens],
                                                        tables, 16, blocks), 0.125)
    for i, n in enumerate(lens):
        if n == 0:
            assert torch.equal(out[i], torch.zeros_like(out[i]))
        else:
            torch.testing.assert_close(out[i].float(), plain[i].float(), atol=2e-2, rtol=2e-2)


AVX2_CHECK = """
import random, torch
from llmserve.kernels.cpu import native as cpu_native
from llmserve.kernels.cpu.attention import make_cpu_plan, paged_attention_cpu
assert "-march=haswell" in cpu_native._march()
assert cpu_native.cpu_library() is not None
rng = random.Random(1)
num_blocks, tables = 64, [rng.sample(range(64), 20) for _ in range(4)]
lens = [300, 17, 1, 250]
starts = [0, 1, 2, 3, 4]
# GQA groups 4, 3, 1, 6, 7 and 8, both head sizes of the fast path: float32, and bf16,
# whose scores and value passes have AVX2 code of their own
for dtype in (torch.float32, torch.bfloat16):
    worst = 0.0
    for heads, kv_heads, head_dim in ((8, 2, 64), (9, 3, 64), (4, 4, 64), (6, 1, 128),
                                      (14, 2, 64), (8, 1, 128)):
        cache = torch.randn(2, num_blocks, 16, kv_heads, head_dim).to(dtype)
        q = torch.randn(4, heads, head_dim).to(dtype)
        native = paged_attention_cpu(q, cache, make_cpu_plan(starts, lens, tables, 16, 64, True),
                                     head_dim ** -0.5)
        plain = paged_attention_cpu(q, cache, make_cpu_plan(starts, lens, tables, 16, 64),
                                    head_dim ** -0.5)
        worst = max(worst, (native.float() - plain.float()).abs().max().item())
    print(worst)
"""


def test_the_avx2_build_is_what_an_avx2_machine_gets():
    """ATEN_CPU_CAPABILITY=avx2 (how CI acts as an AVX2-only machine) builds the
    kernel for AVX2 + FMA, and it computes the same attention, float32 and bf16."""
    env = dict(os.environ, ATEN_CPU_CAPABILITY="avx2")
    out = subprocess.run([sys.executable, "-c", AVX2_CHECK], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    f32, bf16 = map(float, out.stdout.strip().splitlines()[-2:])
    assert f32 < 1e-5
    assert bf16 <= 2 ** -6  # a bf16 rounding of outputs below 2 in size


@pytest.mark.parametrize("broken", ["CC names no program", "no cc on PATH"])
def test_without_a_compiler_decodes_fall_back_to_torch(tmp_path, broken):
    check = ("from llmserve.kernels.cpu import native as cpu_native\n"
             "print(cpu_native.cpu_library() is None)\n")
    env = {k: v for k, v in os.environ.items() if k != "CC"}
    if broken == "CC names no program":
        env["CC"] = str(tmp_path / "no-such-cc")
    else:
        env["PATH"] = str(tmp_path)  # an empty folder: no cc, no gcc
    out = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"
    assert "torch path" in out.stderr  # the warning says what happens instead


def header_signatures() -> dict[str, list]:
    """kernels.h's prototypes as ctypes argument types (the header's conventions: every
    entry point returns int; parameters are pointers, int, int64_t or float)."""
    text = cpu_native.HEADERS[0].read_text()
    ctype = {"int": ctypes.c_int, "int64_t": ctypes.c_int64, "float": ctypes.c_float}
    signatures = {}
    for name, params in re.findall(r"^int (\w+)\(([^)]*)\);", text, flags=re.M):
        types = [] if params.strip() == "void" else [
            ctypes.c_void_p if "*" in p else ctype[p.split()[0]] for p in params.split(",")]
        signatures[name] = types
    return signatures


def test_the_ctypes_table_is_the_header():
    """ctypes cannot see the C types: SIGNATURES must say what kernels.h declares (and
    the compiler holds the definitions to kernels.h)."""
    assert header_signatures() == cpu_native.SIGNATURES


@pytest.mark.skipif(shutil.which("nm") is None, reason="needs binutils' nm")
def test_the_header_declares_every_function_the_library_exports():
    lib = cpu_native.cpu_library()
    out = subprocess.run(["nm", "-D", "--defined-only", lib._name], capture_output=True,
                         text=True, check=True).stdout
    exported = {line.split()[2] for line in out.splitlines() if line.split()[1] == "T"}
    assert exported == set(header_signatures())


def test_the_cpu_engine_decodes_with_the_native_kernel(tiny_llama):
    from llmserve.config import EngineConfig
    from llmserve.engine.llm_engine import LLMEngine
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), kv_cache_memory=1 << 22))
    assert engine.runner.c_attention
    engine.shutdown()


def test_native_decode_handles_caches_past_2_31_elements():
    """Offsets are 64-bit: a cache of more than 2^31 elements, read near its end (the
    untouched pages cost no memory)."""
    num_blocks, block_size, kv_heads, head_dim = (1 << 16) + 8, 16, 8, 128  # > 2^31 elements
    cache = torch.empty(2, num_blocks, block_size, kv_heads, head_dim, dtype=torch.bfloat16)
    tables = [[num_blocks - 3, num_blocks - 1]]
    k = torch.randn(32, kv_heads, head_dim).to(torch.bfloat16)
    for i, block in enumerate(tables[0]):
        cache[:, block] = torch.stack([k[i * 16:(i + 1) * 16], -k[i * 16:(i + 1) * 16]])
    q = torch.randn(1, 16, head_dim).to(torch.bfloat16)
    native = paged_attention_cpu(q, cache, make_cpu_plan([0, 1], [30], tables, block_size,
                                                         num_blocks, True), 0.1)
    plain = paged_attention_cpu(q, cache, make_cpu_plan([0, 1], [30], tables, block_size,
                                                        num_blocks), 0.1)
    assert cache.numel() > 1 << 31
    torch.testing.assert_close(native.float(), plain.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (8, 2, 128), (4, 4, 80)])
def test_rope_and_cache_is_bit_exact_with_the_torch_path(dtype, heads, kv_heads, head_dim):
    """Rotary embedding + the K/V store in C: the same bits as apply_rotary + write_kv
    (so fp32 outputs stay token-exact with transformers)."""
    from llmserve.kernels.cpu.attention import write_kv
    from llmserve.kernels.cpu.native import rope_and_cache
    from llmserve.model_executor.models.llama import apply_rotary
    torch.manual_seed(heads + head_dim)
    tokens, num_blocks, block_size = 11, 9, 4
    qkv = torch.randn(tokens, heads + 2 * kv_heads, head_dim).to(dtype)
    angles = torch.rand(tokens, head_dim // 2) * 100
    cos, sin = angles.cos().unsqueeze(1), angles.sin().unsqueeze(1)
    slots = torch.randperm(num_blocks * block_size)[:tokens]
    cache_c = torch.randn(2, num_blocks, block_size, kv_heads, head_dim).to(dtype)
    cache_t = cache_c.clone()
    q_c = rope_and_cache(qkv, cos, sin, cache_c, slots, heads)
    qk = apply_rotary(qkv[:, :heads + kv_heads], cos, sin)
    q_t, k_t = qk.split([heads, kv_heads], dim=1)
    write_kv(k_t, qkv[:, heads + kv_heads:], cache_t, slots)
    assert torch.equal(q_c, q_t)
    assert torch.equal(cache_c, cache_t)


def test_add_rms_norm_matches_hugging_face_in_bf16():
    """The decoder's residual add + RMSNorm in C, against transformers' LlamaRMSNorm
    formula (float32 statistics, normalised rows rounded to bf16, times the weight)."""
    from llmserve.kernels.cpu.native import add_rms_norm
    torch.manual_seed(0)
    x, delta = (torch.randn(13, 576).to(torch.bfloat16) for _ in range(2))
    weight = (torch.rand(576) + 0.5).to(torch.bfloat16)

    def hf(h):
        h32 = h.float()
        h32 = h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + 1e-5)
        return weight * h32.to(torch.bfloat16)

    residual, normed = add_rms_norm(x, weight, 1e-5, delta)
    assert torch.equal(residual, x + delta)  # the same rounding as torch's add
    torch.testing.assert_close(normed.float(), hf(x + delta).float(), atol=0, rtol=1e-2)
    same, plain = add_rms_norm(x, weight, 1e-5)
    assert same is x
    torch.testing.assert_close(plain.float(), hf(x).float(), atol=0, rtol=1e-2)
    # a broken normalisation (no eps, wrong mean) would be far off
    assert (plain.float() - hf(x).float()).abs().max() < 0.05


# --- the torch backend on another device (issue 27: on CUDA the plan was built on the CPU)
# The meta device stands in for CUDA here: it refuses index and mask tensors on another
# device exactly as CUDA does ("Tensor on device cpu is not on the expected device meta").
META = torch.device("meta")
MIXED_STEP = dict(query_start=[0, 1, 13, 14, 19], seq_lens=[37, 12, 1, 70],
                  block_tables=[[1, 2, 3], [4], [5], [6, 7, 8, 9, 10]])


def plan_tensors(plan) -> list[torch.Tensor]:
    """Every tensor a plan holds, its prefill chunks' included."""
    found = [v for v in vars(plan).values() if isinstance(v, torch.Tensor)]
    found += [t for chunk in plan.prefills for t in chunk if isinstance(t, torch.Tensor)]
    return found


def test_the_torch_path_plans_and_attends_on_the_cache_device():
    """Decodes, a chunk without a cached prefix and one after a cached prefix (a mask):
    every index and mask lands on the requested device, and attention runs there."""
    s = MIXED_STEP
    plan = make_cpu_plan(s["query_start"], s["seq_lens"], s["block_tables"], 16, 11,
                         device=META)
    tensors = plan_tensors(plan)
    assert len(tensors) == 7 and {t.device for t in tensors} == {META}
    q = torch.empty(19, 4, 16, device=META)
    out = paged_attention_cpu(q, torch.empty(2, 11, 16, 2, 16, device=META), plan, 0.25)
    assert out.device == META and out.shape == q.shape
    # a sliding-window layer's masks, derived from the plan, land there too
    out = paged_attention_cpu(q, torch.empty(2, 11, 16, 2, 16, device=META), plan, 0.25,
                              window=8)
    _, decode_mask, prefill_masks = plan.windowed(8)
    assert out.device == META and {m.device for m in [decode_mask, *prefill_masks]} == {META}
    with pytest.raises(ValueError, match="CPU caches only"):
        make_cpu_plan(s["query_start"], s["seq_lens"], s["block_tables"], 16, 11,
                      native=True, device=META)


def test_both_step_builders_plan_on_their_device(tiny_llama):
    """The model runner's build and the fast path's StepBuilder (the one CUDA engines
    with --pinned-staging / --device-block-tables use) hand make_cpu_plan their device.
    A real CPU engine on the torch backend, its runner then pointed at the meta device."""
    from llmserve.config import EngineConfig
    from llmserve.engine.llm_engine import LLMEngine
    from llmserve.worker.step_buffers import StepBuilder
    from llmserve.worker.step_inputs import StepInputs
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), attention_backend="torch",
                                    kv_cache_memory=1 << 22))
    runner = engine.runner
    s = MIXED_STEP
    inputs = StepInputs(input_ids=list(range(19)), positions=list(range(19)),
                        slots=list(range(19)), query_start=s["query_start"],
                        seq_lens=s["seq_lens"], block_tables=s["block_tables"],
                        sample_rows=[0, 12, 13, 18], max_query_len=12)
    runner.device, runner.c_attention = META, False  # the C kernel is CPU-only
    _, _, meta = runner.build(inputs)
    assert {t.device for t in plan_tensors(meta.plan)} == {META}
    builder = StepBuilder(META, runner.block_size, runner.num_blocks, use_triton=False,
                          staging=False, block_tables=None)
    _, _, meta, _ = builder.build(inputs, seq_ids=[0, 1, 2, 3])
    assert {t.device for t in plan_tensors(meta.plan)} == {META}
    engine.shutdown()
