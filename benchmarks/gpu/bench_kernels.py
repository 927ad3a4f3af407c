"""GPU kernel benchmark, prepared to run in one short call on a lent GPU.

1. Decode attention (bf16) over a sweep of batch sizes and context lengths:
   achieved bytes/s against the HBM roofline, and time against PyTorch SDPA on the
   same K/V laid out contiguously (the ratio is printed).
   Then the split rule's comparison at batch 1/32/128 x 2k and 1/32 x 8k (Llama-3-8B's
   attention shape): the split-KV rule before (``legacy``: no split at >= 128
   sequences x KV heads) and now (``occupancy``: enough programs for the SMs), each
   with the 16-row decode tile of before (``padded``) and the group-sized one (``fit``).
2. A mixed prefill + decode batch.
3. bf16 correctness of the Triton kernels against the PyTorch reference.
4. End-to-end decode throughput of a ~1B-parameter Llama-shaped model with random
   weights (bf16, ``lib/random_checkpoints.py``, or ``--e2e-model``) at batch 64 and 256.
5. The fused decode-step kernels (add+RMSNorm, rotary+KV write, SiLU x up) against the
   torch ops they replace, SmolLM2-135M and Llama-8B shapes at batch 1, 32 and 128.

Kernel times come from CUDA events (``triton.testing.do_bench``: median, L2 flushed
between calls), so they include the host's launch overhead whenever that is longer
than the kernel; the decode sweep also times the Triton call replayed from a CUDA
graph (``do_bench_cudagraph``), which is the kernels alone (with a warm L2, so small
shapes can exceed the HBM roofline). The e2e numbers are wall clock by nature (the
whole engine step).

The JSON and markdown are rewritten after every section, and a section that fails
records its error (``{"error": ...}``) and the next one runs, so a late crash or a
timeout keeps what was measured before it; a decode shape that fails (say, out of
memory) records its error in its row. Exit status 1 when a section or shape failed.
On a machine without CUDA it says so and exits 0 (``--smoke`` runs a tiny version
on CPU through Triton's interpreter, timed by the host clock, to check the script).

    python benchmarks/gpu/bench_kernels.py --out benchmarks/results/kernels
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

if not __package__:  # run as a file: the repository root, so that `benchmarks` imports
    sys.path.append(str(Path(__file__).resolve().parents[2]))

from benchmarks.lib.paths import RESULTS

HBM_BYTES_PER_S = 4.8e12  # H200 HBM3e peak
SECTIONS = ("decode", "decode_rules", "mixed", "correctness", "e2e", "fused")


def bench(fn, device) -> float:
    """Median seconds per call: CUDA events on a GPU, the host clock on CPU (smoke)."""
    if device == "cuda":
        from triton.testing import do_bench
        return do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e-3
    fn()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[1]


def bench_graph(fn, device) -> float | None:
    """Median seconds per call replayed from a CUDA graph (no launch overhead)."""
    if device != "cuda":
        return None
    from triton.testing import do_bench_cudagraph
    return do_bench_cudagraph(fn, rep=20, return_mode="median") * 1e-3


def make_decode_batch(batch, ctx, heads, kv_heads, head_dim, block_size, dtype, device):
    import torch
    blocks_per_seq = -(-ctx // block_size)
    num_blocks = batch * blocks_per_seq + 1
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, dtype=dtype, device=device)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(num_blocks - 1, device=device)[:batch * blocks_per_seq]
    tables = tables.view(batch, blocks_per_seq).int()
    q = torch.randn(batch, heads, head_dim, dtype=dtype, device=device)
    return dict(q=q, k_cache=k_cache, v_cache=v_cache,
                query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=device),
                seq_lens=torch.full((batch,), ctx, dtype=torch.int32, device=device),
                block_tables=tables, max_query_len=1, max_seq_len=ctx,
                scale=head_dim ** -0.5)


def decode_sweep(args, device, dtype) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from llmserve.kernels.triton.attention import _choose_splits, unified_attention
    rows = []
    heads, kv_heads, head_dim, block_size = 32, 8, 128, 16
    for batch in args.batches:
        for ctx in args.contexts:
            row = {"batch": batch, "context": ctx,
                   "num_splits": _choose_splits(batch, kv_heads, ctx, block_size)}
            rows.append(row)
            b = k = v = None
            try:  # one shape failing (e.g. out of memory) leaves the others
                b = make_decode_batch(batch, ctx, heads, kv_heads, head_dim, block_size, dtype,
                                      device)
                out = torch.empty_like(b["q"])
                call = (lambda b=b, out=out: unified_attention(out=out, **b))
                t = bench(call, device)
                kv_bytes = 2 * kv_heads * head_dim * b["k_cache"].element_size() * batch * ctx
                row.update(triton_us=t * 1e6, bytes_per_s=kv_bytes / t,
                           hbm_fraction=kv_bytes / t / HBM_BYTES_PER_S)
                t_graph = bench_graph(call, device)
                row["triton_graph_us"] = t_graph * 1e6 if t_graph else None
                # Baseline: SDPA over the same keys laid out contiguously per sequence.
                k = b["k_cache"][b["block_tables"].long()].flatten(1, 2)[:, :ctx].transpose(1, 2)
                v = b["v_cache"][b["block_tables"].long()].flatten(1, 2)[:, :ctx].transpose(1, 2)
                qs = b["q"].unsqueeze(2)
                t_sdpa = bench(lambda qs=qs, k=k, v=v: F.scaled_dot_product_attention(
                    qs, k, v, enable_gqa=True), device)
                row.update(sdpa_contiguous_us=t_sdpa * 1e6, triton_over_sdpa=t / t_sdpa)
                graph = f"{row['triton_graph_us']:9.1f}" if t_graph else "        -"
                print(f"decode B={batch:4} ctx={ctx:6} splits={row['num_splits']:2}: "
                      f"{row['triton_us']:9.1f} us (graph {graph} us)  "
                      f"{row['bytes_per_s'] / 1e12:6.2f} TB/s "
                      f"({100 * row['hbm_fraction']:5.1f}% HBM)  "
                      f"SDPA {row['sdpa_contiguous_us']:9.1f} us  "
                      f"ratio {row['triton_over_sdpa']:.2f}", flush=True)
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {e}"
                print(f"decode B={batch:4} ctx={ctx:6}: FAILED {row['error']}", flush=True)
            finally:
                del b, k, v
                if device == "cuda":
                    torch.cuda.empty_cache()
    return rows


def legacy_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, block_size: int) -> int:
    """The split-KV rule before the occupancy rule, compared below (the kernel takes its
    count as ``num_splits``): split only below 128 sequences x KV heads, aiming at ~256
    programs whatever the GPU (at batch 32 of an 8-KV-head model that is 256 programs,
    under two per SM of an H200)."""
    programs = num_seqs * num_kv_heads
    if programs >= 128 or max_seq_len < 512:
        return 1
    wanted = 1 << (256 // programs - 1).bit_length()  # the power of two at or above
    top = min(wanted, 32, max_seq_len // (4 * block_size))  # MAX_SPLITS: 32
    return 1 << (max(1, top).bit_length() - 1)  # the power of two at or below


# (split rule, decode tile) before and after the occupancy rule, and each change alone.
DECODE_VARIANTS = (("legacy", "padded"), ("occupancy", "padded"), ("legacy", "fit"),
                   ("occupancy", "fit"))
DECODE_RULE_SHAPES = ((1, 2048), (32, 2048), (128, 2048), (1, 8192), (32, 8192))


def decode_rules(args, device, dtype) -> list[dict]:
    """Decode attention time per variant of DECODE_VARIANTS; bytes/s = the K/V bytes one
    step reads / its time, against the H200's 4.8 TB/s. Smoke: a 2-head model and one
    short context, which no rule splits (the interpreter runs each program in Python;
    tests/kernels/test_kernels.py checks the split path)."""
    import torch

    from llmserve.kernels.triton.attention import _choose_splits, num_sms, unified_attention
    heads, kv_heads, head_dim, block_size = (2, 1, 32, 16) if args.smoke else (32, 8, 128, 16)
    shapes = ((2, 64),) if args.smoke else DECODE_RULE_SHAPES
    rows = []
    for batch, ctx in shapes:
        b = make_decode_batch(batch, ctx, heads, kv_heads, head_dim, block_size, dtype, device)
        out = torch.empty_like(b["q"])
        kv_bytes = 2 * kv_heads * head_dim * b["k_cache"].element_size() * batch * ctx
        for rule, tile in DECODE_VARIANTS:
            splits = (legacy_splits(batch, kv_heads, ctx, block_size) if rule == "legacy"
                      else _choose_splits(batch, kv_heads, ctx, block_size, num_sms(device)))
            row = {"batch": batch, "context": ctx, "split_rule": rule, "decode_tile": tile,
                   "num_splits": splits}
            rows.append(row)
            try:
                call = (lambda splits=splits, tile=tile, b=b, out=out: unified_attention(
                    out=out, num_splits=splits, decode_tile=tile, **b))
                t = bench(call, device)
                t_graph = bench_graph(call, device)
                row.update(us=t * 1e6, graph_us=t_graph * 1e6 if t_graph else None,
                           bytes_per_s=kv_bytes / (t_graph or t),
                           hbm_fraction=kv_bytes / (t_graph or t) / HBM_BYTES_PER_S)
                graph = f"{row['graph_us']:9.1f}" if t_graph else "        -"
                print(f"decode B={batch:4} ctx={ctx:5} {rule:9} {tile:6} "
                      f"splits={row['num_splits']:2}: {row['us']:9.1f} us (graph {graph} us) "
                      f"{row['bytes_per_s'] / 1e12:6.2f} TB/s "
                      f"({100 * row['hbm_fraction']:5.1f}% HBM)", flush=True)
            except Exception as e:  # noqa: BLE001 - one variant failing leaves the others
                row["error"] = f"{type(e).__name__}: {e}"
                print(f"decode B={batch:4} ctx={ctx:5} {rule} {tile}: FAILED {row['error']}",
                      flush=True)
        del b, out
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def _decode_rules_markdown(rows: list[dict]) -> list[str]:
    """One line per shape: each variant's time (graph replay where measured) and the
    speed-up of now (occupancy, fit) over before (legacy, padded)."""
    names = [f"{r} / {t}" for r, t in DECODE_VARIANTS]
    lines = ["", "Decode attention, split rule / decode tile (µs, CUDA-graph replay on a "
             "GPU; TB/s and % of 4.8 TB/s for the new rule):", "",
             "| batch | context | " + " | ".join(names) + " | TB/s | % HBM | before/now |",
             "|---|---|" + "---|" * (len(names) + 3)]
    shapes = dict.fromkeys((r["batch"], r["context"]) for r in rows)
    for batch, ctx in shapes:
        by = {(r["split_rule"], r["decode_tile"]): r for r in rows
              if (r["batch"], r["context"]) == (batch, ctx)}
        cells, times = [], {}
        for v in DECODE_VARIANTS:
            r = by.get(v, {})
            t = r.get("graph_us") or r.get("us")
            times[v] = t
            cells.append(f"{t:.1f} ({r['num_splits']} splits)" if t else
                         r.get("error", "-"))
        now, before = by.get(DECODE_VARIANTS[-1], {}), times[DECODE_VARIANTS[0]]
        tail = (f"{now['bytes_per_s'] / 1e12:.2f} | {100 * now['hbm_fraction']:.1f} | "
                f"{before / times[DECODE_VARIANTS[-1]]:.2f}x"
                if "bytes_per_s" in now and before else "- | - | -")
        lines.append(f"| {batch} | {ctx} | " + " | ".join(cells) + f" | {tail} |")
    return lines


def correctness(device, dtype) -> list[dict]:
    import torch

    from llmserve.kernels.triton.attention import unified_attention
    from tests.kernel_reference import unified_attention_ref
    results = []
    all_heads = ((4, 4), (8, 2), (6, 1), (9, 3))
    cases = {"mixed": ([(1, 1328), (5, 18), (129, 463)], all_heads, (None,)),
             "decode": ([(1, 523), (1, 37), (1, 2011)], all_heads, (None, 4)),
             # default splits for one 576-token decode of Llama-3-8B's shape
             "decode576": ([(1, 576)], ((32, 8),), (None,))}
    for name, (shapes, head_configs, split_options) in cases.items():
        for heads in head_configs:
            for splits in split_options:
                b = random_batch(shapes, *heads, 128, 16, dtype, device)
                out = torch.empty_like(b["q"])
                unified_attention(out=out, num_splits=splits, **b)
                ref = unified_attention_ref(out=torch.empty_like(b["q"], dtype=torch.float32),
                                            **{**b, "q": b["q"].float(),
                                               "k_cache": b["k_cache"].float(),
                                               "v_cache": b["v_cache"].float()})
                err = (out.float() - ref).abs().max().item()
                results.append({"case": name, "heads": heads, "num_splits": splits,
                                "max_abs_err": err, "ok": err < 1.5e-2})
                print(f"bf16 {name:9} heads={heads} splits={splits}: max err {err:.2e} "
                      f"{'ok' if err < 1.5e-2 else 'FAIL'}", flush=True)
    return results


def random_batch(shapes, heads, kv_heads, head_dim, block_size, dtype, device):
    import torch
    max_blocks = max(-(-s // block_size) for _, s in shapes)
    total = sum(-(-s // block_size) for _, s in shapes)
    k_cache = torch.randn(total + 8, block_size, kv_heads, head_dim, device=device).to(dtype)
    v_cache = torch.randn_like(k_cache)
    perm = torch.randperm(total + 8, device=device)
    tables = torch.zeros(len(shapes), max_blocks, dtype=torch.int32, device=device)
    used, qsl = 0, [0]
    for i, (q, s) in enumerate(shapes):
        n = -(-s // block_size)
        tables[i, :n] = perm[used:used + n].int()
        used += n
        qsl.append(qsl[-1] + q)
    return dict(q=torch.randn(qsl[-1], heads, head_dim, device=device).to(dtype),
                k_cache=k_cache, v_cache=v_cache,
                query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
                seq_lens=torch.tensor([s for _, s in shapes], dtype=torch.int32, device=device),
                block_tables=tables, max_query_len=max(q for q, _ in shapes),
                max_seq_len=max(s for _, s in shapes), scale=head_dim ** -0.5)


def mixed(device, dtype) -> dict:
    """One prefill chunk of 512 tokens at context 2048 beside 63 decodes at 1024."""
    import torch

    from llmserve.kernels.triton.attention import unified_attention
    shapes = [(512, 2048)] + [(1, 1024)] * 63
    b = random_batch(shapes, 32, 8, 128, 16, dtype, device)
    out = torch.empty_like(b["q"])
    t = bench(lambda: unified_attention(out=out, **b), device)
    flops = sum(4 * q * s * 128 * 32 for q, s in shapes)
    print(f"mixed 512-token chunk + 63 decodes: {t * 1e6:.1f} us, "
          f"{flops / t / 1e12:.1f} TFLOP/s", flush=True)
    return {"shapes": "1x(512,2048) + 63x(1,1024)", "us": t * 1e6,
            "tflops": flops / t / 1e12}


def e2e_decode(args, device) -> list[dict]:
    from benchmarks.lib.random_checkpoints import write_random_llama
    from llmserve import LLM, SamplingParams
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = (Path(args.e2e_model) if args.e2e_model else
                write_random_llama(Path(tmp) / "llama", "tiny" if args.smoke else "llama-1b"))
        llm = LLM(str(path), dtype="bfloat16" if device == "cuda" else "float32",
                  max_num_seqs=max(args.e2e_batches), max_num_batched_tokens=8192)
        for batch in args.e2e_batches:
            prompts = [[100 + (i * 7 + j) % 30000 for j in range(128)] for i in range(batch)]
            params = SamplingParams(max_tokens=args.e2e_tokens, temperature=0, ignore_eos=True)
            llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True))
            _sync(device)
            t0 = time.perf_counter()
            llm.generate(prompts, params)
            _sync(device)
            wall = time.perf_counter() - t0
            rows.append({"batch": batch, "tokens_per_s": batch * args.e2e_tokens / wall,
                         "wall_s": wall})
            print(f"e2e decode B={batch}: {rows[-1]['tokens_per_s']:.0f} tokens/s "
                  f"({wall:.1f} s incl. prefill)", flush=True)
    return rows


def _sync(device) -> None:
    if device == "cuda":
        import torch
        torch.cuda.synchronize()


# Decoder shapes of the fused-ops section: (hidden, heads, kv heads, head_dim, intermediate).
FUSED_SHAPES = {"smollm2-135m": (576, 9, 3, 64, 1536), "llama-8b": (4096, 32, 8, 128, 14336)}


def fused_ops(args, device, dtype) -> list[dict]:
    """Each kernel of kernels/triton/fused.py against the torch ops it replaces on the
    default path (add then F.rms_norm; apply_rotary, split and the Triton KV write;
    split, silu, mul), at decode batches: time ratio, max difference, bytes/s."""
    rows = []
    for name, shape in FUSED_SHAPES.items():
        if args.smoke and name != "smollm2-135m":
            continue
        for batch in (1,) if args.smoke else (1, 32, 128):
            for op, (fast, slow, nbytes) in _fused_cases(shape, batch, device, dtype).items():
                row = {"model": name, "batch": batch, "op": op}
                rows.append(row)
                try:
                    row.update(_time_fused(fast, slow, nbytes, device))
                    hbm = (f"{100 * row['hbm_fraction']:5.1f}% HBM" if device == "cuda"
                           else "(interpreted: not a GPU number)")
                    print(f"fused {name:12} B={batch:4} {op:13}: {row['fused_us']:9.1f} us, "
                          f"torch {row['torch_us']:9.1f} us, ratio "
                          f"{row['fused_over_torch']:.2f}, {row['bytes_per_s'] / 1e9:8.1f} "
                          f"GB/s {hbm}, max diff {row['max_abs_diff']:.1e}", flush=True)
                except Exception as e:  # noqa: BLE001 - record it, measure the next
                    row["error"] = f"{type(e).__name__}: {e}"
                    print(f"fused {name} B={batch} {op}: FAILED {row['error']}", flush=True)
    return rows


def _fused_cases(shape, tokens, device, dtype) -> dict:
    """op -> (fused call, the torch ops it replaces, bytes the fused kernel moves)."""
    import torch
    import torch.nn.functional as F

    from llmserve.kernels.triton import fused
    from llmserve.kernels.triton.attention import write_kv_cache
    from llmserve.model_executor.models.llama import apply_rotary
    hidden, heads, kv_heads, head_dim, inter = shape
    elem = torch.tensor([], dtype=dtype).element_size()
    x = torch.randn(tokens, hidden, device=device, dtype=dtype)
    res = torch.randn_like(x)
    w = torch.rand(hidden, device=device, dtype=dtype)
    qkv = torch.randn(tokens, heads + 2 * kv_heads, head_dim, device=device, dtype=dtype)
    angle = torch.rand(tokens, 1, head_dim // 2, device=device) * 100
    cos, sin = angle.cos(), angle.sin()
    cache = torch.zeros(2, 4 * tokens + 4, 16, kv_heads, head_dim, device=device, dtype=dtype)
    slots = torch.randperm(cache.shape[1] * 16, device=device)[:tokens]
    gate_up = torch.randn(tokens, 2 * inter, device=device, dtype=dtype)

    def norm_torch():
        r = x + res
        return F.rms_norm(r, (hidden,), w, 1e-5), r

    def rope_torch():
        qk = apply_rotary(qkv[:, :heads + kv_heads], cos, sin)
        q, k = qk.split([heads, kv_heads], dim=1)
        write_kv_cache(k, qkv[:, heads + kv_heads:], cache[0], cache[1], slots)
        return q

    def silu_torch():
        gate, up = gate_up.split(inter, dim=-1)
        return F.silu(gate) * up

    qkv_bytes = qkv.numel() * elem  # read once, written once as q + k + v
    return {
        "add_rms_norm": (lambda: fused.add_rms_norm(x, res, w, 1e-5), norm_torch,
                         (4 * tokens + 1) * hidden * elem),
        "rope_write_kv": (lambda: fused.rope_and_write_kv(qkv, cos, sin, cache[0], cache[1],
                                                          slots, heads),
                          rope_torch, 2 * qkv_bytes + tokens * head_dim * 4),  # + cos, sin
        "silu_and_mul": (lambda: fused.silu_and_mul(gate_up, inter), silu_torch,
                         3 * tokens * inter * elem),
    }


def _time_fused(fast, slow, nbytes, device) -> dict:
    a, b = fast(), slow()
    a, b = (a[0], b[0]) if isinstance(a, tuple) else (a, b)
    t_fused, t_torch = bench(fast, device), bench(slow, device)
    return dict(fused_us=t_fused * 1e6, torch_us=t_torch * 1e6,
                fused_over_torch=t_fused / t_torch,
                max_abs_diff=(a.float() - b.float()).abs().max().item(),
                bytes_per_s=nbytes / t_fused,
                hbm_fraction=nbytes / t_fused / HBM_BYTES_PER_S if device == "cuda" else None)


def fused_markdown(rows: list[dict]) -> list[str]:
    lines = ["", "| model | batch | fused op | fused µs | torch µs | fused/torch | GB/s "
             "| % HBM | max diff |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r or "fused_us" not in r:
            lines.append(f"| {r['model']} | {r['batch']} | {r['op']} | "
                         f"{r.get('error', 'incomplete')} | | | | | |")
            continue
        hbm = f"{100 * r['hbm_fraction']:.1f}" if r["hbm_fraction"] is not None else "-"
        lines.append(f"| {r['model']} | {r['batch']} | {r['op']} | {r['fused_us']:.1f} | "
                     f"{r['torch_us']:.1f} | {r['fused_over_torch']:.2f} | "
                     f"{r['bytes_per_s'] / 1e9:.1f} | {hbm} | {r['max_abs_diff']:.1e} |")
    return lines


def markdown(report: dict) -> str:
    """The sections measured so far; a failed section shows its error."""
    def failed(name):
        sec = report.get(name)
        return isinstance(sec, dict) and ("error" in sec or "skipped" in sec)

    def note(name):
        sec = report[name]
        return f"{name}: {sec.get('error') or 'skipped (' + sec['skipped'] + ')'}"

    lines = [f"{report['device']}, torch {report['torch']}, triton {report['triton']}", ""]
    if "decode" in report:
        if failed("decode"):
            lines.append(note("decode"))
        else:
            lines += ["| batch | context | splits | Triton µs | graph µs | TB/s | % HBM "
                      "| SDPA (contiguous) µs | Triton/SDPA |",
                      "|---|---|---|---|---|---|---|---|---|"]
            for r in report["decode"]:
                if "error" in r or "sdpa_contiguous_us" not in r:
                    lines.append(f"| {r['batch']} | {r['context']} | {r['num_splits']} | "
                                 f"{r.get('error', 'incomplete')} | | | | | |")
                    continue
                graph = r.get("triton_graph_us")
                lines.append(f"| {r['batch']} | {r['context']} | {r['num_splits']} | "
                             f"{r['triton_us']:.1f} | {f'{graph:.1f}' if graph else '-'} | "
                             f"{r['bytes_per_s'] / 1e12:.2f} | {100 * r['hbm_fraction']:.1f} | "
                             f"{r['sdpa_contiguous_us']:.1f} | {r['triton_over_sdpa']:.2f} |")
    if "decode_rules" in report:
        lines += (["", note("decode_rules")] if failed("decode_rules") else
                  _decode_rules_markdown(report["decode_rules"]))
    if "mixed" in report:
        m = report["mixed"]
        lines += ["", note("mixed") if failed("mixed") else
                  f"Mixed batch {m['shapes']}: {m['us']:.1f} µs ({m['tflops']:.1f} TFLOP/s)"]
    if "correctness" in report:
        c = report["correctness"]
        lines += ["", note("correctness") if failed("correctness") else
                  f"bf16 correctness: {sum(x['ok'] for x in c)}/{len(c)} cases within 1.5e-2"]
    if "e2e" in report:
        if failed("e2e"):
            lines += ["", note("e2e")]
        else:
            lines += ["", "| e2e batch | tokens/s |", "|---|---|"]
            lines += [f"| {r['batch']} | {r['tokens_per_s']:.0f} |" for r in report["e2e"]]
    if "fused" in report:
        lines += ["", note("fused")] if failed("fused") else fused_markdown(report["fused"])
    return "\n".join(lines) + "\n"


def save(report: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2, default=str))
    out.with_suffix(".md").write_text(markdown(report))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(RESULTS / "kernels"),
                    help="path without suffix: writes OUT.json and OUT.md")
    ap.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192, 32768])
    ap.add_argument("--e2e-batches", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--e2e-tokens", type=int, default=128)
    ap.add_argument("--e2e-model", help="checkpoint directory for the e2e section "
                    "(default: write a random Llama-3.2-1B-shaped one)")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny sizes on CPU through Triton's interpreter")
    args = ap.parse_args()
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch
    import triton
    if not torch.cuda.is_available() and not args.smoke:
        print("CUDA is not available: the kernel benchmark needs a GPU; nothing measured.")
        return 0
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    if args.smoke:
        args.batches, args.contexts, args.e2e_batches, args.e2e_tokens = [2], [64], [2], 4

    out = Path(args.out)
    report = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu (smoke)",
              "torch": torch.__version__, "triton": triton.__version__,
              "timing": "cuda events (do_bench, median)" if device == "cuda" else "host clock",
              "failed_sections": [], "section_seconds": {}}
    runners = {"decode": lambda: decode_sweep(args, device, dtype),
               "decode_rules": lambda: decode_rules(args, device, dtype),
               "mixed": lambda: mixed(device, dtype),
               "correctness": lambda: correctness(device, dtype),
               "e2e": lambda: e2e_decode(args, device),
               "fused": lambda: fused_ops(args, device, dtype)}
    # In smoke mode these shapes would take minutes in the interpreter.
    smoke_skips = {"mixed", "correctness"} if args.smoke else set()
    for name in args.sections:
        t0 = time.perf_counter()
        if name in smoke_skips:
            report[name] = {"skipped": "smoke"}
        else:
            print(f"--- {name}", flush=True)
            try:
                report[name] = runners[name]()
            except Exception as e:  # noqa: BLE001 - record it and go on with the next
                traceback.print_exc()
                report[name] = {"error": f"{type(e).__name__}: {e}"}
                report["failed_sections"].append(name)
            if name in ("decode", "decode_rules", "fused") and isinstance(report[name], list):
                bad = sum("error" in r for r in report[name])
                if bad:
                    report["failed_sections"].append(f"{name} ({bad} shapes)")
            if device == "cuda":
                torch.cuda.empty_cache()
        report["section_seconds"][name] = round(time.perf_counter() - t0, 1)
        save(report, out)
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')}")
    if report["failed_sections"]:
        print(f"failed sections: {report['failed_sections']}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
