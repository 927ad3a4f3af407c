"""Speculative decoding, the operator's part: ``spec.engine.speculative`` -> the engine's
``--speculative-config`` JSON.

Both engine kinds take vLLM's JSON shape, so the translation is one: the CRD's camelCase
fields become vLLM's snake_case keys. ``method`` defaults from whether a draft ``model``
is given (``draft_model``) or not (``ngram``), as vLLM infers it. Where the draft model
is read from (a pvc:// claim becomes a mounted path, hf:// is a repo id for vLLM) is the
builders' business (``builders.draft_model``); this module gets the value to send.

Pure functions of the spec, unit tested directly: the JSON (``config_json``) and why a
spec cannot be served (``refusal``), which the operator turns into Degraded before any
pod is rolled out, rather than engines that exit at start-up.
"""

from __future__ import annotations

import json

FLAG = "--speculative-config"
NGRAM, DRAFT_MODEL = "ngram", "draft_model"
# spec.engine.speculative's fields and vLLM's keys, in the order they are rendered.
KEYS = {"numSpeculativeTokens": "num_speculative_tokens",
        "promptLookupMax": "prompt_lookup_max", "promptLookupMin": "prompt_lookup_min",
        "disableByBatchSize": "disable_by_batch_size"}
MAX_TOKENS = 16  # the CRD's bound on numSpeculativeTokens
# What llmserve's engine refuses together with speculation (spec_decode/config.py,
# UNSUPPORTED_WITH), as engine.args flags; vLLM decides for itself what it combines.
LLMSERVE_CLASHING_FLAGS = {
    "--async-scheduling": "the draft depends on the token still in flight",
    "--check-kv-integrity": "it hashes KV slots that a rejected draft rolls back",
}


def settings(spec: dict) -> dict | None:
    """``spec.engine.speculative``; None when speculation is off."""
    return spec.get("engine", {}).get("speculative")


def method_of(conf: dict) -> str:
    """The method given, else vLLM's inference: a draft model when one is named."""
    return conf.get("method") or (DRAFT_MODEL if conf.get("model") else NGRAM)


def flag_in(args: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def field_problem(conf: dict) -> str | None:
    """What the API server's schema refuses too, checked again here: a resource stored
    under an older CRD (or with validation off) must still not reach the engines."""
    k = conf.get("numSpeculativeTokens")
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_TOKENS:
        return (f"engine.speculative.numSpeculativeTokens must be an integer from 1 to "
                f"{MAX_TOKENS}, got {k!r}")
    for key in ("promptLookupMax", "promptLookupMin", "disableByBatchSize"):
        x = conf.get(key)
        if x is not None and (isinstance(x, bool) or not isinstance(x, int) or x < 1):
            return f"engine.speculative.{key} must be an integer >= 1, got {x!r}"
    lo, hi = conf.get("promptLookupMin"), conf.get("promptLookupMax")
    if lo is not None and hi is not None and lo > hi:
        return (f"engine.speculative.promptLookupMin ({lo}) must not exceed "
                f"promptLookupMax ({hi})")
    return method_problem(conf)


def method_problem(conf: dict) -> str | None:
    method, model = method_of(conf), conf.get("model")
    if method not in (NGRAM, DRAFT_MODEL):
        return f"engine.speculative.method must be ngram or draft_model, got {method!r}"
    if method == DRAFT_MODEL and not model:
        return ("engine.speculative.method draft_model needs engine.speculative.model, the "
                "draft model's source (a built-in name, hf://ORG/REPO[@REVISION], "
                "pvc://CLAIM/PATH or file:///PATH)")
    if method == NGRAM and model:
        return ("engine.speculative.model names a draft model, which method ngram does not "
                "use: set method draft_model (or leave it out), or remove model")
    if model and (conf.get("promptLookupMax") is not None
                  or conf.get("promptLookupMin") is not None):
        return ("engine.speculative.promptLookupMax/promptLookupMin are n-gram settings; "
                "with a draft model (model) leave them out")
    return None


def refusal(spec: dict, tp: int, role: str = "both") -> str | None:
    """Why the engines could not run ``spec``'s speculation (None: they can). ``tp``: the
    pool's tensor-parallel size; ``role``: its P/D role."""
    conf = settings(spec)
    if conf is None:
        return None
    problem = field_problem(conf)
    if problem:
        return problem
    engine = spec.get("engine", {})
    args = list(engine.get("args", []))
    if flag_in(args, FLAG):
        return (f"{FLAG} in engine.args and engine.speculative both set: the operator "
                f"renders {FLAG} from engine.speculative; keep one (remove the flag "
                f"from engine.args)")
    if spec.get("prefill") is not None or role != "both":
        return ("engine.speculative with spec.prefill is not supported yet: a P/D engine "
                "(--kv-role prefill|decode) cannot hand over the KV of a partly accepted "
                "step; remove spec.prefill to speculate, or engine.speculative to "
                "disaggregate")
    if engine.get("kind", "llmserve") != "llmserve":
        return None  # vLLM takes the same JSON and checks its own combinations
    if tp > 1:
        return (f"engine.speculative with tensor-parallel size {tp} (resources.gpus / "
                f"engine.tensorParallelSize) is not supported yet by engine.kind llmserve: "
                f"the ranks would need the drafts; give each engine one GPU, or use "
                f"engine.kind vllm")
    for flag, why in LLMSERVE_CLASHING_FLAGS.items():
        if flag_in(args, flag):
            return (f"engine.speculative with {flag} in engine.args is not supported yet "
                    f"({why}): remove {flag} from engine.args, or engine.speculative")
    return None


def config_json(conf: dict, draft: dict[str, str] | None = None) -> str:
    """The ``--speculative-config`` value: vLLM's keys, unset fields left to the
    engine's defaults. ``draft``: the draft model's keys as this engine kind takes them
    (``model``, and ``revision`` for vLLM), from ``builders.draft_model``."""
    out = {"method": method_of(conf)}
    out.update({key: conf[field] for field, key in KEYS.items()
                if conf.get(field) is not None})
    out.update(draft or {})
    return json.dumps(out)
