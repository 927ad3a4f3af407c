"""The operator and the CRD against a real API server (no pods need to run here)."""

from __future__ import annotations

import base64
import json
import re
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from e2e.cluster import free_port
from e2e.tests.conftest import OperatorProcess, get_json, wait_for
from tests.operator.test_chart_monitoring import (
    ALL_ON,
    dashboard_exprs,
    exported_names,
    metric_names,
    render,
    rule_exprs,
)

ROOT = Path(__file__).resolve().parents[2]
NS = "op-test"


@pytest.fixture(scope="module")
def namespace(kubectl, crd):
    kubectl("create", "namespace", NS)
    yield NS


@pytest.fixture(scope="module")
def operator(cluster, namespace):
    op = OperatorProcess(cluster, namespace)
    port = free_port()
    op.args += ["--metrics-port", str(port)]
    op.metrics_url = f"http://127.0.0.1:{port}/metrics"
    op.start()
    yield op
    op.stop()


def llmd(name, **spec):
    body = {"model": {"source": "smollm2-135m-instruct", "name": "smol"}, **spec}
    return json.dumps({"apiVersion": "serving.llmserve.io/v1alpha1", "kind": "LLMDeployment",
                       "metadata": {"name": name, "namespace": NS}, "spec": body})


def test_examples_are_accepted_by_the_api_server(kubectl, namespace):
    for path in sorted((ROOT / "examples").glob("*.yaml")):
        r = kubectl("apply", "--dry-run=server", "-n", NS, "-f", str(path), check=False)
        assert r.returncode == 0, f"{path.name}: {r.stderr}"


@pytest.mark.parametrize("spec,message", [
    ({"autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 2}},
     "minReplicas must not exceed"),
    ({"autoscaling": {"enabled": True, "minReplicas": 0, "maxReplicas": 2}},
     "scaleToZeroAfterSeconds"),
    ({"model": {"source": "s3://bucket/model"}}, "must be a built-in name"),
    ({"engine": {"kind": "tgi"}}, "Unsupported value"),
    ({"replicas": -1}, "should be greater than or equal to 0"),
    ({"gateway": {"loadFactor": 0.5}}, "should be greater than or equal to 1"),
    ({"resources": {"memory": "lots"}}, "should match"),
    ({"prefill": {"minReplicas": 3, "maxReplicas": 2}}, "prefill.minReplicas must not exceed"),
    ({"prefill": {"minReplicas": 0}}, "should be greater than or equal to 1"),
    ({"prefill": {"resources": {"memory": "lots"}}}, "should match"),
    ({"prefill": {"engine": {"kind": "vllm"}}}, 'unknown field "spec.prefill.engine.kind"'),
    ({"observability": {"otlpTracesEndpoint": "otel:4317"}}, "should match"),
])
def test_invalid_specs_are_rejected(kubectl, namespace, spec, message):
    r = kubectl("apply", "-f", "-", input=llmd("bad", **spec), check=False)
    assert r.returncode != 0 and message in r.stderr, r.stderr


def children_of(kubectl, name):
    kinds = "deployments,services,serviceaccounts,roles,rolebindings,networkpolicies"
    items = get_json(kubectl, kinds, "-n", NS, "-l",
                     f"serving.llmserve.io/deployment={name}")["items"]
    return {(i["kind"], i["metadata"]["name"]): i for i in items}


def test_reconcile_creates_owned_children_and_status(kubectl, operator):
    kubectl("apply", "-f", "-", input=llmd("alpha", replicas=2))
    kids = wait_for(lambda: (k := children_of(kubectl, "alpha")) and len(k) == 8 and k,
                    60, what="8 children")
    uid = get_json(kubectl, "llmd", "alpha", "-n", NS)["metadata"]["uid"]
    for obj in kids.values():
        assert obj["metadata"]["ownerReferences"][0]["uid"] == uid
    assert kids[("Deployment", "alpha-engine")]["spec"]["replicas"] == 2
    status = wait_for(lambda: (s := get_json(kubectl, "llmd", "alpha", "-n", NS)
                               .get("status", {})).get("conditions") and s, 60,
                      what="status conditions")
    types = {c["type"]: c for c in status["conditions"]}
    assert set(types) == {"Ready", "Progressing", "Degraded"}
    assert types["Degraded"]["status"] == "False"
    assert status["selector"] and status["endpoint"].startswith("http://alpha-gateway.")
    printed = kubectl("get", "llmd", "alpha", "-n", NS).stdout
    assert "MODEL" in printed and "smol" in printed


def test_kubectl_scale_uses_the_scale_subresource(kubectl, operator):
    kubectl("scale", "llmd", "alpha", "-n", NS, "--replicas", "3")
    assert get_json(kubectl, "llmd", "alpha", "-n", NS)["spec"]["replicas"] == 3
    wait_for(lambda: children_of(kubectl, "alpha")[("Deployment", "alpha-engine")]
             ["spec"]["replicas"] == 3, 60, what="engine Deployment at 3 replicas")


def test_drift_is_repaired(kubectl, operator):
    kubectl("delete", "service", "alpha-engine", "-n", NS)
    kubectl("patch", "networkpolicy", "alpha-engine", "-n", NS, "--type=json",
            "-p", '[{"op": "replace", "path": "/spec/policyTypes", "value": ["Egress"]}]')
    wait_for(lambda: ("Service", "alpha-engine") in children_of(kubectl, "alpha"), 60,
             what="the deleted Service to come back")
    wait_for(lambda: children_of(kubectl, "alpha")[("NetworkPolicy", "alpha-engine")]
             ["spec"]["policyTypes"] == ["Ingress"], 60, what="the edited policy restored")


def test_unrealisable_spec_is_degraded_with_an_event(kubectl, operator):
    kubectl("apply", "-f", "-", input=llmd("ghost", model={"source": "no-such-model"}))
    cond = wait_for(lambda: {c["type"]: c for c in get_json(kubectl, "llmd", "ghost", "-n", NS)
                             .get("status", {}).get("conditions", [])}.get("Degraded"),
                    60, what="Degraded")
    assert cond["status"] == "True" and "not a built-in model" in cond["message"]
    events = get_json(kubectl, "events", "-n", NS,
                      "--field-selector", "involvedObject.name=ghost")["items"]
    assert any(e["reason"] == "InvalidSpec" for e in events)
    assert children_of(kubectl, "ghost") == {}
    assert operator.proc.poll() is None, "the operator must not crash"


def test_operator_restart_converges(cluster, kubectl, operator):
    operator.kill()
    kubectl("apply", "-f", "-", input=llmd("beta", replicas=1))  # while it is down
    kubectl("delete", "deployment", "alpha-gateway", "-n", NS)
    operator.start()
    wait_for(lambda: len(children_of(kubectl, "beta")) == 8, 90, what="beta's children")
    wait_for(lambda: ("Deployment", "alpha-gateway") in children_of(kubectl, "alpha"), 90,
             what="alpha's gateway back")


def test_deletion_cascades(kubectl, operator):
    kubectl("delete", "llmd", "alpha", "-n", NS, "--wait=true", "--timeout=60s")
    wait_for(lambda: children_of(kubectl, "alpha") == {}, 90,
             what="garbage collection of alpha's children")


def test_operator_metrics_serve_every_name_the_alerts_and_dashboards_use(kubectl, operator):
    """A real operator's /metrics after it autoscaled an LLMDeployment (whose engine
    asks for a GPU, so no engine process starts) and failed to reconcile another."""
    kubectl("apply", "-f", "-", input=llmd(
        "scaled", model={"source": "hf://Qwen/Qwen2.5-7B-Instruct", "name": "q"},
        resources={"gpus": 1}, autoscaling={"enabled": True, "minReplicas": 1,
                                            "maxReplicas": 3}))
    kubectl("apply", "-f", "-", input=llmd("broken", model={"source": "no-such-model"}))

    def scraped():
        try:
            with urllib.request.urlopen(operator.metrics_url, timeout=5) as r:
                text = r.read().decode()
        except OSError:  # the operator is still starting
            return None
        return (re.search(r'autoscaler_max_replicas\{[^}]*llmdeployment="scaled"[^}]*\} 3', text)
                and 'reason="InvalidSpec"' in text and text)
    text = wait_for(scraped, 60, what="the autoscaler's and the reconcile errors' series")
    used = {n for e in [*dashboard_exprs(), *rule_exprs(render(*ALL_ON)).values()]
            for n in metric_names(e) if n.startswith("llmserve_operator_")}
    assert "llmserve_operator_autoscaler_desired_replicas" in used
    samples = {line.split("{")[0] for line in text.splitlines() if not line.startswith("#")}
    assert used <= exported_names(text), sorted(used - exported_names(text))
    # with samples, but for the prefill pool's signal (this deployment has no prefill pool)
    main_pool = {n for n in used if "prompt_tokens" not in n}
    assert main_pool <= samples, sorted(main_pool - samples)
    assert re.search(r'autoscaler_desired_replicas\{[^}]*llmdeployment="scaled"[^}]*'
                     r'namespace="op-test",pool="engine"\} 1', text), "minReplicas at start"
    kubectl("delete", "llmd", "scaled", "broken", "-n", NS)


def test_chart_crd_matches(kubectl, crd):
    live = get_json(kubectl, "crd", "llmdeployments.serving.llmserve.io")
    want = yaml.safe_load((ROOT / "crds" / "llmdeployments.serving.llmserve.io.yaml").read_text())
    assert live["spec"]["versions"][0]["schema"] == want["spec"]["versions"][0]["schema"]


# --- spec.prefill (issue 28) ----------------------------------------------------------------
PD_KINDS = {("Deployment", "pd-prefill"), ("Service", "pd-prefill"),
            ("NetworkPolicy", "pd-prefill")}


def secret(kubectl, name):
    r = kubectl("get", "secret", name, "-n", NS, "-o", "json", check=False)
    return json.loads(r.stdout) if r.returncode == 0 else None


def status_of(kubectl, name):
    return get_json(kubectl, "llmd", name, "-n", NS).get("status") or {}


def test_prefill_renders_the_pool_and_a_secret_once(kubectl, operator):
    # Zero replicas: the children are the point (the prefill pool follows the decode
    # pool to zero, so no engine process starts here).
    kubectl("apply", "-f", "-", input=llmd("pd", replicas=0, prefill={"replicas": 1}))
    kids = wait_for(lambda: (k := children_of(kubectl, "pd")) and len(k) == 11 and k, 60,
                    what="11 children")
    assert PD_KINDS <= set(kids)
    uid = get_json(kubectl, "llmd", "pd", "-n", NS)["metadata"]["uid"]
    s = wait_for(lambda: secret(kubectl, "pd-kv-transfer"), 30, what="the Secret")
    assert s["metadata"]["ownerReferences"][0]["uid"] == uid and s["immutable"] is True
    assert len(base64.b64decode(s["data"]["secret"])) >= 32
    pool = kids[("Deployment", "pd-prefill")]
    assert pool["spec"]["replicas"] == 0
    c = pool["spec"]["template"]["spec"]["containers"][0]
    assert c["args"][c["args"].index("--kv-role") + 1] == "prefill"
    gw = kids[("Deployment", "pd-gateway")]["spec"]["template"]["spec"]["containers"][0]
    assert f"{NS}/pd-prefill" in gw["args"]
    status = wait_for(lambda: (s := status_of(kubectl, "pd")).get("prefill") and s, 60,
                      what="status.prefill")
    assert status["prefill"]["ready"] == "0/0"
    printed = kubectl("get", "llmd", "pd", "-n", NS).stdout.splitlines()
    assert "PREFILL" in printed[0].split() and "0/0" in printed[1].split()
    # Later reconciles (a spec change, the timer's passes) never rotate it.
    kubectl("patch", "llmd", "pd", "-n", NS, "--type=merge",
            "-p", '{"spec": {"gateway": {"prefixChars": 64}}}')
    generation = get_json(kubectl, "llmd", "pd", "-n", NS)["metadata"]["generation"]
    wait_for(lambda: status_of(kubectl, "pd").get("observedGeneration") == generation, 60,
             what="the change reconciled")
    time.sleep(11)  # one more timer pass
    again = secret(kubectl, "pd-kv-transfer")
    assert (again["metadata"]["uid"], again["data"]) == (s["metadata"]["uid"], s["data"])
    stamps = pool_stamps(kubectl, "pd")
    assert len(set(stamps.values())) == 1 and None not in stamps.values(), stamps


def pool_stamps(kubectl, name) -> dict:
    """The kv-transfer Secret fingerprint on each pool's pod template."""
    kids = children_of(kubectl, name)
    return {n: kids[("Deployment", n)]["spec"]["template"]["metadata"].get("annotations", {})
            .get("serving.llmserve.io/kv-transfer-secret")
            for n in (f"{name}-engine", f"{name}-prefill")}


def test_a_secret_deleted_by_hand_is_recreated_and_rolls_both_pools(kubectl, operator):
    before = secret(kubectl, "pd-kv-transfer")
    stamps = pool_stamps(kubectl, "pd")
    kubectl("delete", "secret", "pd-kv-transfer", "-n", NS)
    after = wait_for(lambda: (s := secret(kubectl, "pd-kv-transfer"))
                     and s["metadata"]["uid"] != before["metadata"]["uid"] and s, 60,
                     what="the Secret recreated")
    assert after["data"] != before["data"]  # a new random value
    new = wait_for(lambda: (p := pool_stamps(kubectl, "pd")) and p != stamps
                   and len(set(p.values())) == 1 and p, 60,
                   what="both pools' templates stamped with the new value")
    assert None not in new.values()


def test_removing_prefill_prunes_the_pool_and_the_secret(kubectl, operator):
    before = {k: v["metadata"]["uid"] for k, v in children_of(kubectl, "pd").items()}
    assert PD_KINDS <= set(before)
    kubectl("patch", "llmd", "pd", "-n", NS, "--type=json",
            "-p", '[{"op": "remove", "path": "/spec/prefill"}]')
    wait_for(lambda: not PD_KINDS & set(children_of(kubectl, "pd"))
             and secret(kubectl, "pd-kv-transfer") is None, 60,
             what="the prefill pool and the Secret pruned")
    after = {k: v["metadata"]["uid"] for k, v in children_of(kubectl, "pd").items()}
    assert after == {k: uid for k, uid in before.items() if k not in PD_KINDS}
    gw = children_of(kubectl, "pd")[("Deployment", "pd-gateway")]
    assert "--prefill-k8s-service" not in gw["spec"]["template"]["spec"]["containers"][0]["args"]
    wait_for(lambda: "prefill" not in status_of(kubectl, "pd"), 30, what="status.prefill gone")
    events = get_json(kubectl, "events", "-n", NS,
                      "--field-selector", "involvedObject.name=pd")["items"]
    assert any(e["reason"] == "Pruned" and "pd-kv-transfer" in e["message"] for e in events)
    kubectl("delete", "llmd", "pd", "-n", NS)


def test_a_users_own_secret_is_used_and_never_pruned(kubectl, operator):
    kubectl("create", "secret", "generic", "byo-kv-transfer", "-n", NS,
            "--from-literal=secret=chosen-by-the-user")
    kubectl("apply", "-f", "-", input=llmd("byo", replicas=0, prefill={}))
    wait_for(lambda: ("Deployment", "byo-prefill") in children_of(kubectl, "byo"), 60,
             what="the prefill pool")
    kubectl("patch", "llmd", "byo", "-n", NS, "--type=json",
            "-p", '[{"op": "remove", "path": "/spec/prefill"}]')
    wait_for(lambda: ("Deployment", "byo-prefill") not in children_of(kubectl, "byo"), 60,
             what="the prefill pool pruned")
    s = secret(kubectl, "byo-kv-transfer")
    assert base64.b64decode(s["data"]["secret"]) == b"chosen-by-the-user"
    assert not s["metadata"].get("ownerReferences")
    kubectl("delete", "llmd", "byo", "-n", NS)
    kubectl("delete", "secret", "byo-kv-transfer", "-n", NS)


def test_prefill_pools_that_cannot_work_are_degraded(kubectl, operator):
    spec = {"model": {"source": "hf://Qwen/Qwen2.5-7B-Instruct", "name": "q"},
            "resources": {"gpus": 2}, "replicas": 0}
    cases = [("vllm-pd", {**spec, "engine": {"kind": "vllm"}, "prefill": {}},
              "needs engine.kind llmserve"),
             ("split-pd", {**spec, "prefill": {"resources": {"gpus": 1}}},
              "tensor-parallel size 2")]
    for name, body, _ in cases:
        kubectl("apply", "-f", "-", input=llmd(name, **body))
    for name, _, message in cases:
        cond = wait_for(lambda n=name: {c["type"]: c for c in status_of(kubectl, n)
                                        .get("conditions", [])}.get("Degraded"), 60,
                        what=f"{name} Degraded")
        assert cond["status"] == "True" and message in cond["message"], cond
        assert children_of(kubectl, name) == {}
        kubectl("delete", "llmd", name, "-n", NS)
