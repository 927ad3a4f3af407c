"""spec.prefill (issue 28), the operator's part: the prefill pool's children, the roles
each pool runs, the shared Secret, pruning when it is removed, the per-pool autoscaling
decision and the CRD's schema for it. Pure functions; the API server's side is in
e2e/tests/test_operator_api.py and the pods' in e2e/tests/test_pd_e2e.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from llmserve.operator.autoscaler import History, Observation, Policy, decide
from llmserve.operator.builders import (
    Owner,
    SpecError,
    children,
    children_selector,
    kv_transfer_secret,
    named_children,
    stale_children,
)
from llmserve.operator.prefill import PREFILL_ENGINE_KEYS
from tests.operator.test_chart_monitoring import needs_helm, of_kind, render, selects

ROOT = Path(__file__).resolve().parents[2]
CRD = ROOT / "crds" / "llmdeployments.serving.llmserve.io.yaml"


def owner(**spec) -> Owner:
    return Owner("chat", "team-a", "uid-123",
                 {"model": {"source": "smollm2-135m-instruct", "name": "smol"}, **spec})


def by_name(objs) -> dict[tuple[str, str], dict]:
    return {(o["kind"], o["metadata"]["name"]): o for o in objs}


def container(objs, name) -> dict:
    return by_name(objs)[("Deployment", name)]["spec"]["template"]["spec"]["containers"][0]


def flag(args, name):
    return args[args.index(name) + 1]


def env(c) -> dict:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env", [])}


PD = {"prefill": {"replicas": 2}}
SECRET_REF = {"secretKeyRef": {"name": "chat-kv-transfer", "key": "secret"}}
POD_IP = {"fieldRef": {"fieldPath": "status.podIP"}}


# --- children -----------------------------------------------------------------------------
def test_without_prefill_nothing_changes():
    objs = children(owner(), 1)
    assert len(objs) == 8 and ("Deployment", "chat-prefill") not in by_name(objs)
    c = container(objs, "chat-engine")
    assert "--kv-role" not in c["args"] and "LLMSERVE_KV_TRANSFER_SECRET" not in env(c)
    assert [p["name"] for p in c["ports"]] == ["http"]
    assert "--prefill-k8s-service" not in container(objs, "chat-gateway")["args"]


def test_prefill_pool_children_roles_and_gateway():
    objs = children(owner(**PD), 3, 2)
    named = by_name(objs)
    assert set(named) - set(by_name(children(owner(), 3))) == {
        ("Deployment", "chat-prefill"), ("Service", "chat-prefill"),
        ("NetworkPolicy", "chat-prefill")}
    # the prefill pool: its own component, role flags, side channel port, pod IP, secret
    dep = named[("Deployment", "chat-prefill")]
    assert dep["spec"]["replicas"] == 2
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert labels["app.kubernetes.io/component"] == "prefill"
    assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()
    p = container(objs, "chat-prefill")
    assert flag(p["args"], "--kv-role") == "prefill"
    assert flag(p["args"], "--kv-transfer-port") == "5600"
    assert {"name": "kv-transfer", "containerPort": 5600, "protocol": "TCP"} in p["ports"]
    assert env(p)["POD_IP"] == POD_IP and env(p)["LLMSERVE_KV_TRANSFER_SECRET"] == SECRET_REF
    # readiness as the main engine's
    d = container(objs, "chat-engine")
    for probe in ("readinessProbe", "startupProbe", "livenessProbe"):
        assert p[probe] == d[probe]
    # the main pool decodes, keeps the engine's name and labels, holds the secret too
    assert named[("Deployment", "chat-engine")]["spec"]["replicas"] == 3
    assert flag(d["args"], "--kv-role") == "decode" and "--kv-transfer-port" not in d["args"]
    assert env(d)["LLMSERVE_KV_TRANSFER_SECRET"] == SECRET_REF
    # headless Service the gateway follows, by the same port name as the engines'
    svc = named[("Service", "chat-prefill")]["spec"]
    assert svc["clusterIP"] == "None" and svc["selector"] == dep["spec"]["selector"]["matchLabels"]
    assert {"name": "http", "port": 8000, "targetPort": "http"} in svc["ports"]
    gw = container(objs, "chat-gateway")["args"]
    assert flag(gw, "--prefill-k8s-service") == "team-a/chat-prefill"
    assert flag(gw, "--k8s-service") == "team-a/chat-engine"
    # the pool exists before the gateway pointed at it is applied
    order = [(o["kind"], o["metadata"]["name"]) for o in objs]
    assert order.index(("Service", "chat-prefill")) < order.index(("Deployment", "chat-gateway"))


def test_prefill_overrides_engine_and_resources_but_not_the_shape():
    spec = {"engine": {"maxNumSeqs": 64, "args": ["--block-size", "32"], "dtype": "float32"},
            "resources": {"cpu": "4", "memory": "8Gi"},
            "prefill": {"engine": {"maxNumBatchedTokens": 8192, "args": ["--block-size", "32",
                                                                         "--seed", "1"],
                                   "image": "example/prefill:1"},
                        "resources": {"cpu": "8"}}}
    objs = children(owner(**spec), 1)
    p, d = container(objs, "chat-prefill"), container(objs, "chat-engine")
    assert p["image"] == "example/prefill:1" and d["image"] != p["image"]
    assert flag(p["args"], "--max-num-batched-tokens") == "8192"
    assert "--max-num-batched-tokens" not in d["args"]
    assert flag(p["args"], "--max-num-seqs") == "64"  # inherited
    assert flag(p["args"], "--dtype") == flag(d["args"], "--dtype") == "float32"
    assert p["args"][-4:] == ["--block-size", "32", "--seed", "1"]  # replaced whole
    assert p["resources"]["limits"] == {"cpu": "8", "memory": "8Gi"}
    assert d["resources"]["limits"] == {"cpu": "4", "memory": "8Gi"}


@pytest.mark.parametrize("spec,message", [
    ({"resources": {"gpus": 2}}, "decode pool would run tensor-parallel size 2"),
    ({"resources": {"gpus": 1}, "prefill": {"resources": {"gpus": 2}}},
     "prefill pool would run tensor-parallel size 2"),
    ({"engine": {"args": ["--no-prefix-caching"]}}, "decode pool needs prefix caching"),
])
def test_what_the_engines_would_refuse_is_refused_here(spec, message):
    spec = {"model": {"source": "hf://Qwen/Qwen2.5-7B-Instruct"}, "prefill": {}, **spec}
    with pytest.raises(SpecError, match=message):
        children(owner(**spec), 1)


def test_one_gpu_per_engine_in_both_pools():
    ok = children(owner(resources={"gpus": 1}, **PD), 1)
    for name in ("chat-engine", "chat-prefill"):
        assert container(ok, name)["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert flag(container(ok, name)["args"], "--device") == "cuda"


@pytest.mark.parametrize("args", [["--kv-role", "decode"], ["--kv-transfer-port=7000"],
                                  ["--kv-transfer-host", "10.0.0.1"]])
def test_the_operator_owns_the_role_flags(args):
    with pytest.raises(SpecError, match="spec.prefill"):
        children(owner(engine={"args": args}, **PD), 1)
    with pytest.raises(SpecError, match="spec.prefill"):
        children(owner(prefill={"engine": {"args": args}}), 1)


def test_network_policies_let_the_two_pools_and_the_gateway_in_only():
    named = by_name(children(owner(**PD), 1))
    engine, pool = (named[("NetworkPolicy", n)]["spec"] for n in ("chat-engine", "chat-prefill"))
    alone = by_name(children(owner(), 1))[("NetworkPolicy", "chat-engine")]["spec"]
    assert pool["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "prefill"
    http = alone["ingress"][0]  # the gateway and the operator, on HTTP
    assert pool["ingress"][0] == engine["ingress"][0] == http
    # KV transfer: each pool admits the other (NIXL's UCX picks its own ports, both ways)
    for policy, peer in ((pool, "engine"), (engine, "prefill")):
        assert policy["ingress"][1] == {"from": [{"podSelector": {"matchLabels": {
            "serving.llmserve.io/deployment": "chat", "app.kubernetes.io/component": peer}}}]}
        assert len(policy["ingress"]) == 2


def test_vllm_with_prefill_is_refused_with_the_reason():
    o = owner(model={"source": "hf://Qwen/Qwen2.5-7B-Instruct"}, engine={"kind": "vllm"},
              resources={"gpus": 1}, **PD)
    with pytest.raises(SpecError, match="needs engine.kind llmserve") as e:
        children(o, 1)
    assert "remote_lease_id" in str(e.value) and "remove spec.prefill" in str(e.value)
    # the same engine without spec.prefill is served as before
    assert len(children(owner(**{k: v for k, v in o.spec.items() if k != "prefill"}), 1)) == 8


def test_refusal_matches_what_the_gateway_accepts():
    """The reason vLLM is refused: the gateway sends leg 2 only with params a decode
    engine takes, and vLLM's NixlConnector answers without a lease. Once the gateway
    accepts vLLM's params, this fails, and spec.prefill can render vLLM's
    --kv-transfer-config instead (docs/disaggregation.md, "Refused")."""
    from llmserve.gateway.disagg import usable_params
    vllm_params = {"do_remote_prefill": True, "do_remote_decode": False,
                   "remote_engine_id": "e1", "remote_block_ids": [0, 1, 2],
                   "remote_host": "10.0.0.7", "remote_port": 5600, "tp_size": 1}
    assert not usable_params(vllm_params)
    ours = {**vllm_params, "remote_lease_id": "l1", "num_tokens": 48,
            "expires_at": 2e9, "model": "m"}
    assert usable_params(ours)  # the same answer with a lease is taken


def test_kv_transfer_secret_is_owned_immutable_and_random_per_call():
    s = kv_transfer_secret(owner(**PD), "s3cr3t")
    assert s["kind"] == "Secret" and s["metadata"]["name"] == "chat-kv-transfer"
    assert s["immutable"] is True and s["stringData"] == {"secret": "s3cr3t"}
    assert s["metadata"]["ownerReferences"] == [owner().ref]
    assert ("Secret", "chat-kv-transfer") in named_children(owner())
    selector = dict(kv.split("=") for kv in children_selector(owner()).split(","))
    for o in [*children(owner(**PD), 1), s]:
        assert selector.items() <= o["metadata"]["labels"].items(), o["metadata"]["name"]


def test_the_secrets_fingerprint_is_on_both_pools_templates():
    from llmserve.operator.builders import KV_SECRET_ANNOTATION
    from llmserve.operator.prefill import secret_fingerprint
    live = {"data": {"secret": "c2VjcmV0LW9uZQ=="}}
    fp = secret_fingerprint(live)
    assert fp and len(fp) == 16 and "c2Vj" not in fp
    assert secret_fingerprint({"data": {"other": "x"}}) is None
    assert secret_fingerprint({"data": {"secret": "b3RoZXI="}}) != fp
    named = by_name(children(owner(**PD), 1, 1, fp))
    for name in ("chat-engine", "chat-prefill"):
        template = named[("Deployment", name)]["spec"]["template"]["metadata"]
        assert template["annotations"] == {KV_SECRET_ANNOTATION: fp}
    # without spec.prefill nothing reads it, so nothing is stamped
    plain = by_name(children(owner(), 1, 1, fp))[("Deployment", "chat-engine")]
    assert "annotations" not in plain["spec"]["template"]["metadata"]


# --- pruning ------------------------------------------------------------------------------
def live(objs):
    return [{**o, "metadata": {**o["metadata"], "uid": f"live-{i}"}} for i, o in enumerate(objs)]


def test_removing_prefill_prunes_the_pool_and_the_secret_only():
    secret = kv_transfer_secret(owner(**PD), "x")
    was = live([*children(owner(**PD), 1), secret])
    stale = stale_children(owner(), children(owner(), 1), was)
    assert sorted((o["kind"], o["metadata"]["name"]) for o in stale) == [
        ("Deployment", "chat-prefill"), ("NetworkPolicy", "chat-prefill"),
        ("Secret", "chat-kv-transfer"), ("Service", "chat-prefill")]
    # kept while spec.prefill is there (the Secret counts as desired: created once)
    assert stale_children(owner(**PD), [*children(owner(**PD), 1), secret], was) == []
    # a Secret of that name the user made (no owner reference) is theirs: never pruned
    theirs = {**secret, "metadata": {**secret["metadata"], "ownerReferences": [],
                                     "uid": "u"}}
    assert stale_children(owner(), children(owner(), 1), [theirs]) == []


# --- what the engine and the gateway make of the flags -------------------------------------
def cli_args(monkeypatch, command: str, c: dict):
    """The namespace `llmserve <command>` parses from a rendered container's args."""
    from llmserve.entrypoints import cli
    seen = []
    monkeypatch.setattr(cli, f"cmd_{command}", lambda args: seen.append(args) or 0)
    assert c["command"] == ["llmserve", command]
    assert cli.main([command, *c["args"]]) == 0
    return seen[0]


def test_the_engine_and_gateway_accept_the_rendered_flags(monkeypatch):
    from llmserve.entrypoints.cli import engine_config
    objs = children(owner(**PD), 1)
    for name, role in (("chat-prefill", "prefill"), ("chat-engine", "decode")):
        args = cli_args(monkeypatch, "serve", container(objs, name))
        config = engine_config(args)
        assert config.kv_role == role
    prefill = cli_args(monkeypatch, "serve", container(objs, "chat-prefill"))
    assert prefill.kv_transfer_port == 5600
    gw = cli_args(monkeypatch, "gateway", container(objs, "chat-gateway"))
    assert gw.prefill_k8s_service == "team-a/chat-prefill" and gw.k8s_port_name == "http"


# --- autoscaling --------------------------------------------------------------------------
PREFILL_POLICY = Policy.for_prefill({"prefill": {"minReplicas": 1, "maxReplicas": 5,
                                                 "targetWaitingPromptTokens": 4000},
                                     "autoscaling": {"enabled": True, "targetQueueDepth": 2,
                                                     "scaleDownStabilizationSeconds": 0}})


def pool_obs(tokens=0.0, waiting=0.0, kv=0.0, ready=1) -> Observation:
    return Observation(waiting, 0.0, kv, ready, waiting_prompt_tokens=tokens)


def test_prefill_policy_from_the_spec():
    p = Policy.for_prefill({"prefill": {}})
    assert (p.min_replicas, p.max_replicas, p.target_waiting_prompt_tokens) == (1, 4, 4096)
    assert p.target_kv_utilization is None and p.scale_to_zero_after == 0
    assert p.target_queue_depth == Policy.from_spec({}).target_queue_depth
    # the main pool's policy is as it was: no prompt-token target
    assert Policy.from_spec({"prefill": {}}).target_waiting_prompt_tokens is None


@pytest.mark.parametrize("current,o,want,reason", [
    (2, pool_obs(tokens=16000, ready=2), 4, "waiting prompt tokens 16000"),  # 8000 vs 4000
    (2, pool_obs(tokens=8200, ready=2), 2, None),    # 4100 per replica: within tolerance
    (2, pool_obs(waiting=6, ready=2), 3, "queue depth 6"),  # 3 vs 2 per replica
    (2, pool_obs(tokens=16000, waiting=12, ready=2), 5, None),  # larger ask, clamped to 5
    (2, pool_obs(kv=1.0, ready=2), 1, None),         # KV is no signal for prefill
    (3, pool_obs(ready=3), 1, None),                 # idle: down to minReplicas, never 0
    (0, pool_obs(ready=0), 1, "below minReplicas"),  # a new pool starts at its minimum
])
def test_prefill_decision_table(current, o, want, reason):
    d = decide(current, o, PREFILL_POLICY, History(), now=0.0)
    assert d.replicas == want
    if reason:
        assert reason in d.reason


def test_decode_pool_ignores_waiting_prompt_tokens():
    p = Policy.from_spec({"autoscaling": {"enabled": True}})
    assert decide(2, pool_obs(tokens=10**6, ready=2), p, History(), 0.0).replicas == 2


# --- status -------------------------------------------------------------------------------
def test_status_merges_the_autoscaler_and_the_reconcile():
    from llmserve.operator.handlers import update_prefill_status
    patch = type("P", (), {})()
    patch.status = {}
    update_prefill_status(patch, {"desiredReplicas": 3, "lastScaleReason": "x"})
    update_prefill_status(patch, {"readyReplicas": 1, "desiredReplicas": 3, "ready": "1/3"})
    assert patch.status["prefill"] == {"desiredReplicas": 3, "lastScaleReason": "x",
                                       "readyReplicas": 1, "ready": "1/3"}


async def test_prefill_replicas_follow_the_spec_or_the_autoscaler():
    from llmserve.operator.handlers import prefill_replicas
    assert await prefill_replicas(None, owner(prefill={"replicas": 3}), {}) == 3
    auto = owner(prefill={"replicas": 3, "minReplicas": 2},
                 autoscaling={"enabled": True})
    assert await prefill_replicas(None, auto, {"prefill": {"desiredReplicas": 4}}) == 4


# --- the CRD ------------------------------------------------------------------------------
def spec_schema() -> dict:
    crd = yaml.safe_load(CRD.read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]


def validation(schema: dict) -> dict:
    """A property's constraints, without what only documents or defaults it."""
    return {k: v for k, v in schema.items() if k not in ("description", "default")}


def test_crd_prefill_mirrors_engine_and_resources():
    props = spec_schema()["properties"]
    pool = props["prefill"]["properties"]
    assert {"replicas", "minReplicas", "maxReplicas", "resources", "engine"} <= set(pool)
    # the same validation as the main pool's fields, and no defaults (absent = inherited)
    assert set(pool["engine"]["properties"]) == set(PREFILL_ENGINE_KEYS)
    for key, schema in pool["engine"]["properties"].items():
        assert "default" not in schema
        assert validation(schema) == validation(props["engine"]["properties"][key]), key
    assert set(pool["resources"]["properties"]) == set(props["resources"]["properties"])
    for key, schema in pool["resources"]["properties"].items():
        assert "default" not in schema
        assert validation(schema) == validation(props["resources"]["properties"][key]), key
    assert validation(pool["replicas"]) == validation(props["replicas"])
    auto = props["autoscaling"]["properties"]
    assert validation(pool["maxReplicas"]) == validation(auto["maxReplicas"])
    assert pool["minReplicas"]["minimum"] == 1  # the prefill pool never scales to zero
    assert "minReplicas <= self.maxReplicas" in props["prefill"]["x-kubernetes-validations"][0][
        "rule"]


def test_crd_prints_the_prefill_pool():
    crd = yaml.safe_load(CRD.read_text())
    version = crd["spec"]["versions"][0]
    columns = {c["name"]: c for c in version["additionalPrinterColumns"]}
    assert columns["Prefill"]["jsonPath"] == ".status.prefill.ready"
    names = [c["name"] for c in version["additionalPrinterColumns"]]
    assert names.index("Prefill") == names.index("Ready") + 1
    status = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    assert {"readyReplicas", "desiredReplicas", "ready"} <= set(status["prefill"]["properties"])


# --- monitoring ---------------------------------------------------------------------------
@needs_helm
def test_the_chart_monitors_scrape_the_prefill_pool():
    objs = children(owner(**PD), 1)
    pm = of_kind(render("podMonitor.enabled=true"), "PodMonitor")[0]
    pod = by_name(objs)[("Deployment", "chat-prefill")]["spec"]["template"]
    assert selects(pm["spec"]["selector"], pod["metadata"]["labels"])
    sm = of_kind(render("serviceMonitor.enabled=true"), "ServiceMonitor")[0]
    svc = by_name(objs)[("Service", "chat-prefill")]
    assert selects(sm["spec"]["selector"], svc["metadata"]["labels"])
    assert sm["spec"]["endpoints"][0]["port"] in {p["name"] for p in svc["spec"]["ports"]}


class Patch:
    def __init__(self, status=None):
        self.status = dict(status or {})


@pytest.fixture
def prefill_tick(monkeypatch):
    """autoscale_prefill with the pool's scrape and kopf's events stubbed: (run, events)."""
    from llmserve.operator import handlers
    events = []
    monkeypatch.setattr(handlers.kopf, "info", lambda body, reason, message:
                        events.append((reason, message)))
    handlers._histories.pop("uid-123/prefill", None)

    async def run(spec, status, observed, patch_status=None):
        async def observe(o, component="engine"):
            assert component == "prefill"
            return observed
        monkeypatch.setattr(handlers, "observe", observe)
        patch = Patch(patch_status)
        await handlers.autoscale_prefill({"status": status}, patch, owner(**spec))
        return patch.status.get("prefill")
    yield run, events
    handlers._histories.pop("uid-123/prefill", None)


AUTO_PD = {"prefill": {"minReplicas": 1, "maxReplicas": 3},
           "autoscaling": {"enabled": True, "scaleUpStabilizationSeconds": 0}}


async def test_prefill_tick_scales_on_waiting_prompt_tokens(prefill_tick):
    run, events = prefill_tick
    out = await run(AUTO_PD, {"prefill": {"desiredReplicas": 1}},
                    pool_obs(tokens=3 * 4096 + 1, ready=1), {"desiredReplicas": 2})
    assert out["desiredReplicas"] == 3  # 12289 / 4096 -> 4, clamped to maxReplicas 3
    assert out["waitingPromptTokens"] == 3 * 4096 + 1 and "waiting prompt tokens" in \
        out["lastScaleReason"]
    assert events == [("Scaled", f"prefill replicas 1 -> 3: {out['lastScaleReason']}")]


async def test_prefill_tick_follows_the_decode_pool_to_zero(prefill_tick):
    run, events = prefill_tick
    out = await run(AUTO_PD, {"prefill": {"desiredReplicas": 2}},
                    pool_obs(tokens=10**6, ready=2), {"desiredReplicas": 0})
    assert out == {"desiredReplicas": 0} and events == []
    # back with the decode pool: at its minimum
    out = await run(AUTO_PD, {"prefill": {"desiredReplicas": 0}}, pool_obs(ready=0),
                    {"desiredReplicas": 1})
    assert out["desiredReplicas"] == 1
