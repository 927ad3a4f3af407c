"""benchmarks/peers/vs_llamacpp.py's --rounds: the medians it reports and the paired ratios it
prints (no servers: synthetic per-round reports)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.benchmark_script import BENCHMARKS, benchmark_script


@pytest.fixture(scope="module")
def bench():
    with benchmark_script("peers/vs_llamacpp") as mod:
        yield mod


def report(tokens_per_s: float, itl_ms: float, rss: float) -> dict:
    workload = {"output_tokens_per_s": tokens_per_s, "ttft_ms_mean": 100.0,
                "itl_ms_mean": itl_ms, "output_tokens": 9639}
    return {"rss_idle_mib": rss, "rss_after_mib": rss + 100, "kv_capacity_tokens": 16384,
            "workloads": {"1 stream": dict(workload), "32 streams": dict(workload)}}


LOADS = {"1 stream": {"requests": [("p", 128)]}, "32 streams": {"requests": [("p", 20)]}}


def test_rounds_report_each_number_as_its_median(bench):
    # the first round is nobody's median: a merge that kept it would fail
    rounds = [{"llmserve": report(t, i, r), "llama.cpp": report(100.0, 10.0, 500.0)}
              for t, i, r in ((300.0, 9.0, 580.0), (400.0, 5.0, 570.0), (420.0, 4.0, 575.0))]
    rounds[1]["llmserve"]["warnings"] = ["contended"]
    merged = bench.median_servers(rounds)
    ours = merged["llmserve"]
    assert ours["rounds"] == 3
    assert ours["rss_idle_mib"] == 575.0
    assert ours["workloads"]["32 streams"]["output_tokens_per_s"] == 400.0
    assert ours["workloads"]["32 streams"]["output_tokens_per_s_rounds"] == [300.0, 400.0,
                                                                              420.0]
    assert ours["workloads"]["1 stream"]["itl_ms_mean"] == 5.0
    assert ours["warnings"] == ["round 2: contended"]
    assert rounds[0]["llmserve"]["workloads"]["32 streams"]["output_tokens_per_s"] == 300.0
    table = dict((row[0], row[1:]) for row in bench.table_rows(merged, LOADS))
    assert table["32 streams: output tokens/s"] == ("400.0", "100.0", "4.00x")


def test_paired_ratios_are_printed_with_their_median(bench, capsys):
    rounds = []
    for ours, theirs in ((400.0, 90.0), (390.0, 120.0), (410.0, 95.0)):
        servers = {"llmserve": report(ours, 5.0, 575.0), "llama.cpp": report(theirs, 10.0, 500.0)}
        rounds.append({"servers": servers, "table": bench.table_rows(servers, LOADS)})
    bench.print_round_ratios(rounds)
    out = capsys.readouterr().out
    # the median of the pairs (4.32x), not the medians' ratio (400 / 95 = 4.21x)
    assert "32 streams: output tokens/s: 4.44x / 3.25x / 4.32x -> 4.32x" in out
    assert "1 stream, 128 tokens: mean ITL (ms): 2.00x / 2.00x / 2.00x -> 2.00x" in out


def test_rounds_below_one_is_refused_before_anything_runs():
    done = subprocess.run([sys.executable, str(BENCHMARKS / "peers" / "vs_llamacpp.py"),
                           "--rounds", "0", "--skip-llamacpp", "--skip-llmserve"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "--rounds: at least 1" in done.stderr
