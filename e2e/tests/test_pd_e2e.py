"""Prefill/decode disaggregation on a real control plane (issue 28): helm install ->
an LLMDeployment with spec.prefill -> both pools Ready -> a long request through the
gateway is prefilled on the prefill pod and decoded on the decode pod (the transfer
counters of both move) -> with the prefill pod gone, requests are still served ->
spec.prefill removed, the pool and its Secret pruned. The operator runs under the
chart's RBAC; pods run as local processes (podrunner)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import urllib.request
from pathlib import Path

import aiohttp
import openai
import pytest

from e2e.tests.conftest import get_json, wait_for
from e2e.tests.test_e2e import operator_release, pods, ready_ips
from llmserve.metrics_scrape import samples

ROOT = Path(__file__).resolve().parents[2]
NS = "pd"
OPERATOR_NS = "pd-system"
RELEASE = "llmserve-pd"
NAME = "smollm2-pd"
MODEL = "smollm2-135m-instruct"
ENGINE = f"app.kubernetes.io/component=engine,serving.llmserve.io/deployment={NAME}"
PREFILL = f"app.kubernetes.io/component=prefill,serving.llmserve.io/deployment={NAME}"
GATEWAY = f"app.kubernetes.io/component=gateway,serving.llmserve.io/deployment={NAME}"
POOL = {("Deployment", f"{NAME}-prefill"), ("Service", f"{NAME}-prefill"),
        ("NetworkPolicy", f"{NAME}-prefill")}
SENT, RECEIVED = "sent", "received"


def long_prompt(tag: str) -> str:
    """Well over the gateway's 256-token threshold (about 500 tokens), and new to every
    engine's prefix cache (the tag leads), so its KV has to move."""
    facts = " ".join(f"Fact {i}: the {tag} lighthouse keeper logged {i * 7} ships." for i in
                     range(36))
    return f"[{tag}] {facts}\nSummarise the log in one sentence:"


def metric(url: str, name: str, **labels) -> float:
    """``name`` on ``url``/metrics, summed over the series whose labels include these."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(s.value for s in samples(text)
               if s.name == name and labels.items() <= s.labels.items())


def transfer_tokens(ip: str, direction: str) -> float:
    return metric(f"http://{ip}:8000", "llmserve:kv_transfer_tokens_total",
                  direction=direction)


def pd_requests(gateway: str, mode: str) -> float:
    """The gateway's count of requests by P/D path: disaggregated, direct, fallback."""
    return metric(gateway, "llmserve_gateway_pd_requests_total", mode=mode)


def status(kubectl) -> dict:
    return get_json(kubectl, "llmd", NAME, "-n", NS).get("status") or {}


def is_ready(kubectl) -> bool:
    s = status(kubectl)
    return any(c["type"] == "Ready" and c["status"] == "True" for c in s.get("conditions", []))


def owned(kubectl) -> set[tuple[str, str]]:
    items = get_json(kubectl, "deployments,services,networkpolicies", "-n", NS, "-l",
                     f"serving.llmserve.io/deployment={NAME}")["items"]
    return {(i["kind"], i["metadata"]["name"]) for i in items}


def secret_exists(kubectl) -> bool:
    return kubectl("get", "secret", f"{NAME}-kv-transfer", "-n", NS, check=False).returncode == 0


@pytest.fixture(scope="module")
def operator(cluster, kubectl):
    with operator_release(cluster, kubectl, RELEASE, OPERATOR_NS, NS):
        yield


@pytest.fixture(scope="module")
def pd(kubectl, operator):
    kubectl("apply", "-n", NS, "-f", str(ROOT / "examples" / "builtin-cpu-pd.yaml"))
    wait_for(lambda: is_ready(kubectl)
             and (status(kubectl).get("prefill") or {}).get("readyReplicas") == 1,
             360, 1.0, what="both pools Ready")
    return NAME


def gateway_url(kubectl) -> str:
    return f"http://{wait_for(lambda: ready_ips(kubectl, NS, GATEWAY), 120)[0]}:8080"


def test_both_pools_ready_and_shown(kubectl, pd):
    header, row = kubectl("get", "llmd", NAME, "-n", NS).stdout.splitlines()[:2]
    columns = dict(zip(header.split(), row.split()))
    assert columns["READY"] == "1" and columns["PREFILL"] == "1/1", (header, row)
    assert len(ready_ips(kubectl, NS, ENGINE)) == 1 and len(ready_ips(kubectl, NS, PREFILL)) == 1
    assert secret_exists(kubectl)
    condition = next(c for c in status(kubectl)["conditions"] if c["type"] == "Progressing")
    assert "1/1 prefill replicas ready" in condition["message"]


def test_long_request_is_prefilled_on_the_prefill_pod_and_decoded_on_the_decode_pod(
        kubectl, pd):
    (prefill_ip,), (decode_ip,) = ready_ips(kubectl, NS, PREFILL), ready_ips(kubectl, NS, ENGINE)
    sent, received = transfer_tokens(prefill_ip, SENT), transfer_tokens(decode_ip, RECEIVED)
    gateway = gateway_url(kubectl)
    disaggregated = pd_requests(gateway, "disaggregated")
    client = openai.OpenAI(base_url=gateway + "/v1", api_key="x", max_retries=0)
    out = client.completions.create(model=MODEL, prompt=long_prompt("amber"), max_tokens=12,
                                    temperature=0)
    assert out.usage.prompt_tokens > 256 and out.usage.completion_tokens > 0
    assert pd_requests(gateway, "disaggregated") == disaggregated + 1
    moved_sent = transfer_tokens(prefill_ip, SENT) - sent
    moved_received = transfer_tokens(decode_ip, RECEIVED) - received
    # The prompt's full blocks moved: sent by the prefill pod, received by the decode pod.
    assert moved_sent >= 256 and moved_received >= 256, (moved_sent, moved_received)
    # A streamed chat goes the same way, and reaches the client whole.
    received = transfer_tokens(decode_ip, RECEIVED)
    stream = client.chat.completions.create(
        model=MODEL, max_tokens=12, temperature=0, stream=True,
        messages=[{"role": "user", "content": long_prompt("cobalt")}])
    text = "".join(ev.choices[0].delta.content or "" for ev in stream if ev.choices)
    assert text
    assert transfer_tokens(decode_ip, RECEIVED) - received >= 256


async def long_request(session, url: str, tag: str) -> tuple[int, bytes]:
    body = {"model": MODEL, "prompt": long_prompt(tag), "max_tokens": 8, "temperature": 0}
    async with session.post(url + "/v1/completions", json=body) as r:
        return r.status, await r.read()


def test_requests_are_served_with_the_prefill_pod_deleted(cluster, kubectl, pd):
    url = gateway_url(kubectl)
    (pod,) = [p for p in pods(kubectl, NS, PREFILL) if not p["metadata"].get("deletionTimestamp")]
    name = pod["metadata"]["name"]
    proc = next(p for p in cluster.runner.pods.values() if p.name == name)
    os.killpg(proc.proc.pid, signal.SIGKILL)  # the prefill engine dies ...
    kubectl("delete", "pod", name, "-n", NS, "--grace-period=0", "--force", "--wait=false")

    async def burst():
        timeout = aiohttp.ClientTimeout(total=120)
        async with aiohttp.ClientSession(timeout=timeout) as s:
            return await asyncio.gather(*(long_request(s, url, f"gone-{i}") for i in range(4)))

    fallbacks, t0 = pd_requests(url, "fallback"), time.monotonic()
    results = asyncio.run(burst())  # ... while no replacement is ready yet
    took = time.monotonic() - t0
    for code, body in results:
        assert code == 200, body
        assert json.loads(body)["choices"][0]["text"] is not None
    # The decode pool prefilled them itself: the gateway fell back, it did not fail.
    assert pd_requests(url, "fallback") - fallbacks == len(results)
    reasons = {r: metric(url, "llmserve_gateway_pd_requests_total", mode="fallback", reason=r)
               for r in ("connection", "timeout", "no_endpoint", "status")}
    print(f"\n[e2e pd] prefill pod killed: {len(results)} long requests served by the decode "
          f"pool in {took:.1f} s; gateway fallbacks by reason so far: {reasons}", flush=True)
    # The replacement pod comes up and takes prefills again.
    ips = wait_for(lambda: (ips := ready_ips(kubectl, NS, PREFILL)) and name not in
                   [p["metadata"]["name"] for p in pods(kubectl, NS, PREFILL)] and ips,
                   300, 1.0, what="a replacement prefill pod ready")
    (decode_ip,) = ready_ips(kubectl, NS, ENGINE)

    def moved() -> bool:
        sent, received = transfer_tokens(ips[0], SENT), transfer_tokens(decode_ip, RECEIVED)
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        client.completions.create(model=MODEL, prompt=long_prompt(f"back-{time.time()}"),
                                  max_tokens=4, temperature=0)
        return (transfer_tokens(ips[0], SENT) > sent
                and transfer_tokens(decode_ip, RECEIVED) > received)

    # The gateway learns of the new pod from its EndpointSlice: a few seconds at most.
    wait_for(moved, 60, 2.0, what="the replacement prefill pod to serve the prefill leg")


def test_removing_prefill_prunes_the_pool_and_its_secret(cluster, kubectl, pd):
    assert POOL <= owned(kubectl)
    kubectl("patch", "llmd", NAME, "-n", NS, "--type=json",
            "-p", '[{"op": "remove", "path": "/spec/prefill"}]')
    wait_for(lambda: not POOL & owned(kubectl) and not secret_exists(kubectl), 90, 1.0,
             what="the prefill pool and the Secret pruned")
    wait_for(lambda: not [p for p in cluster.runner.running_pods()
                          if p.startswith(f"{NS}/{NAME}-prefill")], 120,
             what="the prefill pod processes to end")
    gw = get_json(kubectl, "deployment", f"{NAME}-gateway", "-n", NS)
    assert "--prefill-k8s-service" not in gw["spec"]["template"]["spec"]["containers"][0]["args"]
    # The engines roll back to colocated serving (no --kv-role) and serve long prompts.
    wait_for(lambda: is_ready(kubectl) and "prefill" not in status(kubectl)
             and all("--kv-role" not in p["spec"]["containers"][0]["args"]
                     for p in pods(kubectl, NS, ENGINE))
             and len(ready_ips(kubectl, NS, ENGINE)) == 1, 300, 1.0,
             what="the engine rolled to --kv-role both and Ready")
    client = openai.OpenAI(base_url=gateway_url(kubectl) + "/v1", api_key="x", max_retries=2)
    out = client.completions.create(model=MODEL, prompt=long_prompt("after"), max_tokens=4,
                                    temperature=0)
    assert out.usage.prompt_tokens > 256
    header, row = kubectl("get", "llmd", NAME, "-n", NS).stdout.splitlines()[:2]
    assert "PREFILL" in header.split() and "1/1" not in row.split()
