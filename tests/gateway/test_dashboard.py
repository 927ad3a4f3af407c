"""The gateway's /dashboard: its history ring (pure), its JSON behind the API keys, and
the page itself in a real headless Chromium while real traffic, sent with the
official openai client through a real gateway to a real engine, runs.

Set LLMSERVE_DASHBOARD_SCREENSHOT=path to save the page after a minute under load
(docs/dashboard.png comes from here)."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest

from llmserve.entrypoints.launcher import ServerProcess
from llmserve.gateway.dashboard import Dashboard
from llmserve.gateway.server import Gateway, GatewayConfig
from llmserve.gateway.timeseries import EngineSample, SecondBuckets, percentile
from tests.cdp import Chromium, find_chromium
from tests.server_proc import ServerProcess as EngineProcess

T0 = 1_700_000_000  # a whole second: the ring's buckets are keyed by int(now)


# --- the ring ---------------------------------------------------------------------------
def test_percentile_is_nearest_rank():
    values = [float(v) for v in range(1, 101)]  # 1..100
    assert percentile(values, 50) == 50.0
    assert percentile(values, 90) == 90.0
    assert percentile(values, 99) == 99.0
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None


def test_summary_percentiles_and_rates_over_the_last_minute():
    ring = SecondBuckets(window_s=300)
    for i in range(100):  # 100 streamed requests over 10 s, TTFT 0.01 .. 1.00
        ring.add_request(T0 + i / 10, 200, ttft=(i + 1) / 100, itl=[0.02, 0.04])
    ring.add_request(T0 + 9.5, 502)
    s = ring.summary(T0 + 9.9, 60)
    assert s["requests"] == 101 and s["errors"] == 1
    assert s["requests_per_s"] == pytest.approx(101 / 10)  # over the 10 s kept, not 60
    assert s["ttft"] == {"p50": 0.5, "p90": 0.9, "p99": 0.99}
    assert s["itl"] == {"p50": 0.02, "p90": 0.04, "p99": 0.04}


def test_buckets_older_than_the_window_expire():
    ring = SecondBuckets(window_s=60)
    ring.add_request(T0, 200, ttft=5.0)
    ring.add_request(T0 + 30, 200, ttft=1.0)
    assert ring.summary(T0 + 59, 60)["ttft"]["p99"] == 5.0
    ring.add_request(T0 + 60, 200, ttft=2.0)  # T0's second is now 60 s old: gone
    assert [b.second for b in ring.buckets] == [T0 + 30, T0 + 60]
    assert ring.summary(T0 + 60, 60)["ttft"]["p99"] == 2.0
    assert ring.summary(T0 + 200, 60)["requests"] == 0  # reading expires too
    assert not ring.buckets


def test_series_steps_rates_percentiles_and_engine_gauges():
    ring = SecondBuckets(window_s=300)  # fed in time order, as the gateway does
    samples = {0: EngineSample(running=1, waiting=0, kv_usage=0.1, prefix_hits=0,
                               prefix_queries=10),
               1: EngineSample(running=3, waiting=2, kv_usage=0.3, prefix_hits=30,
                               prefix_queries=30)}
    for second, n in ((0, 4), (1, 2), (2, 6)):
        if second in samples:
            ring.add_engines(T0 + second + 0.2, samples[second])
        for _ in range(n):
            ring.add_request(T0 + second + 0.5, 200, ttft=0.1 * (second + 1))
    s = ring.series(T0 + 2.5, 300, 2)
    assert s["t"] == [T0, T0 + 2]
    assert s["requests_per_s"] == [3.0, 6.0]  # 6 over 2 s; 6 over the 1 s of the step begun
    assert s["ttft_p50"] == [pytest.approx(0.1), pytest.approx(0.3)]
    assert s["ttft_p99"] == [pytest.approx(0.2), pytest.approx(0.3)]
    assert s["running"] == [3, None] and s["waiting"] == [2, None]
    assert s["kv_usage"] == [0.3, None]
    assert s["prefix_cache_hit_rate"] == [0.75, None]  # (0 + 30) / (10 + 30)
    assert all(len(column) == 2 for column in s.values())


def test_each_second_keeps_a_bounded_uniform_sample():
    ring = SecondBuckets(window_s=60, max_values=100)
    ring.add_request(T0, 200, ttft=0.0, itl=[i / 10_000 for i in range(10_000)])
    bucket = ring.buckets[-1]
    assert len(bucket.itl) == 100 and bucket.seen["itl"] == 10_000
    # a uniform sample of 0 .. 1: its median is near 0.5, not the first 100 values'
    assert 0.3 < percentile(bucket.itl, 50) < 0.7


def test_tenant_tallies_add_up_over_the_window():
    ring = SecondBuckets(window_s=60)
    ring.add_request(T0, 200, tenant="acme", tokens=30)
    ring.add_request(T0 + 1, 429, tenant="acme")
    ring.add_request(T0 + 2, 200, tenant="beta", tokens=10)
    ring.add_request(T0 + 2, 200)  # no tenants: not tallied
    tallies = ring.tenants(T0 + 2, 60)
    assert (tallies["acme"].requests, tallies["acme"].throttled, tallies["acme"].tokens) == \
        (2, 1, 30)
    assert tallies["beta"].tokens == 10 and set(tallies) == {"acme", "beta"}


def test_the_prefix_cache_counts_growth_and_a_restarted_engine_from_zero():
    """Engines' counters are cumulative: the history takes their growth between samples,
    starts counting at an engine's first sample, and counts a counter that fell (the
    engine restarted) from zero."""
    gw = Gateway(GatewayConfig(backends=[]))
    clock = iter(range(T0, T0 + 100))
    board = Dashboard(gw, clock=lambda: next(clock))
    gw.pool.set_urls(["http://a", "http://b"])
    a, b = gw.pool.endpoints["http://a"], gw.pool.endpoints["http://b"]
    for ep in (a, b):
        ep.scraped, ep.running, ep.waiting, ep.kv_usage = True, 2.0, 1.0, 0.5
    steps = [((10, 20), (0, 0)),  # first samples: nothing counted yet
             ((15, 30), (5, 5)),  # +5/+10 and +5/+5
             ((2, 4), (6, 10))]   # a restarted (2/4 from zero), b +1/+5
    for (a_hits, a_queries), (b_hits, b_queries) in steps:
        a.prefix_hits, a.prefix_queries = a_hits, a_queries
        b.prefix_hits, b.prefix_queries = b_hits, b_queries
        board.sample()
    b.ejected_until = time.monotonic() + 60  # an ejected engine's load is not counted
    board.sample()
    series = board.history.series(T0 + 3, 60, 1)
    assert series["prefix_cache_hit_rate"] == [None, 10 / 15, 3 / 9, None]
    assert series["running"] == [4.0, 4.0, 4.0, 2.0] and series["kv_usage"][-1] == 0.5
    data = board.data(60, 1)
    assert data["tenants"] is None and data["summary"]["prefix_cache_hit_rate"] == 13 / 24
    assert [(e["url"], e["state"]) for e in data["engines"]] == [("http://a", "ready"),
                                                                 ("http://b", "ejected")]


# --- a real engine and gateways ---------------------------------------------------------
TENANTS = """
classes:
  - {name: interactive, priority: 0}
defaultClass: interactive
tenants:
  - name: acme
    apiKeys: ["sk-acme"]
    weight: 3
  - name: beta
    apiKeys: ["sk-beta"]
"""
SYSTEM = "You are a terse assistant of the dashboard test. " * 12  # a shared prefix


@pytest.fixture(scope="module")
def engine(tiny_llama):
    proc = EngineProcess(str(tiny_llama), host="127.0.0.101",
                         extra=["--served-model-name", "tiny"])
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def gateway(engine, tmp_path_factory):
    """With tenants: their keys are the gateway's keys, and the page shows them."""
    path = tmp_path_factory.mktemp("dashboard") / "tenants.yaml"
    path.write_text(TENANTS)
    gw = ServerProcess(["gateway", "--backend", engine.url, "--scrape-interval", "0.3",
                        "--log-level", "WARNING", "--tenants", str(path)], "127.0.0.102")
    yield gw
    assert gw.stop() == 0


@pytest.fixture(scope="module")
def keyed_gateway(engine):
    """Without tenants, with a plain API key."""
    gw = ServerProcess(["gateway", "--backend", engine.url, "--scrape-interval", "0.3",
                        "--log-level", "WARNING"], "127.0.0.103",
                       env={"LLMSERVE_API_KEYS": "sk-ops"})
    yield gw
    assert gw.stop() == 0


def get(url: str, key: str | None = None) -> tuple[int, dict | str]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers),
                                    timeout=30) as r:
            body = r.read().decode()
            return r.status, json.loads(body) if "json" in r.headers["Content-Type"] else body
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def chat(gateway, key: str, question: str) -> str:
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0)
    stream = client.chat.completions.create(
        model="tiny", max_tokens=24, stream=True, stream_options={"include_usage": True},
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}])
    return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)


@pytest.mark.parametrize("key", [None, "sk-wrong"])
def test_the_data_needs_an_api_key_and_says_so_as_openai_does(gateway, keyed_gateway, key):
    for gw in (gateway, keyed_gateway):
        status, body = get(gw.url + "/dashboard/data", key)
        assert status == 401
        assert body["error"]["type"] == "authentication_error"
        assert body["error"]["code"] == "invalid_api_key"


def test_the_page_and_its_assets_are_served_from_the_package(keyed_gateway):
    status, page = get(keyed_gateway.url + "/dashboard")
    assert status == 200 and "dashboard/static/dashboard.js" in page
    for asset in ("dashboard.js", "dashboard.css", "vendor/uplot/uPlot.iife.min.js",
                  "vendor/uplot/LICENSE"):
        status, _ = get(keyed_gateway.url + "/dashboard/static/" + asset)
        assert status == 200, asset


def test_the_data_after_traffic(keyed_gateway, engine):
    for i in range(3):
        assert chat(keyed_gateway, "sk-ops", f"question {i}")
    # The engine's counters reach the gateway at its next scrape (every 0.3 s): on a fast
    # machine the three chats can end between two scrapes, before the hits are seen.
    deadline = time.monotonic() + 15
    while True:
        status, data = get(keyed_gateway.url + "/dashboard/data?window=60&step=5", "sk-ops")
        rate = data["engines"][0]["prefix_cache_hit_rate"] if status == 200 else None
        if (rate or time.monotonic() > deadline):
            break
        time.sleep(0.3)
    assert status == 200
    assert set(data) == {"time", "window_s", "step_s", "gateway", "engines", "summary",
                         "series", "tenants"}
    assert (data["window_s"], data["step_s"], data["tenants"]) == (60, 5, None)
    [row] = data["engines"]
    assert row["url"] == engine.url and row["role"] == "engine" and row["state"] == "ready"
    assert row["kv_usage"] is not None and row["running"] is not None
    assert row["prefix_cache_hit_rate"] > 0  # the shared system prompt
    summary = data["summary"]
    assert summary["requests"] >= 3 and summary["errors"] == 0
    assert summary["ttft"]["p50"] > 0 and summary["itl"]["p50"] > 0
    series = data["series"]
    assert len({len(column) for column in series.values()}) == 1
    assert sum(series["requests_per_s"]) > 0 and any(v for v in series["ttft_p99"])
    status, body = get(keyed_gateway.url + "/dashboard/data?step=x", "sk-ops")
    assert status == 400 and body["error"]["type"] == "invalid_request_error"


# --- the page in a browser --------------------------------------------------------------
CHART_POINTS = """(() => {
  const charts = window.llmserveDashboard.charts;
  return Object.fromEntries(Object.entries(charts).map(([name, chart]) =>
    [name, chart.data.slice(1).map(s => s.filter(v => v != null).length)]));
})()"""
ENGINE_ROWS = """[...document.querySelectorAll('#engines tbody tr')].map(
  tr => [...tr.cells].map(td => td.textContent))"""
TENANT_ROWS = ENGINE_ROWS.replace("#engines", "#tenants")


def chart_filled(points: dict) -> bool:
    """Every chart has points: requests, TTFT and ITL, the engines' queue and KV use
    (the first series of each; a 5xx series or a p99 may rightly stay empty)."""
    return set(points) == {"rate", "ttft", "itl", "queue", "cache"} and \
        all(series[0] > 0 for series in points.values())


def run_load(gateway, stop: threading.Event, counts: dict) -> list[threading.Thread]:
    """Two tenants' streams, acme's three at a time and beta's one, until ``stop``."""
    def worker(key: str, n: int) -> None:
        while not stop.is_set():
            chat(gateway, key, f"{key} asks question {n}")
            counts[key] = counts.get(key, 0) + 1
            n += 1

    threads = [threading.Thread(target=worker, args=(key, i * 1000), daemon=True)
               for i, key in enumerate(["sk-acme"] * 3 + ["sk-beta"])]
    for t in threads:
        t.start()
    return threads


async def test_the_page_fills_its_charts_under_load_without_console_errors(gateway, engine):
    binary = find_chromium()
    if binary is None:
        pytest.skip("no chromium on this machine (`make test` installs Debian's chromium "
                    "where apt-get can run)")
    stop, counts = threading.Event(), {}
    threads = run_load(gateway, stop, counts)
    try:
        async with Chromium(binary) as page:
            await page.navigate(gateway.url + "/dashboard#key=sk-acme")
            assert await page.evaluate("document.title") == "llmserve gateway"
            points = {}
            for _ in range(600):  # until the charts fill (in practice, a few polls)
                points = await page.evaluate(
                    f"window.llmserveDashboard.polls > 0 && {CHART_POINTS}")
                tenants = await page.evaluate(TENANT_ROWS)
                if points and chart_filled(points) and counts.get("sk-beta") and \
                        all(row[3] != "–" for row in tenants):
                    break
                await asyncio.sleep(0.2)
            assert points and chart_filled(points), points
            engines = await page.evaluate(ENGINE_ROWS)
            assert [(row[0], row[2]) for row in engines] == [(engine.url, "ready")]
            tenants = {row[0]: row for row in await page.evaluate(TENANT_ROWS)}
            assert set(tenants) == {"acme", "beta"}
            assert tenants["acme"][2] == "75.0 %"  # weight 3 of 4
            assert all(row[3] != "–" for row in tenants.values())  # both were served
            if os.environ.get("LLMSERVE_DASHBOARD_SCREENSHOT"):  # a minute of history
                await asyncio.sleep(60)
                Path(os.environ["LLMSERVE_DASHBOARD_SCREENSHOT"]).write_bytes(
                    await page.screenshot())
            assert page.problems == []
            assert await page.evaluate("window.llmserveDashboard.failures") == 0
    finally:
        stop.set()
        for t in threads:
            t.join(60)
