"""helm lint / template on the built helm binary; the values schema rejects bad values."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from e2e.cluster import BIN_DIR
from e2e.tests.conftest import wait_for

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
    # the second ServiceMonitor and the Service: the operator's own /metrics
    assert kinds == ["ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition",
                     "Deployment", "Service", "ServiceAccount", "ServiceMonitor",
                     "ServiceMonitor"]
    for d in docs:
        if d["kind"] != "CustomResourceDefinition":
            labels = d["metadata"]["labels"]
            assert labels["app.kubernetes.io/managed-by"] == "Helm"
            assert labels["app.kubernetes.io/instance"] == "rel"
    role = next(d for d in docs if d["kind"] == "ClusterRole")
    verbs = {v for rule in role["rules"] for v in rule["verbs"]}
    assert "*" not in verbs
    # delete: only the kinds of child the operator prunes (tests/operator/test_chart_static.py
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


# --- every monitoring toggle against the API server (issue 34) -----------------------------
DRY_RUN_NS = "chart-dry-run"
MONITORING_KINDS = ("servicemonitors.monitoring.coreos.com",
                    "podmonitors.monitoring.coreos.com", "prometheusrules.monitoring.coreos.com")


@pytest.fixture(scope="module")
def monitoring_crds(kubectl):
    """The Prometheus Operator's CRDs (pinned, from the Go module proxy; cached)."""
    script = CHART.parents[1] / "e2e" / "controlplane" / "prometheus_operator_crds.sh"
    r = subprocess.run(["bash", str(script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    kubectl("apply", "--server-side", "-f", r.stdout.strip().splitlines()[-1])
    wait_for(lambda: kubectl("get", ",".join(MONITORING_KINDS), "-A", check=False)
             .returncode == 0, 60, what="the monitoring CRDs served")
    kubectl("create", "namespace", DRY_RUN_NS)


def dry_run(kubectl, *sets: str):
    args = [a for s in sets for a in ("--set", s)]
    r = helm("template", "rel", str(CHART), "--namespace", DRY_RUN_NS, "--include-crds", *args)
    assert r.returncode == 0, r.stderr
    kinds = sorted(d["kind"] for d in yaml.safe_load_all(r.stdout) if d)
    applied = kubectl("apply", "--dry-run=server", "-f", "-", input=r.stdout, check=False)
    return kinds, applied


@pytest.mark.parametrize("monitor", ["serviceMonitor", "podMonitor"])
def test_every_monitoring_toggle_passes_the_api_servers_dry_run(kubectl, monitoring_crds, monitor):
    kinds, r = dry_run(kubectl, f"{monitor}.enabled=true", "prometheusRule.enabled=true",
                       "grafana.dashboards.enabled=true", f"{monitor}.labels.release=prom",
                       "operator.otlpTracesEndpoint=http://otel.monitoring:4318")
    kind = monitor[0].upper() + monitor[1:]
    assert kinds.count(kind) == 2 and kinds.count("ConfigMap") == 3, kinds
    assert "PrometheusRule" in kinds
    assert r.returncode == 0, r.stderr
    # one line per object, each accepted by the API server's own validation
    assert r.stdout.count("(server dry run)") == len(kinds), r.stdout
    assert f"{kind.lower()}.monitoring.coreos.com/rel-llmserve-operator created" in r.stdout


def test_the_dry_run_rejects_what_the_values_schema_lets_through(kubectl, monitoring_crds):
    # The chart's schema types label values as strings; Kubernetes' label syntax is the
    # API server's to check.
    _, r = dry_run(kubectl, "prometheusRule.enabled=true",
                   "prometheusRule.labels.team=not a label value!")
    assert r.returncode != 0
    assert "PrometheusRule" in r.stderr and "metadata.labels" in r.stderr, r.stderr
