"""Chaos on a real control plane: the operator killed in the middle of a reconcile,
with the API server crashing and restarting, converges to exactly the children it
should have (no duplicates, no orphans). (An engine pod SIGKILLed under load is in
test_e2e.py, on the engines that file already runs.)"""

from __future__ import annotations

import json
import time

import pytest

from e2e.tests.conftest import OperatorProcess, get_json, wait_for

NS = "chaos"
ENGINE = "app.kubernetes.io/component=engine,serving.llmserve.io/deployment="
GATEWAY = "app.kubernetes.io/component=gateway,serving.llmserve.io/deployment="
CHILD_KINDS = "deployments,services,serviceaccounts,roles,rolebindings,networkpolicies"


@pytest.fixture(scope="module")
def operator(cluster, kubectl, crd):
    kubectl("create", "namespace", NS)
    op = OperatorProcess(cluster, NS).start()
    yield op
    op.stop()


def llmd(name: str, **spec) -> str:
    body = {"model": {"source": "smollm2-135m-instruct", "name": name}, **spec}
    return json.dumps({"apiVersion": "serving.llmserve.io/v1alpha1", "kind": "LLMDeployment",
                       "metadata": {"name": name, "namespace": NS}, "spec": body})


def children(kubectl, name: str) -> dict:
    items = get_json(kubectl, CHILD_KINDS, "-n", NS, "-l",
                     f"serving.llmserve.io/deployment={name}")["items"]
    return {(i["kind"], i["metadata"]["name"]): i for i in items}


def pods(kubectl, selector: str) -> list[dict]:
    return [p for p in get_json(kubectl, "pods", "-n", NS, "-l", selector)["items"]
            if not p["metadata"].get("deletionTimestamp")]


def test_operator_killed_mid_reconcile_and_apiserver_restarted_converge(
        cluster, kubectl, operator):
    # A quota of one Deployment makes the reconcile fail part-way, deterministically:
    # the engine Deployment is created, the gateway's is refused; kopf retries.
    kubectl("create", "quota", "one-deployment", "-n", NS, "--hard=count/deployments.apps=1")
    wait_for(lambda: get_json(kubectl, "quota", "one-deployment", "-n", NS)
             .get("status", {}).get("hard"), 30, what="the quota to be active")
    kubectl("apply", "-f", "-", input=llmd("gamma", replicas=0))
    wait_for(lambda: any(c["type"] == "Degraded" and c["reason"] == "ApplyFailed"
                         for c in get_json(kubectl, "llmd", "gamma", "-n", NS)
                         .get("status", {}).get("conditions", [])),
             60, 0.2, what="the reconcile to fail part-way")
    partial = children(kubectl, "gamma")
    assert ("Deployment", "gamma-engine") in partial
    assert ("Deployment", "gamma-gateway") not in partial
    operator.kill()  # SIGKILL in the middle of its (retrying) reconcile
    t0 = time.monotonic()

    cluster.restart("kube-apiserver")  # a crashed API server, back on the same etcd
    kubectl("delete", "quota", "one-deployment", "-n", NS)
    operator.start()
    # The restarted operator and a spec change made after the API server's restart.
    kubectl("patch", "llmd", "gamma", "-n", NS, "--type=merge",
            "-p", json.dumps({"spec": {"engine": {"maxNumSeqs": 7}}}))

    def converged():
        kids = children(kubectl, "gamma")
        engine = kids.get(("Deployment", "gamma-engine"))
        if len(kids) != 8 or engine is None:
            return None
        args = engine["spec"]["template"]["spec"]["containers"][0]["args"]
        return kids if args[args.index("--max-num-seqs") + 1] == "7" else None

    kids = wait_for(converged, 120, 1.0, what="all 8 children with the new spec")
    print(f"\n[e2e chaos] operator killed with {len(partial)}/8 children applied, API server "
          f"crashed and restarted: converged {time.monotonic() - t0:.0f} s after the kill",
          flush=True)
    body = get_json(kubectl, "llmd", "gamma", "-n", NS)
    uid = body["metadata"]["uid"]
    for key, obj in kids.items():  # each owned once, by this resource: no orphans
        refs = obj["metadata"].get("ownerReferences", [])
        assert [r["uid"] for r in refs] == [uid], (key, refs)
    wait_for(lambda: get_json(kubectl, "llmd", "gamma", "-n", NS)["status"]
             .get("observedGeneration") == body["metadata"]["generation"], 60,
             what="status at the latest generation")
    # No duplicates: one gateway pod for one gateway replica, none for zero engines.
    wait_for(lambda: len(pods(kubectl, GATEWAY + "gamma")) == 1, 90, what="one gateway pod")
    time.sleep(2)
    assert len(pods(kubectl, GATEWAY + "gamma")) == 1 and not pods(kubectl, ENGINE + "gamma")
    kubectl("delete", "llmd", "gamma", "-n", NS, "--wait=true", "--timeout=60s")
    wait_for(lambda: children(kubectl, "gamma") == {}, 90, what="garbage collection")
    assert operator.proc.poll() is None, "the operator survived the API server's restart"
