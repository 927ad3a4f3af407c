"""The chart's Grafana dashboards rendered with data, without Grafana.

Starts ``llmserve up`` (the built-in model, two engines, a tenants file) and a real
Prometheus (built from the Go module proxy by e2e/controlplane/build_prometheus.sh)
scraping the engines and the gateway, sends traffic with the openai client for a
couple of minutes, then runs every panel's PromQL from charts/llmserve/dashboards/*.json
against Prometheus' query_range API and draws each dashboard's panels with matplotlib
at their grid positions into docs/grafana-<dashboard>.png.

The operator's panels need the operator's metrics; there is no Kubernetes here, so
the operator's own autoscaler code (``autoscaler.decide`` and ``operator.metrics``)
runs in this process on the engines' scraped metrics, as the operator's timer does,
and Prometheus scrapes its /metrics. Replicas cannot change under ``up``: current
is the engine count.

Prometheus' targets carry the labels the chart's monitors give pods
(``namespace``, ``llmdeployment``, ``component``, ``pod``), so the dashboards' queries
run unchanged but for Grafana's variables: ``$namespace``/``$deployment``/``$tenant``
become ``.*`` and ``$__rate_interval`` four scrape intervals.

Every panel whose queries all return nothing is listed at the end: an empty panel is
a bug to report (a name no component exports under load, or traffic that never
exercises it), not something to hide.

    .venv/bin/python benchmarks/serving/render_dashboards.py [--seconds 120] [--out docs]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

if not __package__:  # run as a file: the repository root, so that `benchmarks` imports
    sys.path.append(str(Path(__file__).resolve().parents[2]))

from benchmarks.lib.paths import ROOT
from benchmarks.lib.server import stop_server, wait_until
from llmserve.utils import free_port

DASHBOARDS = ROOT / "charts" / "llmserve" / "dashboards"
BUILD_PROMETHEUS = ROOT / "e2e" / "controlplane" / "build_prometheus.sh"
SCRAPE_SECONDS = 3
RATE_INTERVAL = f"{4 * SCRAPE_SECONDS}s"
LABELS = {"namespace": "local", "llmdeployment": "up"}
TENANTS = """
classes:
  - {name: interactive, priority: 0, queueTimeoutSeconds: 30, maxQueued: 64}
  - {name: batch, priority: 10, queueTimeoutSeconds: 120, maxQueued: 256, minShare: 0.1}
defaultClass: interactive
tenants:
  - {name: acme, apiKeys: ["sk-acme"], weight: 2}
  - {name: globex, apiKeys: ["sk-globex"], classes: [batch], limits: {rpm: 3}}
"""
# Shared system prompts: repeated prefixes, so the prefix cache gets hits.
SYSTEMS = ["You are a terse assistant for a bicycle shop. Answer in one sentence.",
           "You translate short English phrases into French and explain nothing else."]
QUESTIONS = ["How do I fix a flat tyre?", "What is a derailleur?", "Good morning, friend.",
             "Where is the station?", "Which chain lube lasts longest?", "I like green tea.",
             "How often should brakes be checked?", "The weather is lovely today."]


def get(url: str, timeout: float = 10) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read()


# --- the processes ------------------------------------------------------------------
def prometheus_binary() -> str:
    r = subprocess.run(["bash", str(BUILD_PROMETHEUS)], stdout=subprocess.PIPE, text=True,
                       check=True)
    return r.stdout.strip().splitlines()[-1]


def start_up(workdir: Path, port: int, engines: int) -> tuple[subprocess.Popen, list[str]]:
    """`llmserve up` with two tenants; the engines' URLs from its banner."""
    tenants = workdir / "tenants.yaml"
    tenants.write_text(TENANTS)
    log = open(workdir / "up.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "llmserve", "up", "--engines", str(engines),
                             "--host", "127.0.0.1", "--port", str(port), "--tenants",
                             str(tenants), "--log-level", "WARNING",
                             # Small bounds, so the class queues, the engines' overload
                             # refusals and the gateway's spill-over all see use.
                             "--max-in-flight", "1", "--max-num-seqs", "2",
                             "--max-waiting", "1"],
                            stdout=log, stderr=subprocess.STDOUT, text=True)
    banner = re.compile(r"llmserve is up: \S+ .*engine\(s\): (.+)\)")
    found: list[str] = []

    def up() -> bool:
        if proc.poll() is not None:
            raise SystemExit(f"llmserve up exited: {(workdir / 'up.log').read_text()[-2000:]}")
        m = banner.search((workdir / "up.log").read_text())
        found.extend(m.group(1).split(", ") if m else [])
        return bool(m)
    wait_until(up, 600, "llmserve up")
    return proc, found


def start_prometheus(binary: str, workdir: Path, port: int, engines: list[str], gateway: str,
                     operator: str) -> subprocess.Popen:
    def target(url: str, **labels) -> dict:
        return {"targets": [urllib.parse.urlsplit(url).netloc], "labels": {**LABELS, **labels}}
    config = {
        "global": {"scrape_interval": f"{SCRAPE_SECONDS}s",
                   "evaluation_interval": f"{SCRAPE_SECONDS}s"},
        "scrape_configs": [
            {"job_name": "llmserve-workloads", "static_configs": [
                *(target(u, component="engine", pod=f"up-engine-{i}")
                  for i, u in enumerate(engines)),
                target(gateway, component="gateway", pod="up-gateway-0")]},
            # The operator's series name the LLMDeployment they describe (honorLabels,
            # as the chart's monitors scrape it).
            {"job_name": "llmserve-operator", "honor_labels": True,
             "static_configs": [{"targets": [urllib.parse.urlsplit(operator).netloc]}]}],
    }
    path = workdir / "prometheus.yml"
    path.write_text(json.dumps(config))  # YAML is a superset of JSON
    proc = subprocess.Popen([binary, f"--config.file={path}",
                             f"--storage.tsdb.path={workdir / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                            stdout=open(workdir / "prometheus.log", "w"),
                            stderr=subprocess.STDOUT)
    wait_until(lambda: get(f"http://127.0.0.1:{port}/-/ready") is not None, 60, "Prometheus")
    return proc


class InProcessAutoscaler(threading.Thread):
    """The operator's timer without Kubernetes: scrape the engines, ``decide``, record
    with ``llmserve.operator.metrics`` (what the operator's /metrics serves)."""

    SPEC = {"autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 2,
                            "targetQueueDepth": 2, "scaleDownStabilizationSeconds": 30}}

    def __init__(self, engines: list[str], port: int):
        super().__init__(daemon=True, name="autoscaler")
        from llmserve.operator import metrics
        self.engines, self.metrics, self.stop = engines, metrics, threading.Event()
        metrics.serve(port, host="127.0.0.1")

    def run(self) -> None:
        from llmserve.gateway.endpoints import KV_USAGE, WAITING
        from llmserve.metrics_scrape import sum_by_name
        from llmserve.operator.autoscaler import History, Observation, Policy, decide
        from llmserve.operator.handlers import RUNNING
        policy, history = Policy.from_spec(self.SPEC), History()
        current = len(self.engines)
        while not self.stop.wait(2.0):
            try:
                scraped = [sum_by_name(get(u + "/metrics", 3).decode()) for u in self.engines]
            except OSError:
                scraped = None
            obs = None if not scraped else Observation(
                waiting=sum(s.get(WAITING, 0.0) for s in scraped),
                running=sum(s.get(RUNNING, 0.0) for s in scraped),
                kv_usage=sum(s.get(KV_USAGE, 0.0) for s in scraped) / len(scraped),
                ready_replicas=len(scraped))
            decision = decide(current, obs, policy, history, time.monotonic())
            name = (LABELS["namespace"], LABELS["llmdeployment"], "engine")
            self.metrics.record_decision(*name, current, policy, obs, decision)
            self.metrics.record_replicas(*name, decision.replicas, current)


# --- traffic ------------------------------------------------------------------------
def send_traffic(gateway: str, seconds: float, workers: int = 8) -> dict[str, int]:
    """Chat and completion requests, streamed and not, from two tenants and two classes
    (globex's rpm limit turns some of its requests into 429s)."""
    import openai
    counts: dict[str, int] = {}
    lock = threading.Lock()
    deadline = time.monotonic() + seconds

    def worker(i: int) -> None:
        rng = random.Random(i)
        key = "sk-globex" if i % 2 else "sk-acme"
        client = openai.OpenAI(base_url=gateway + "/v1", api_key=key, max_retries=0,
                               timeout=120)
        while time.monotonic() < deadline:
            outcome = "ok"
            try:
                messages = [{"role": "system", "content": rng.choice(SYSTEMS)},
                            {"role": "user", "content": rng.choice(QUESTIONS)}]
                max_tokens = rng.choice([8, 16, 32, 64])
                if rng.random() < 0.5:
                    stream = client.chat.completions.create(
                        model="smollm2-135m-instruct", messages=messages, stream=True,
                        max_tokens=max_tokens, temperature=0.7)
                    for _ in stream:
                        pass
                else:
                    client.completions.create(model="smollm2-135m-instruct",
                                              prompt=messages[0]["content"] + " "
                                              + messages[1]["content"], max_tokens=max_tokens)
            except openai.RateLimitError:
                outcome = "429"
                time.sleep(1.0)
            except openai.APIError as e:
                outcome = type(e).__name__
            with lock:
                counts[outcome] = counts.get(outcome, 0) + 1
            time.sleep(rng.uniform(0, 0.3))

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return counts


# --- queries and drawing ------------------------------------------------------------
def grafana_expr(expr: str) -> str:
    """The panel's PromQL with Grafana's variables filled as a dashboard showing All."""
    expr = expr.replace("$__rate_interval", RATE_INTERVAL).replace("$__interval", "15s")
    return re.sub(r"\$\{?(\w+)\}?", ".*", expr)


def query_range(prom: str, expr: str, start: float, end: float, step: float) -> list[dict]:
    q = urllib.parse.urlencode({"query": grafana_expr(expr), "start": start, "end": end,
                                "step": step})
    body = json.loads(get(f"{prom}/api/v1/query_range?{q}", 30))
    if body.get("status") != "success":
        raise RuntimeError(f"{expr}: {body}")
    return body["data"]["result"]


def legend(fmt: str, labels: dict) -> str:
    text = re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt or "")
    return text.strip() or ",".join(f"{k}={v}" for k, v in labels.items()
                                    if k not in ("job", "instance")) or "value"


def panels_of(board: dict) -> list[dict]:
    return [p for p in board["panels"] if p["type"] != "row"]


def fetch(board: dict, prom: str, start: float, end: float, step: float) -> dict[int, list]:
    """Each panel's series: [(legend, times, values)]."""
    out = {}
    for p in panels_of(board):
        series = []
        for t in p["targets"]:
            for r in query_range(prom, t["expr"], start, end, step):
                points = [(float(ts), float(v)) for ts, v in r["values"] if v not in ("NaN",)]
                if points:
                    times, values = zip(*points)
                    series.append((legend(t.get("legendFormat", ""), r["metric"]),
                                   [x - start for x in times], list(values)))
        out[p["id"]] = series
    return out


def draw(board: dict, data: dict[int, list], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    bottom = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in board["panels"])
    height = bottom + 1.0  # grid rows, plus the title's
    fig = plt.figure(figsize=(16, height * 0.34))
    fig.suptitle(f"{board['title']}: rendered from Prometheus scraping llmserve up",
                 fontsize=11, x=0.01, y=1 - 0.3 / height, ha="left")

    def fig_y(row: float) -> float:
        return 1 - (row + 1.0) / height

    def box(g: dict) -> list[float]:
        """Grafana's 24-column grid in figure coordinates, with room for the panel's
        title above and the tick labels around."""
        left, right = 0.035 + 0.96 * g["x"] / 24, 0.035 + 0.96 * (g["x"] + g["w"]) / 24
        top, low = fig_y(g["y"] + 0.8), fig_y(g["y"] + g["h"] - 0.6)
        return [left, low, right - left - 0.035, top - low]
    for p in board["panels"]:
        g = p["gridPos"]
        if p["type"] == "row":
            fig.text(0.005, fig_y(g["y"] + 0.7), p["title"], fontsize=10,
                     fontweight="bold", color="#444")
            continue
        ax = fig.add_axes(box(g))
        ax.set_title(p["title"], fontsize=8, loc="left")
        ax.tick_params(labelsize=6)
        series = data[p["id"]]
        unit = p.get("fieldConfig", {}).get("defaults", {}).get("unit", "")
        if not series:
            ax.text(0.5, 0.5, "No data", ha="center", va="center", color="#c00", fontsize=9,
                    transform=ax.transAxes)
            ax.set_xticks([])
            ax.set_yticks([])
        elif p["type"] == "stat":
            value = series[0][2][-1]
            ax.text(0.5, 0.45, stat_text(value, unit), ha="center", va="center",
                    fontsize=16, color="#2a7", transform=ax.transAxes)
            ax.plot(series[0][1], series[0][2], color="#2a7", alpha=0.25)
            ax.set_xticks([])
            ax.set_yticks([])
        else:
            for name, times, values in series[:8]:
                ax.plot(times, values, linewidth=1, label=name[:40])
            ax.legend(fontsize=5, loc="upper left", frameon=False, ncol=2)
            ax.set_xlabel("s", fontsize=6, labelpad=0)
            if unit in ("percentunit",):
                ax.yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
            elif unit:
                ax.set_ylabel(unit, fontsize=6)
            ax.grid(alpha=0.3)
    save_small(fig, path)
    plt.close(fig)


def stat_text(value: float, unit: str) -> str:
    if unit == "percentunit":
        return f"{100 * value:.1f} %"
    return f"{value:.3g}"


def save_small(fig, path: Path, limit: int = 300_000) -> None:
    """PNG under ``limit`` bytes: lower the resolution until it fits."""
    for dpi in (80, 68, 56, 46):
        fig.savefig(path, dpi=dpi)
        if path.stat().st_size < limit:
            return
    raise RuntimeError(f"{path} is {path.stat().st_size} bytes even at {dpi} dpi")


# --- main ---------------------------------------------------------------------------
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=120, help="traffic duration")
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "docs")
    args = ap.parse_args()
    binary = prometheus_binary()
    workdir = Path(tempfile.mkdtemp(prefix="llmserve-dashboards-"))
    gw_port, prom_port, op_port = free_port(), free_port(), free_port()
    up, engines = start_up(workdir, gw_port, args.engines)
    gateway = f"http://127.0.0.1:{gw_port}"
    prom = None
    autoscaler = InProcessAutoscaler(engines, op_port)
    try:
        autoscaler.start()
        prom = start_prometheus(binary, workdir, prom_port, engines, gateway,
                                f"http://127.0.0.1:{op_port}")
        print(f"llmserve up: gateway {gateway}, engines {engines}; Prometheus "
              f"127.0.0.1:{prom_port}; traffic for {args.seconds:.0f} s ...", flush=True)
        start = time.time()
        counts = send_traffic(gateway, args.seconds)
        time.sleep(3 * SCRAPE_SECONDS)  # the last requests' samples
        end = time.time()
        print(f"requests by outcome: {counts}", flush=True)
        empty = []
        for path in sorted(DASHBOARDS.glob("*.json")):
            board = json.loads(path.read_text())
            data = fetch(board, f"http://127.0.0.1:{prom_port}", start, end, SCRAPE_SECONDS)
            out = args.out / f"grafana-{path.stem}.png"
            draw(board, data, out)
            missing = [p["title"] for p in panels_of(board) if not data[p["id"]]]
            empty += [f"{path.stem}: {t}" for t in missing]
            print(f"{out}: {len(panels_of(board)) - len(missing)}/"
                  f"{len(panels_of(board))} panels with data ({out.stat().st_size // 1024} KB)",
                  flush=True)
        print("panels with no data:" + ("".join(f"\n  {e}" for e in empty) or " none"))
        return 0
    finally:
        autoscaler.stop.set()
        for proc in (prom, up):
            if proc is not None:
                stop_server(proc, grace=30)
        if os.environ.get("KEEP_WORKDIR") is None:
            subprocess.run(["rm", "-rf", str(workdir)])


if __name__ == "__main__":
    sys.exit(main())
