"""The operator and the CRD against a real API server (no pods need to run here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from e2e.tests.conftest import OperatorProcess, get_json, wait_for

ROOT = Path(__file__).resolve().parents[2]
NS = "op-test"


@pytest.fixture(scope="module")
def namespace(kubectl, crd):
    kubectl("create", "namespace", NS)
    yield NS


@pytest.fixture(scope="module")
def operator(cluster, namespace):
    op = OperatorProcess(cluster, namespace).start()
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


def test_chart_crd_matches(kubectl, crd):
    live = get_json(kubectl, "crd", "llmdeployments.serving.llmserve.io")
    want = yaml.safe_load((ROOT / "crds" / "llmdeployments.serving.llmserve.io.yaml").read_text())
    assert live["spec"]["versions"][0]["schema"] == want["spec"]["versions"][0]["schema"]
