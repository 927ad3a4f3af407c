"""Multi-LoRA on a real control plane: helm install -> an LLMDeployment with two
adapters (random PEFT adapters of the built-in model, file:// sources) -> both are
listed by the gateway's /v1/models and served (each changes the base model's greedy
answer) -> one removed from spec.adapters is unloaded, with no engine restart -> a bad
source sets Degraded with the engine's message, which clears once it is removed. The
operator runs under the chart's RBAC; pods run as local processes (podrunner)."""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path

import openai
import pytest

from e2e.tests.conftest import get_json, wait_for
from e2e.tests.test_e2e import operator_release, pods, ready_ips

ROOT = Path(__file__).resolve().parents[2]
NS = "lora"
OPERATOR_NS = "lora-system"
RELEASE = "llmserve-lora"
NAME = "smollm2-lora"
MODEL = "smollm2-135m-instruct"
ENGINE = f"app.kubernetes.io/component=engine,serving.llmserve.io/deployment={NAME}"
GATEWAY = f"app.kubernetes.io/component=gateway,serving.llmserve.io/deployment={NAME}"
PROMPT = "Write one sentence about the sea."


def llmd(adapters: list[dict], name: str = NAME, **spec) -> str:
    body = {"model": {"name": MODEL, "source": MODEL}, "engine": {"maxNumSeqs": 8},
            "resources": {"cpu": "2", "memory": "2Gi"}, "replicas": 1,
            "adapters": adapters, **spec}
    return json.dumps({"apiVersion": "serving.llmserve.io/v1alpha1", "kind": "LLMDeployment",
                       "metadata": {"name": name, "namespace": NS}, "spec": body})


def status(kubectl) -> dict:
    return get_json(kubectl, "llmd", NAME, "-n", NS).get("status") or {}


def condition(kubectl, type_: str) -> dict:
    return next((c for c in status(kubectl).get("conditions", []) if c["type"] == type_), {})


def adapter_states(kubectl) -> dict[str, str]:
    return {a["name"]: a["state"] for a in status(kubectl).get("adapters") or []}


def set_adapters(kubectl, adapters: list[dict]) -> None:
    kubectl("patch", "llmd", NAME, "-n", NS, "--type=merge", "-p",
            json.dumps({"spec": {"adapters": adapters}}))


@pytest.fixture(scope="module")
def adapter_dir():
    """Two random adapters of the built-in model, outside /tmp (an engine pod's /tmp is
    its own emptyDir)."""
    from llmserve.model_executor.model_loader.sources import resolve_model
    from tests.lora_adapters import write_peft_adapter
    d = Path(tempfile.mkdtemp(prefix="llmserve-e2e-lora-", dir="/var/tmp"))
    base = resolve_model(MODEL)
    for seed, name in ((1, "sql"), (2, "poet")):
        write_peft_adapter(base, d / name, seed=seed)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def source(adapter_dir: Path, name: str) -> str:
    return f"file://{adapter_dir / name}"


@pytest.fixture(scope="module")
def operator(cluster, kubectl):
    with operator_release(cluster, kubectl, RELEASE, OPERATOR_NS, NS):
        yield


@pytest.fixture(scope="module")
def deployed(kubectl, operator, adapter_dir):
    t0 = time.monotonic()
    adapters = [{"name": n, "source": source(adapter_dir, n)} for n in ("sql", "poet")]
    kubectl("apply", "-f", "-", input=llmd(adapters))
    wait_for(lambda: condition(kubectl, "Ready").get("status") == "True"
             and adapter_states(kubectl) == {"sql": "Loaded", "poet": "Loaded"},
             300, 1.0, what="Ready with both adapters loaded")
    print(f"[e2e] kubectl apply -> Ready, adapters loaded: {time.monotonic() - t0:.1f} s")
    return adapter_dir


def gateway(kubectl) -> openai.OpenAI:
    ip = wait_for(lambda: ready_ips(kubectl, NS, GATEWAY), 120, what="gateway pod")[0]
    return openai.OpenAI(base_url=f"http://{ip}:8080/v1", api_key="x", max_retries=2)


def model_ids(client: openai.OpenAI) -> list[str]:
    return [m.id for m in client.models.list().data]


def greedy(client: openai.OpenAI, model: str) -> str:
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0)
    return r.choices[0].text


def engine_pod(kubectl) -> tuple[str, int]:
    """(uid, restarts) of the one engine pod."""
    [pod] = [p for p in pods(kubectl, NS, ENGINE) if not p["metadata"].get("deletionTimestamp")]
    return pod["metadata"]["uid"], pod["status"]["containerStatuses"][0]["restartCount"]


@pytest.mark.parametrize("adapters,spec,message", [
    ([{"name": "a", "source": "hf://o/a"}, {"name": "a", "source": "hf://o/b"}], {},
     "Duplicate value"),
    ([{"name": "a", "source": "s3://bucket/a"}], {}, "should match"),
    ([{"name": "has space", "source": "hf://o/a"}], {}, "should match"),
    ([{"name": MODEL, "source": "hf://o/a"}], {}, "must differ from model.name"),
    ([], {"engine": {"lora": {"maxLoras": 8, "maxCpuLoras": 4}}},
     "maxCpuLoras must be at least maxLoras"),
    ([], {"engine": {"lora": {"maxCpuLoras": 2}}}, "maxCpuLoras must be at least maxLoras"),
])
def test_the_api_server_rejects_bad_adapter_specs(kubectl, operator, adapters, spec, message):
    r = kubectl("apply", "--dry-run=server", "-f", "-", input=llmd(adapters, "bad", **spec),
                check=False)
    assert r.returncode != 0 and message in r.stderr, r.stderr


def test_the_api_server_accepts_every_source_scheme_and_lora_sizes(kubectl, operator):
    adapters = [{"name": "a", "source": "hf://org/a@v2"}, {"name": "b.v1", "source":
                "pvc://loras/b"}, {"name": "c_1", "source": "file:///srv/c"}]
    for spec in ({"engine": {"lora": {"maxLoras": 2, "maxLoraRank": 16, "maxCpuLoras": 2}}},
                 {"engine": {"kind": "vllm", "lora": {"maxCpuLoras": 2}}}):
        r = kubectl("apply", "--dry-run=server", "-f", "-", input=llmd(adapters, "ok", **spec),
                    check=False)
        assert r.returncode == 0, r.stderr


def test_both_adapters_are_listed_and_served_through_the_gateway(kubectl, deployed):
    client = gateway(kubectl)
    # The gateway learns each engine's models with its next scrape of it.
    def listed():
        ids = model_ids(client)
        return ids if {"sql", "poet"} <= set(ids) else None

    t0 = time.monotonic()
    ids = wait_for(listed, 60, 1.0, what="both adapters on the gateway's /v1/models")
    print(f"[e2e] adapters on the gateway's /v1/models: {time.monotonic() - t0:.1f} s")
    assert ids[0] == MODEL, ids
    t0 = time.monotonic()
    base, sql, poet = (greedy(client, m) for m in (MODEL, "sql", "poet"))
    print(f"[e2e] three greedy completions: {time.monotonic() - t0:.1f} s")
    # Random adapters move the greedy answer: served by name, each with its own weights.
    assert len({base, sql, poet}) == 3, (base, sql, poet)
    adapters = {a["name"]: a for a in status(kubectl)["adapters"]}
    assert adapters["sql"]["ready"] == "1/1"
    assert adapters["sql"]["source"] == source(deployed, "sql")


def test_removing_an_adapter_unloads_it_without_a_restart(kubectl, deployed):
    before = engine_pod(kubectl)
    client = gateway(kubectl)
    t0 = time.monotonic()
    set_adapters(kubectl, [{"name": "sql", "source": source(deployed, "sql")}])
    wait_for(lambda: "poet" not in model_ids(client), 60, 1.0, what="poet unloaded")
    print(f"[e2e] poet removed -> gone from the gateway's /v1/models: "
          f"{time.monotonic() - t0:.1f} s")
    with pytest.raises(openai.NotFoundError):
        greedy(client, "poet")
    assert greedy(client, "sql")
    wait_for(lambda: adapter_states(kubectl) == {"sql": "Loaded"}, 60, 1.0,
             what="status.adapters without poet")
    assert engine_pod(kubectl) == before  # same pod, never restarted


def test_a_bad_source_sets_degraded_with_the_engines_message(kubectl, deployed):
    missing = f"file://{deployed}/no-such-adapter"
    set_adapters(kubectl, [{"name": "sql", "source": source(deployed, "sql")},
                           {"name": "broken", "source": missing}])
    degraded = wait_for(lambda: (c := condition(kubectl, "Degraded")).get("status") == "True"
                        and c, 60, 1.0, what="Degraded")
    assert degraded["reason"] == "AdapterLoadFailed"
    assert degraded["message"].startswith(f"adapter broken ({missing}): ")
    broken = next(a for a in status(kubectl)["adapters"] if a["name"] == "broken")
    assert broken["state"] == "Failed" and broken["message"]
    assert broken["message"] in degraded["message"]  # the engine's own words
    # The good adapter and the base model still serve.
    assert condition(kubectl, "Ready")["status"] == "True"
    assert adapter_states(kubectl)["sql"] == "Loaded"
    set_adapters(kubectl, [{"name": "sql", "source": source(deployed, "sql")}])
    wait_for(lambda: condition(kubectl, "Degraded").get("status") == "False", 60, 1.0,
             what="Degraded cleared once the bad adapter is removed")
