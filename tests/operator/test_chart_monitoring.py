"""The chart's monitoring toggles (ServiceMonitor, PodMonitor, PrometheusRule, Grafana
dashboards) through the real helm binary, and every metric name their PromQL uses
against what a real engine and a real gateway export after serving traffic, and what
the operator's metrics server serves after autoscaler decisions (a whole operator
needs a control plane: e2e/tests/test_operator_api.py scrapes one)."""

from __future__ import annotations

import json
import re
import subprocess
import urllib.request
from pathlib import Path

import openai
import pytest
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from e2e.cluster import BIN_DIR
from llmserve.entrypoints.launcher import ServerProcess
from llmserve.operator import metrics as operator_metrics
from llmserve.operator.autoscaler import History, Observation, Policy, decide
from llmserve.operator.builders import Owner, children, names
from tests.server_proc import ServerProcess as EngineProcess

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "llmserve"
HELM = BIN_DIR / "helm"
needs_helm = pytest.mark.skipif(not HELM.exists(),
                                reason=f"{HELM} missing: `make controlplane` builds helm")

ALL_ON = ["prometheusRule.enabled=true", "grafana.dashboards.enabled=true"]
SPEC = {"model": {"name": "smollm2-135m-instruct", "source": "smollm2-135m-instruct"}}
# Kubernetes object state no llmserve component exports; kube-state-metrics does.
EXTERNAL = {"kube_deployment_spec_replicas", "kube_deployment_status_replicas_ready"}


def helm_template(*sets: str, check: bool = True) -> subprocess.CompletedProcess:
    args = [a for s in sets for a in ([s] if s.startswith("--") else ["--set", s])]
    r = subprocess.run([str(HELM), "template", "rel", str(CHART), "--namespace", "ops", *args],
                       capture_output=True, text=True)
    assert r.returncode == 0 or not check, r.stderr
    return r


def render(*sets: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(helm_template(*sets).stdout) if d]


def of_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def dashboards() -> dict[str, dict]:
    paths = sorted((CHART / "dashboards").glob("*.json"))
    return {p.name: json.loads(p.read_text()) for p in paths}


def panels(board: dict) -> list[dict]:
    return [p for p in board["panels"] if p["type"] != "row"]


# --- PromQL -> metric names ---------------------------------------------------------
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or",
            "unless", "offset", "bool", "inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression: identifiers left once strings, label
    matchers, ranges, grouping lists, Grafana variables, numbers and function calls
    are taken out."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    e = re.sub(r"\{[^}]*\}", "", e)
    e = re.sub(r"\[[^\]]*\]", "", e)
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", e)
    e = re.sub(r"\$\w+", "", e)
    e = re.sub(r"(?<![\w:])\d+(\.\d+)?([eE][+-]?\d+)?[a-z]*", "", e)
    return {m.group() for m in re.finditer(r"(?<![\w:])[a-zA-Z_:][\w:]*", e)
            if m.group() not in KEYWORDS and not re.match(r"\s*\(", e[m.end():])}


def test_metric_names_finds_names_and_nothing_else():
    expr = ('histogram_quantile(0.99, sum by (namespace, le) (rate(vllm:ttft_bucket'
            '{llmdeployment=~"$deployment", code=~"5.."}[$__rate_interval]))) > 1.5e3 and on '
            '(pod) label_replace(changes(kube_x{d=~".+-engine"}[5m] offset 1h) == 0, "a", "$1",'
            ' "b", "(.+)") / ignoring (tenant) group_left sum(llmserve_y_total)')
    assert metric_names(expr) == {"vllm:ttft_bucket", "kube_x", "llmserve_y_total"}


def rule_exprs(docs: list[dict]) -> dict[str, str]:
    rule = of_kind(docs, "PrometheusRule")[0]
    return {r["alert"]: r["expr"] for g in rule["spec"]["groups"] for r in g["rules"]}


def dashboard_exprs() -> list[str]:
    """The panels' queries, and the series of the template variables' label_values()."""
    boards = dashboards().values()
    variables = [re.fullmatch(r"label_values\((.+), \w+\)", v["query"]["query"]).group(1)
                 for b in boards for v in b["templating"]["list"] if v["type"] == "query"]
    return [t["expr"] for b in boards for p in panels(b) for t in p["targets"]] + variables


# --- helm template ------------------------------------------------------------------
@needs_helm
def test_toggles_off_render_no_monitoring_objects():
    kinds = sorted(d["kind"] for d in render())
    assert kinds == ["ClusterRole", "ClusterRoleBinding", "Deployment", "ServiceAccount"]


@needs_helm
def test_service_monitor_selects_the_operators_services_but_not_the_peers():
    docs = render("serviceMonitor.enabled=true", "serviceMonitor.labels.release=prom")
    assert [d["kind"] for d in docs if "monitoring" in d["apiVersion"]] == ["ServiceMonitor"] * 2
    sm = named(of_kind(docs, "ServiceMonitor"), "rel-llmserve-workloads")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert sm["metadata"]["labels"]["release"] == "prom"
    (ep,) = sm["spec"]["endpoints"]
    owner = Owner("chat", "team-a", "uid", {**SPEC, "gateway": {"tenantsSecret": {"name": "t"}}})
    services = of_kind(children(owner, 1), "Service")
    assert len(services) == 3  # engine (headless), gateway, gateway peers
    drop = next(r for r in ep["relabelings"] if r.get("action") == "drop")
    scraped = {s["metadata"]["name"] for s in services
               if selects(sm["spec"]["selector"], s["metadata"]["labels"])
               and not re.fullmatch(drop["regex"], s["metadata"]["name"])}
    assert scraped == {names(owner)["engine"], names(owner)["gateway"]}
    for s in services:
        assert ep["port"] in {p["name"] for p in s["spec"]["ports"]}
    check_endpoint(ep)


@needs_helm
def test_service_monitor_scrapes_the_operators_metrics_port():
    docs = render("serviceMonitor.enabled=true", "serviceMonitor.labels.release=prom")
    sm = named(of_kind(docs, "ServiceMonitor"), "rel-llmserve-operator")
    assert sm["metadata"]["labels"]["release"] == "prom"
    assert sm["spec"]["namespaceSelector"] == {"matchNames": ["ops"]}
    (service,) = [s for s in of_kind(docs, "Service")
                  if matches(sm["spec"]["selector"], s["metadata"]["labels"])]
    (ep,) = sm["spec"]["endpoints"]
    assert ep["path"] == "/metrics" and ep["honorLabels"] is True
    (port,) = [p for p in service["spec"]["ports"] if p["name"] == ep["port"]]
    pod = of_kind(docs, "Deployment")[0]["spec"]["template"]
    assert matches({"matchLabels": service["spec"]["selector"]}, pod["metadata"]["labels"])
    check_operator_port(pod, port["targetPort"])


def named(docs: list[dict], name: str) -> dict:
    (doc,) = [d for d in docs if d["metadata"]["name"] == name]
    return doc


def matches(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector["matchLabels"].items())


def check_operator_port(pod: dict, port_name: str) -> None:
    """The operator container serves --metrics-port on the named container port."""
    (container,) = pod["spec"]["containers"]
    (port,) = [p for p in container["ports"] if p["name"] == port_name]
    assert f"--metrics-port={port['containerPort']}" in container["args"]


@needs_helm
def test_pod_monitor_selects_the_operators_engine_and_gateway_pods():
    docs = render("podMonitor.enabled=true", "podMonitor.interval=30s")
    pm = named(of_kind(docs, "PodMonitor"), "rel-llmserve-workloads")
    assert [d["kind"] for d in docs if "monitoring" in d["apiVersion"]] == ["PodMonitor"] * 2
    (ep,) = pm["spec"]["podMetricsEndpoints"]
    assert ep["interval"] == "30s"
    owner = Owner("chat", "team-a", "uid", SPEC)
    pods = {d["metadata"]["name"]: d["spec"]["template"] for d in of_kind(children(owner, 1),
                                                                          "Deployment")}
    assert set(pods) == {names(owner)["engine"], names(owner)["gateway"]}
    for pod in pods.values():
        assert selects(pm["spec"]["selector"], pod["metadata"]["labels"])
        ports = {p["name"] for c in pod["spec"]["containers"] for p in c["ports"]}
        assert ep["port"] in ports
    check_endpoint(ep, pod_labels=pods[names(owner)["engine"]]["metadata"]["labels"])
    # The chart's operator pod is scraped by its own monitor, with its own labels kept.
    operator = of_kind(docs, "Deployment")[0]["spec"]["template"]
    assert not selects(pm["spec"]["selector"], operator["metadata"]["labels"])
    own = named(of_kind(docs, "PodMonitor"), "rel-llmserve-operator")
    assert matches(own["spec"]["selector"], operator["metadata"]["labels"])
    (ep,) = own["spec"]["podMetricsEndpoints"]
    assert ep["honorLabels"] is True and ep["interval"] == "30s"
    check_operator_port(operator, ep["port"])


def selects(selector: dict, labels: dict) -> bool:
    assert set(selector) == {"matchExpressions"}
    return all(labels.get(e["key"]) in e["values"] for e in selector["matchExpressions"]
               if e["operator"] == "In")


def check_endpoint(ep: dict, pod_labels: dict | None = None) -> None:
    """/metrics, and the target labels the dashboards and rules group by, from pod
    labels the operator sets (Prometheus writes `a.b/c` as `a_b_c`)."""
    assert ep["path"] == "/metrics"
    targets = {r["targetLabel"]: r["sourceLabels"][0] for r in ep["relabelings"]
               if "targetLabel" in r}
    assert set(targets) == {"llmdeployment", "component"}
    if pod_labels:
        meta = {"__meta_kubernetes_pod_label_" + re.sub(r"[^\w]", "_", k): v
                for k, v in pod_labels.items()}
        assert meta[targets["llmdeployment"]] == "chat"
        assert meta[targets["component"]] == "engine"


@needs_helm
def test_both_monitors_at_once_is_refused():
    r = helm_template("serviceMonitor.enabled=true", "podMonitor.enabled=true", check=False)
    assert r.returncode != 0 and "turn on one" in r.stderr


@needs_helm
def test_prometheus_rule_has_the_six_alerts_with_thresholds_from_values():
    docs = render("prometheusRule.enabled=true", "--set-json=prometheusRule.ttftP99Seconds=2.5",
                  "prometheusRule.labels.release=prom")
    rule = of_kind(docs, "PrometheusRule")[0]
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["labels"]["release"] == "prom"
    exprs = rule_exprs(docs)
    assert set(exprs) == {"LLMServeEnginesNotReady", "LLMServeKVCacheFull", "LLMServeHighTTFT",
                          "LLMServeGateway5xxRising", "LLMServeAutoscalerAtMaxReplicas",
                          "LLMServeTenantThrottled"}
    assert exprs["LLMServeHighTTFT"].rstrip().endswith("> 2.5")
    assert "> 0.95" in exprs["LLMServeKVCacheFull"]
    for r in rule["spec"]["groups"][0]["rules"]:
        assert re.fullmatch(r"\d+[smh]", r["for"]) and r["labels"]["severity"]
        assert r["expr"].count("(") == r["expr"].count(")")
    fors = {r["alert"]: r["for"] for r in rule["spec"]["groups"][0]["rules"]}
    assert fors["LLMServeKVCacheFull"] == "5m" and fors["LLMServeTenantThrottled"] == "10m"


@needs_helm
def test_dashboard_config_maps_carry_the_sidecar_label_and_the_chart_json():
    docs = render("grafana.dashboards.enabled=true", "grafana.dashboards.label=dash",
                  "grafana.dashboards.labelValue=yes", "grafana.dashboards.namespace=monitoring",
                  "grafana.dashboards.annotations.grafana_folder=llmserve")
    maps = of_kind(docs, "ConfigMap")
    assert len(maps) == 3 and not [d for d in docs if "monitoring" in d["apiVersion"]]
    rendered = {}
    for cm in maps:
        assert cm["metadata"]["labels"]["dash"] == "yes"
        assert cm["metadata"]["namespace"] == "monitoring"
        assert cm["metadata"]["annotations"] == {"grafana_folder": "llmserve"}
        rendered.update({k: json.loads(v) for k, v in cm["data"].items()})
    assert rendered == dashboards()


@needs_helm
@pytest.mark.parametrize("bad", ["prometheusRule.kvCacheUsage=95", "podMonitor.interval=often",
                                 "grafana.dashboards.folder=x", "prometheusRule.ttftP99Seconds=0"])
def test_schema_rejects_bad_monitoring_values(bad):
    r = helm_template(bad, check=False)
    assert r.returncode != 0 and "values don't meet the specifications of the schema" in r.stderr


# --- dashboards ---------------------------------------------------------------------
def test_dashboards_parse_and_every_panel_has_a_query():
    boards = dashboards()
    assert set(boards) == {"overview.json", "engines.json", "tenants.json"}
    assert len({b["uid"] for b in boards.values()}) == len(boards)
    for name, board in boards.items():
        variables = {v["name"] for v in board["templating"]["list"]}
        assert {"datasource", "namespace", "deployment"} <= variables, name
        assert panels(board), name
        for p in panels(board):
            assert p["targets"] and all(t["expr"].strip() for t in p["targets"]), (name, p)
            assert p["datasource"]["uid"] == "${datasource}"
            for t in p["targets"]:
                assert t["expr"].count("(") == t["expr"].count(")"), t["expr"]
                # every series filtered by the deployment variable (one PromQL each)
                assert "$deployment" in t["expr"], (name, p["title"])
    # the engine view has what the issue asks for
    engine_text = json.dumps(boards["engines.json"])
    for metric in ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                   "vllm:generation_tokens_total", "vllm:kv_cache_usage_perc",
                   "vllm:num_requests_running", "vllm:num_requests_waiting",
                   "vllm:num_preemptions_total", "vllm:prefix_cache_hits_total",
                   "llmserve:step_duration_seconds"):
        assert metric in engine_text, metric


# --- every name against real processes ---------------------------------------------
TENANTS = """
classes:
  - {name: interactive, priority: 0, queueTimeoutSeconds: 20, maxQueued: 4}
defaultClass: interactive
tenants:
  - {name: acme, apiKeys: ["sk-acme"], limits: {rpm: 1}}
"""


def scrape(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        return r.read().decode()


def exported_names(text: str) -> set[str]:
    """Every sample name the /metrics text declares, with the suffixes each type has
    (declared families count even before their first labelled sample)."""
    suffixes = {"counter": ["_total", "_created"],
                "histogram": ["_bucket", "_sum", "_count", "_created"]}
    names_ = set()
    for family in text_string_to_metric_families(text):
        names_ |= {family.name + s for s in suffixes.get(family.type, [""])}
        names_ |= {s.name for s in family.samples}
    return names_


def operator_decisions() -> None:
    """Real autoscaler decisions of a main and a prefill pool, recorded as the operator's
    handlers record them (queue past target at maxReplicas; a clamped proposal)."""
    spec = {"autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 2},
            "prefill": {"maxReplicas": 3}}
    for pool, policy in (("engine", Policy.from_spec(spec)),
                         ("prefill", Policy.for_prefill(spec))):
        obs = Observation(waiting=40, running=8, kv_usage=0.9, ready_replicas=2,
                          waiting_prompt_tokens=20000)
        decision = decide(2, obs, policy, History(), now=100.0)
        assert decision.replicas == policy.max_replicas, decision
        operator_metrics.record_decision("team-a", "chat", pool, 2, policy, obs, decision)
        operator_metrics.record_replicas("team-a", "chat", pool, decision.replicas, 2)
    operator_metrics.record_reconcile_error("team-a", "chat", "InvalidSpec")


@pytest.fixture(scope="module")
def operator_exported() -> str:
    """The operator's metrics server (``llmserve operator --metrics-port``) on a free port."""
    operator_decisions()
    port = free_port()
    operator_metrics.serve(port, host="127.0.0.53")
    return scrape(f"http://127.0.0.53:{port}")


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.53", 0))
        return s.getsockname()[1]


def test_operator_metrics_carry_the_decision(operator_exported):
    pool = 'llmdeployment="chat",namespace="team-a",pool="engine"'
    for line in (f"llmserve_operator_autoscaler_desired_replicas{{{pool}}} 2.0",
                 f"llmserve_operator_autoscaler_max_replicas{{{pool}}} 2.0",
                 f"llmserve_operator_autoscaler_queue_depth_per_engine{{{pool}}} 20.0",
                 f"llmserve_operator_autoscaler_target_queue_depth{{{pool}}} 4.0",
                 f'llmserve_operator_autoscaler_decision{{{pool},reason="queue_depth_clamped"}} '
                 "1.0",
                 'llmserve_operator_reconcile_errors_total{llmdeployment="chat",'
                 'namespace="team-a",reason="InvalidSpec"} 1.0'):
        assert line in operator_exported.splitlines(), line
    prefill = 'llmdeployment="chat",namespace="team-a",pool="prefill"'
    assert (f"llmserve_operator_autoscaler_target_waiting_prompt_tokens{{{prefill}}} 4096.0"
            in operator_exported)
    assert f"llmserve_operator_autoscaler_target_kv_cache_usage{{{prefill}}}" not in \
        operator_exported  # KV is no signal of a prefill pool


def test_forget_drops_a_deleted_deployments_series():
    operator_decisions()
    operator_metrics.forget("team-a", "chat")
    text = generate_latest(operator_metrics.REGISTRY).decode()
    assert 'llmdeployment="chat"' not in text and "# TYPE" in text


@pytest.fixture(scope="module")
def exported(tiny_llama, tmp_path_factory):
    engine = EngineProcess(str(tiny_llama), host="127.0.0.51",
                           extra=["--served-model-name", "tiny"])
    path = tmp_path_factory.mktemp("tenants") / "tenants.yaml"
    path.write_text(TENANTS)
    gateway = None
    try:
        gateway = ServerProcess(["gateway", "--backend", engine.url, "--scrape-interval", "0.3",
                                 "--log-level", "WARNING", "--tenants", str(path)], "127.0.0.52")
        client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="sk-acme", max_retries=0)
        out = client.completions.create(model="tiny", prompt="hello there", max_tokens=4)
        assert out.usage.completion_tokens > 0
        with pytest.raises(openai.RateLimitError):  # rpm 1: the tenant is throttled
            client.chat.completions.create(model="tiny", max_tokens=2,
                                           messages=[{"role": "user", "content": "hi"}])
        direct = openai.OpenAI(base_url=engine.url + "/v1", api_key="x", max_retries=0)
        direct.completions.create(model="tiny", prompt="hello there", max_tokens=2,
                                  extra_headers={"x-llmserve-tenant": "beta"})
        yield {"engine": scrape(engine.url), "gateway": scrape(gateway.url)}
    finally:
        if gateway:
            gateway.stop()
        engine.stop()


@needs_helm
def test_every_metric_name_in_dashboards_and_rules_is_exported(exported, operator_exported):
    used = {n for e in [*dashboard_exprs(), *rule_exprs(render(*ALL_ON)).values()]
            for n in metric_names(e)}
    assert len(used) > 30
    served = (exported_names(exported["engine"]) | exported_names(exported["gateway"])
              | exported_names(operator_exported))
    assert used - served == EXTERNAL, sorted(used - served - EXTERNAL)
    # The traffic reached both: the tenants' tokens at the engine, the 429 at the gateway.
    assert 'llmserve:tenant_tokens_total{model_name="tiny",tenant="beta"}' in exported["engine"]
    assert re.search(r'llmserve_gateway_requests_total\{[^}]*code="429"[^}]*tenant="acme"',
                     exported["gateway"])


@needs_helm
def test_operator_otlp_default_reaches_the_operators_environment():
    from llmserve.operator.observability import DEFAULT_ENV
    docs = render("operator.otlpTracesEndpoint=http://otel.monitoring:4318")
    (container,) = of_kind(docs, "Deployment")[0]["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env[DEFAULT_ENV] == "http://otel.monitoring:4318"
    assert helm_template("operator.otlpTracesEndpoint=otel:4317", check=False).returncode != 0


@needs_helm
def test_request_rates_count_api_requests_only():
    """The gateway counts every answer, its /metrics scrapes and probes too (path
    "other"): the panels' rates, 5xx shares and 429s and the alerts must read the API's
    paths alone (a template variable listing tenants may read all)."""
    panel_exprs = [t["expr"] for b in dashboards().values() for p in panels(b)
                   for t in p["targets"]]
    exprs = [*panel_exprs, *rule_exprs(render(*ALL_ON)).values()]
    uses = [e for e in exprs if "llmserve_gateway_requests_total" in e]
    assert len(uses) >= 9
    for e in uses:
        selectors = re.findall(r"llmserve_gateway_requests_total(\{[^}]*\})?", e)
        assert all('path=~"/v1/.*"' in s for s in selectors), e
