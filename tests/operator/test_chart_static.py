"""Chart and CRD checks that need no cluster: one CRD source, valid examples."""

from __future__ import annotations

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
CRD = ROOT / "crds" / "llmdeployments.serving.llmserve.io.yaml"


def test_the_chart_links_the_one_crd_source():
    """crds/ holds the CRD's only copy; the chart's crds/ is a link to it, which Helm
    follows (lint, template, install; `helm package` stores the file itself)."""
    chart_crds = ROOT / "charts" / "llmserve" / "crds"
    assert chart_crds.is_symlink() and chart_crds.resolve() == CRD.parent, \
        "charts/llmserve/crds must be a link to ../../crds, not a copy"
    chart_crd = chart_crds / CRD.name
    assert chart_crd.read_text() == CRD.read_text()


def test_crd_has_subresources_and_printer_columns():
    crd = yaml.safe_load(CRD.read_text())
    version = crd["spec"]["versions"][0]
    assert crd["spec"]["names"]["shortNames"] == ["llmd"]
    assert version["subresources"]["scale"]["specReplicasPath"] == ".spec.replicas"
    assert "status" in version["subresources"]
    columns = {c["name"] for c in version["additionalPrinterColumns"]}
    assert {"Model", "Replicas", "Ready", "Queue", "KV", "Endpoint", "Age"} <= columns


def test_examples_build_children():
    from llmserve.operator.builders import Owner, children
    examples = sorted((ROOT / "examples").glob("*.yaml"))
    assert len(examples) >= 4
    for path in examples:
        doc = yaml.safe_load(path.read_text())
        assert doc["kind"] == "LLMDeployment"
        objs = children(Owner(doc["metadata"]["name"], "default", "uid", doc["spec"]), 1)
        # a prefill pool (spec.prefill) adds its Deployment, Service and NetworkPolicy
        assert len(objs) == (11 if doc["spec"].get("prefill") else 8), path.name


def cluster_role_rules() -> list[dict]:
    """The ClusterRole's rules, read from the template (its Helm lines left out)."""
    text = (ROOT / "charts" / "llmserve" / "templates" / "clusterrole.yaml").read_text()
    plain = "\n".join(line for line in text.splitlines() if "{{" not in line)
    return next(d for d in yaml.safe_load_all(plain) if d["kind"] == "ClusterRole")["rules"]


def test_cluster_role_deletes_exactly_the_kinds_the_operator_prunes():
    from llmserve.operator.kube import CHILD_KINDS, NAMED_CHILD_KINDS
    rules = cluster_role_rules()
    assert all("*" not in r["verbs"] and "*" not in r["resources"] for r in rules)
    deletable = {(g, res) for r in rules if "delete" in r["verbs"]
                 for g in r["apiGroups"] for res in r["resources"]}
    pruned = {**CHILD_KINDS, **NAMED_CHILD_KINDS}
    assert deletable == {(k.group, k.resource) for k in pruned.values()}
    # The kinds pruned by name are never listed: a list of Secrets returns their data.
    listable = {(g, res) for r in rules if {"list", "watch"} & set(r["verbs"])
                for g in r["apiGroups"] for res in r["resources"]}
    assert not listable & {(k.group, k.resource) for k in NAMED_CHILD_KINDS.values()}
