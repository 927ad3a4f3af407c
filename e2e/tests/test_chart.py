"""helm lint / template on the built helm binary; the values schema rejects bad values."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from e2e.cluster import BIN_DIR

CHART = Path(__file__).resolve().parents[2] / "charts" / "llmserve"


def helm(*args):
    return subprocess.run([str(BIN_DIR / "helm"), *args], capture_output=True, text=True)


def test_helm_lint_is_clean():
    r = helm("lint", "--strict", str(CHART))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 chart(s) failed" in r.stdout


def test_template_renders_labelled_least_privilege_objects():
    r = helm("template", "rel", str(CHART), "--namespace", "ops", "--include-crds",
             "--set", "serviceMonitor.enabled=true", "--set", "operator.watchNamespaces={a,b}")
    assert r.returncode == 0, r.stderr
    docs = [d for d in yaml.safe_load_all(r.stdout) if d]
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == ["ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition",
                     "Deployment", "ServiceAccount", "ServiceMonitor"]
    for d in docs:
        if d["kind"] != "CustomResourceDefinition":
            labels = d["metadata"]["labels"]
            assert labels["app.kubernetes.io/managed-by"] == "Helm"
            assert labels["app.kubernetes.io/instance"] == "rel"
    role = next(d for d in docs if d["kind"] == "ClusterRole")
    verbs = {v for rule in role["rules"] for v in rule["verbs"]}
    assert "*" not in verbs
    # delete: only the kinds of child the operator prunes (tests/test_chart_static.py
    # checks they are exactly kube.CHILD_KINDS and kube.NAMED_CHILD_KINDS)
    deletable = {r for rule in role["rules"] if "delete" in rule["verbs"]
                 for r in rule["resources"]}
    assert deletable == {"deployments", "services", "serviceaccounts", "roles",
                         "rolebindings", "networkpolicies", "secrets"}
    # Secrets: by name only (the tenants Secret an LLMDeployment names; the P/D
    # kv-transfer Secret it creates and prunes); never list or watch, so the operator
    # cannot enumerate or read Secrets it is not pointed at.
    for rule in role["rules"]:
        if "secrets" in rule["resources"]:
            assert rule["resources"] == ["secrets"], rule
            assert rule["verbs"] == ["get", "create", "delete"], rule
    dep = next(d for d in docs if d["kind"] == "Deployment")
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=a" in args and "--namespace=b" in args


@pytest.mark.parametrize("bad", [
    ["--set", "operator.replicas=3"],
    ["--set", "operator.logLevel=LOUD"],
    ["--set", "image.pullPolicy=Sometimes"],
    ["--set", "serviceMonitor.interval=often"],
    ["--set", "unknownKey=1"],
])
def test_schema_rejects_bad_values(bad):
    r = helm("template", "rel", str(CHART), *bad)
    assert r.returncode != 0 and "values don't meet the specifications of the schema" in r.stderr
