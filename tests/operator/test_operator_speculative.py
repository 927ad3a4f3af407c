"""spec.engine.speculative (issue 33), the operator's part: the --speculative-config JSON
the builders render (and that the engine's own parser accepts), where a draft model is
read from, what is refused before any pod rolls out, and the CRD's schema. Pure
functions; the API server's side (CEL rules, a live operator's Deployment and Degraded
condition) is in e2e/tests/test_operator_speculative_api.py."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from llmserve.config.speculative import UNSUPPORTED_WITH, SpeculativeConfig
from llmserve.operator import speculative
from llmserve.operator.builders import DRAFT_DIR, MODELS_DIR, Owner, SpecError, children

ROOT = Path(__file__).resolve().parents[2]
CRD = ROOT / "crds" / "llmdeployments.serving.llmserve.io.yaml"
NGRAM = {"method": "ngram", "numSpeculativeTokens": 4, "promptLookupMax": 4,
         "promptLookupMin": 2, "disableByBatchSize": 8}


def owner(engine: dict | None = None, **spec) -> Owner:
    base = {"model": {"source": "smollm2-135m-instruct", "name": "smol"}, **spec}
    if engine is not None:
        base["engine"] = engine
    return Owner("chat", "team-a", "uid-123", base)


def engine_pod(o: Owner) -> dict:
    dep = next(c for c in children(o, 1) if c["kind"] == "Deployment"
               and c["metadata"]["name"] == "chat-engine")
    return dep["spec"]["template"]["spec"]


def rendered_config(o: Owner) -> dict | None:
    """The --speculative-config the engine container gets, parsed (None: no flag)."""
    args = engine_pod(o)["containers"][0]["args"]
    if speculative.FLAG not in args:
        return None
    assert args.count(speculative.FLAG) == 1
    return json.loads(args[args.index(speculative.FLAG) + 1])


# --- the translation ----------------------------------------------------------------------
def test_every_field_becomes_vllms_key():
    assert json.loads(speculative.config_json(NGRAM)) == {
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
        "prompt_lookup_min": 2, "disable_by_batch_size": 8}


def test_unset_fields_are_left_to_the_engine_and_the_method_is_inferred():
    assert json.loads(speculative.config_json({"numSpeculativeTokens": 3})) == {
        "method": "ngram", "num_speculative_tokens": 3}
    draft = {"numSpeculativeTokens": 5, "model": "hf://org/draft"}
    assert speculative.method_of(draft) == "draft_model"
    assert json.loads(speculative.config_json(draft, {"model": "hf://org/draft"})) == {
        "method": "draft_model", "num_speculative_tokens": 5, "model": "hf://org/draft"}


def test_the_engine_container_gets_the_flag_only_when_speculative_is_set():
    assert rendered_config(owner({"speculative": NGRAM})) == json.loads(
        speculative.config_json(NGRAM))
    assert rendered_config(owner()) is None
    assert rendered_config(owner({"maxNumSeqs": 8})) is None


def cli_args(monkeypatch, c: dict):
    """The namespace `llmserve serve` parses from a rendered container's args."""
    from llmserve.entrypoints import cli
    seen = []
    monkeypatch.setattr(cli, "cmd_serve", lambda args: seen.append(args) or 0)
    assert c["command"] == ["llmserve", "serve"]
    assert cli.main(["serve", *c["args"]]) == 0
    return seen[0]


def test_the_engine_parses_the_rendered_flag_to_the_settings_of_the_spec(monkeypatch):
    from llmserve.entrypoints.cli import engine_config
    config = engine_config(cli_args(monkeypatch, engine_pod(owner({"speculative": NGRAM}))
                                    ["containers"][0]))
    assert config.speculative == SpeculativeConfig(
        num_speculative_tokens=4, prompt_lookup_max=4, prompt_lookup_min=2,
        disable_by_batch_size=8, method="ngram")
    minimal = engine_pod(owner({"speculative": {"numSpeculativeTokens": 2}}))
    assert engine_config(cli_args(monkeypatch, minimal["containers"][0])).speculative == (
        SpeculativeConfig(2, 5, 5))  # vLLM's lookup defaults, applied by the engine


def test_the_example_renders_a_config_the_engine_accepts(monkeypatch):
    from llmserve.entrypoints.cli import engine_config
    doc = yaml.safe_load((ROOT / "examples" / "builtin-cpu-speculative.yaml").read_text())
    o = Owner(doc["metadata"]["name"], "default", "uid", doc["spec"])
    dep = next(c for c in children(o, 1) if c["metadata"]["name"].endswith("-engine")
               and c["kind"] == "Deployment")
    config = engine_config(cli_args(monkeypatch, dep["spec"]["template"]["spec"]
                                    ["containers"][0]))
    assert config.speculative.num_speculative_tokens == (
        doc["spec"]["engine"]["speculative"]["numSpeculativeTokens"])


def test_vllm_gets_the_same_json_and_may_speculate_with_tensor_parallelism():
    o = owner({"kind": "vllm", "speculative": NGRAM},
              model={"source": "hf://Qwen/Qwen2.5-7B-Instruct", "name": "q"},
              resources={"gpus": 2})
    c = engine_pod(o)["containers"][0]
    assert c["command"][:2] == ["vllm", "serve"]
    assert rendered_config(o) == json.loads(speculative.config_json(NGRAM))
    assert c["args"][c["args"].index("--tensor-parallel-size") + 1] == "2"


# --- the draft model's source -------------------------------------------------------------
@pytest.mark.parametrize("kind,source,want", [
    ("llmserve", "smollm2-135m-instruct", {"model": "smollm2-135m-instruct"}),
    ("llmserve", "hf://org/draft@v2", {"model": "hf://org/draft@v2"}),
    ("vllm", "hf://org/draft@v2", {"model": "org/draft", "revision": "v2"}),
    ("vllm", "hf://org/draft", {"model": "org/draft"}),
    ("llmserve", "file:///srv/draft", {"model": "/srv/draft"}),
    ("vllm", "file:///srv/draft", {"model": "/srv/draft"}),
    ("vllm", "org/draft", {"model": "org/draft"}),  # vLLM's own repo-id form
])
def test_draft_sources_as_each_engine_kind_takes_them(kind, source, want):
    o = owner({"kind": kind, "speculative": {"numSpeculativeTokens": 3, "model": source}})
    assert rendered_config(o) == {"method": "draft_model", "num_speculative_tokens": 3,
                                  **want}
    assert not any("draft" in v["name"] for v in engine_pod(o)["volumes"])


def claims(pod: dict) -> dict[str, dict]:
    return {v["persistentVolumeClaim"]["claimName"]: v for v in pod["volumes"]
            if "persistentVolumeClaim" in v}


def test_a_pvc_draft_on_its_own_claim_is_mounted_read_only():
    o = owner({"speculative": {"numSpeculativeTokens": 3, "model": "pvc://drafts/tiny"}})
    pod = engine_pod(o)
    volume = claims(pod)["drafts"]
    assert volume["persistentVolumeClaim"]["readOnly"] is True
    mounts = {m["name"]: m for m in pod["containers"][0]["volumeMounts"]}
    assert mounts[volume["name"]] == {"name": volume["name"], "mountPath": DRAFT_DIR,
                                      "readOnly": True}
    assert rendered_config(o)["model"] == f"{DRAFT_DIR}/tiny"


def test_a_pvc_draft_on_a_claim_already_mounted_is_read_there():
    on_model_claim = owner({"speculative": {"numSpeculativeTokens": 3,
                                            "model": "pvc://models/drafts/tiny"}},
                           model={"source": "pvc://models/llama", "name": "llama"})
    pod = engine_pod(on_model_claim)
    assert list(claims(pod)) == ["models"]
    assert rendered_config(on_model_claim)["model"] == f"{MODELS_DIR}/drafts/tiny"
    on_adapters_claim = owner({"speculative": {"numSpeculativeTokens": 3,
                                               "model": "pvc://loras/tiny-draft"}},
                              adapters=[{"name": "sql", "source": "pvc://loras/sql"}])
    pod = engine_pod(on_adapters_claim)
    assert list(claims(pod)) == ["loras"]  # one volume for the claim
    assert rendered_config(on_adapters_claim)["model"] == "/adapters/loras/tiny-draft"
    names = [v["name"] for v in pod["volumes"]]
    assert len(names) == len(set(names))


def test_changing_only_the_draft_on_a_mounted_claim_keeps_the_volumes():
    def pod(path):
        return engine_pod(owner({"speculative": {"numSpeculativeTokens": 3,
                                                 "model": f"pvc://drafts/{path}"}}))
    assert pod("a")["volumes"] == pod("b")["volumes"]


# --- refusals: what the engines would refuse at start-up ------------------------------------
GPU_MODEL = {"source": "hf://Qwen/Qwen2.5-7B-Instruct", "name": "q"}


@pytest.mark.parametrize("spec,message", [
    ({"engine": {"speculative": NGRAM, "args": ["--speculative-config", "{}"]}},
     "--speculative-config in engine.args and engine.speculative both set"),
    ({"engine": {"speculative": NGRAM, "args": ['--speculative-config={"x": 1}']}},
     "remove the flag from engine.args"),
    ({"engine": {"speculative": NGRAM}, "model": GPU_MODEL, "resources": {"gpus": 2}},
     "tensor-parallel size 2"),
    ({"engine": {"speculative": NGRAM, "tensorParallelSize": 3}},  # CPU ranks
     "tensor-parallel size 3"),
    ({"engine": {"speculative": NGRAM}, "prefill": {}},
     "engine.speculative with spec.prefill is not supported yet"),
    ({"engine": {"speculative": NGRAM, "args": ["--async-scheduling"]}},
     "remove --async-scheduling from engine.args"),
    ({"engine": {"speculative": NGRAM, "args": ["--check-kv-integrity"]}},
     "remove --check-kv-integrity from engine.args"),
    ({"engine": {"speculative": {"numSpeculativeTokens": 3, "method": "draft_model"}}},
     "method draft_model needs engine.speculative.model"),
    ({"engine": {"speculative": {"numSpeculativeTokens": 3, "method": "ngram",
                                 "model": "hf://o/d"}}},
     "set method draft_model (or leave it out), or remove model"),
    ({"engine": {"speculative": {"numSpeculativeTokens": 3, "model": "hf://o/d",
                                 "promptLookupMax": 3}}},
     "n-gram settings"),
    ({"engine": {"speculative": {"numSpeculativeTokens": 3, "promptLookupMin": 4,
                                 "promptLookupMax": 2}}},
     "promptLookupMin (4) must not exceed promptLookupMax (2)"),
    ({"engine": {"speculative": {"method": "ngram"}}}, "numSpeculativeTokens must be"),
    ({"engine": {"speculative": {"numSpeculativeTokens": 17}}}, "from 1 to 16, got 17"),
    ({"engine": {"speculative": {"numSpeculativeTokens": 2, "disableByBatchSize": 0}}},
     "disableByBatchSize must be an integer >= 1"),
    ({"engine": {"speculative": {"numSpeculativeTokens": 2, "method": "eagle"}}},
     "method must be ngram or draft_model"),
    ({"engine": {"speculative": {"numSpeculativeTokens": 2, "model": "s3://b/draft"}}},
     "engine.speculative.model 's3://b/draft': unsupported scheme"),
    ({"engine": {"speculative": {"numSpeculativeTokens": 2, "model": "tiny-draft"}}},
     "is not a built-in model"),
    ({"engine": {"speculative": {"numSpeculativeTokens": 2, "model": "pvc:///x"}}},
     "pvc:// needs a claim name"),
])
def test_specs_the_engines_could_not_serve_are_refused(spec, message):
    with pytest.raises(SpecError, match=re.escape(message)):
        children(owner(**spec), 1)


def test_the_flags_are_the_users_when_speculative_is_not_set():
    args = engine_pod(owner({"args": ["--speculative-config", '{"num_speculative_tokens": 2}',
                                      "--async-scheduling"]}))["containers"][0]["args"]
    assert args[-3:] == ["--speculative-config", '{"num_speculative_tokens": 2}',
                         "--async-scheduling"]


def test_vllm_decides_its_own_combinations():
    o = owner({"kind": "vllm", "speculative": NGRAM, "args": ["--async-scheduling"]})
    assert "--async-scheduling" in engine_pod(o)["containers"][0]["args"]
    with pytest.raises(SpecError, match="both set"):
        children(owner({"kind": "vllm", "speculative": NGRAM,
                        "args": ["--speculative-config", "{}"]}), 1)


def test_every_clash_the_engine_refuses_is_refused_by_the_operator(monkeypatch):
    """The engine's list (UNSUPPORTED_WITH) and the operator's checks stay in step: a
    new engine restriction fails here until the operator refuses it too; and each flag
    the operator refuses is one the engine refuses with speculation."""
    from llmserve.entrypoints.cli import engine_config
    covered = {"async_scheduling": "--async-scheduling",
               "check_kv_integrity": "--check-kv-integrity",
               "tensor_parallel_size": "tensor-parallel size",  # tp > 1 in refusal()
               "kv_role": "spec.prefill"}  # role != both in refusal()
    assert set(UNSUPPORTED_WITH) == set(covered)
    assert set(speculative.LLMSERVE_CLASHING_FLAGS) == {
        covered["async_scheduling"], covered["check_kv_integrity"]}
    c = engine_pod(owner({"speculative": NGRAM}))["containers"][0]
    for flag in speculative.LLMSERVE_CLASHING_FLAGS:
        args = cli_args(monkeypatch, {**c, "args": [*c["args"], flag]})
        with pytest.raises(ValueError, match="not supported together with"):
            engine_config(args)


# --- the CRD ------------------------------------------------------------------------------
def speculative_schema() -> dict:
    crd = yaml.safe_load(CRD.read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    return spec["properties"]["engine"]["properties"]["speculative"]


def test_crd_declares_speculative_with_its_bounds_and_rules():
    s = speculative_schema()
    assert s["required"] == ["numSpeculativeTokens"]
    props = s["properties"]
    assert set(props) == {"method", "model", *speculative.KEYS}
    assert props["method"]["enum"] == ["ngram", "draft_model"]
    assert "default" not in props["method"]  # inferred from model, as vLLM does
    assert (props["numSpeculativeTokens"]["minimum"],
            props["numSpeculativeTokens"]["maximum"]) == (1, speculative.MAX_TOKENS)
    for key in ("promptLookupMax", "promptLookupMin", "disableByBatchSize"):
        assert props[key] == {**props[key], "type": "integer", "minimum": 1}
    rules = " ".join(r["rule"] for r in s["x-kubernetes-validations"])
    assert "self.promptLookupMin <= self.promptLookupMax" in rules
    assert "self.method != 'draft_model' || has(self.model)" in rules
    assert "self.method != 'ngram' || !has(self.model)" in rules


def test_crd_draft_source_takes_the_forms_of_model_source():
    crd = yaml.safe_load(CRD.read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    main = spec["properties"]["model"]["properties"]["source"]["x-kubernetes-validations"]
    draft = speculative_schema()["properties"]["model"]["x-kubernetes-validations"]
    assert [r["rule"] for r in draft] == [r["rule"] for r in main]
