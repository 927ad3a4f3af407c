"""benchmarks/serving/disaggregation.py reports its fields (no engines, no timing thresholds:
the statistics on synthetic records and metric scrapes)."""

from __future__ import annotations

import pytest

from tests.benchmark_script import benchmark_script


@pytest.fixture(scope="module")
def bench():
    with benchmark_script("serving/disaggregation") as mod:
        yield mod


def fake_run(bench, gap: float) -> dict:
    recs = []
    for i in range(4):
        r = bench.Rec("chat", 1.0 + i, ok=True)
        r.stamps = [r.start + 0.5 + gap * k for k in range(20)]
        recs.append(r)
    long = bench.Rec("long", 3.0, ok=True)
    long.stamps = [9.0, 9.1]
    recs.append(long)
    return {"recs": recs, "window": (2.0, 12.0)}


def metrics(imports: float, seconds: float, tokens: float, ttft: float, queue: float) -> dict:
    return {"decode": {"llmserve:kv_transfer_seconds_count": imports,
                       "llmserve:kv_transfer_seconds_sum": seconds,
                       "llmserve:kv_transfer_tokens_total": tokens},
            "prefill": {"vllm:time_to_first_token_seconds_count": imports,
                        "vllm:time_to_first_token_seconds_sum": ttft,
                        "vllm:request_queue_time_seconds_count": imports,
                        "vllm:request_queue_time_seconds_sum": queue}}


def test_summary_ratios_and_transfer_fields(bench, tmp_path):
    a = bench.summarize(fake_run(bench, 0.2))
    b = bench.summarize(fake_run(bench, 0.1))
    for s in (a, b):
        assert {"chat_itl_ms", "chat_ttft_ms", "long_ttft_ms", "output_tokens_per_s"} <= set(s)
        assert s["chat_itl_ms"]["n"] > 0 and s["long_ttft_ms"]["n"] == 1
        assert s["chat_itl_ms"]["p50"] is not None and s["chat_itl_ms"]["p99"] is not None
    t = bench.transfer_stats(metrics(0, 0, 0, 0, 0), metrics(2, 0.2, 8000, 20, 2), 23040)
    assert {"gb_per_s", "ms_per_1k_tokens", "per_import_ms", "prefill_ms",
            "transfer_of_prefill"} <= set(t)
    assert t["tokens_per_import"] == 4000
    b["transfer_idle"] = t
    rt = bench.ratios(a, b)
    assert set(bench.TARGETS) <= set(rt)
    assert all(rt[k] is not None for k in bench.TARGETS)
    a["idle_long_ttft_ms"] = b["idle_long_ttft_ms"] = []
    a.update(engines={}, transports={}), b.update(engines={}, transports={})
    bench.print_summary("B", b)
    bench.print_ratios(rt)
