"""Prefill/decode disaggregation, the operator's part: what ``spec.prefill`` means.

With ``spec.prefill`` an LLMDeployment runs two engine pools: ``<name>-prefill``
computes prompts, the main pool (``<name>-engine``) decodes, reading each prompt's KV
from the prefill engine that computed it; the gateway sends every long request through
both (docs/disaggregation.md; the engine's side in docs/architecture.md). This module holds the
spec-level rules, as pure functions of the spec: the prefill pool's engine and
resources (the main pool's, with ``spec.prefill``'s fields over them), and the flags,
environment and ports a pod of each role gets. ``builders`` turns them into manifests.
P/D needs ``engine.kind: llmserve`` (``refusal``; docs/disaggregation.md says why).
"""

from __future__ import annotations

import hashlib

KV_TRANSFER_PORT = 5600
KV_TRANSFER_PORT_NAME = "kv-transfer"
KV_SECRET_KEY = "secret"
KV_SECRET_ENV = "LLMSERVE_KV_TRANSFER_SECRET"
# vLLM's own P/D (its NixlConnector, kv_role kv_both on both pools) takes the same two
# requests, but its prefill answer's kv_transfer_params lack the lease fields the
# gateway requires before it sends leg 2 (gateway/disagg.py, usable_params): every long
# prompt would be prefilled twice. Refused until the gateway accepts vLLM's params.
VLLM_REFUSAL = ("spec.prefill needs engine.kind llmserve: vLLM's NixlConnector answers the "
                "prefill leg without the lease fields (remote_lease_id, num_tokens) the "
                "gateway needs to send the decode leg, so every long prompt would be "
                "prefilled twice. Use engine.kind llmserve for P/D, or remove spec.prefill "
                "to serve vLLM colocated")
# spec.prefill.engine may set these (the CRD lists the same); the rest (kind, dtype,
# port, maxModelLen, tensorParallelSize) must match the decode pool's, so they are
# the main pool's: KV moves between engines of the same shape and dtype.
PREFILL_ENGINE_KEYS = ("image", "args", "maxNumSeqs", "maxNumBatchedTokens",
                       "kvCacheMemory", "maxWaiting", "maxQueueDelaySeconds")
NO_PREFIX_CACHING = "--no-prefix-caching"  # which --kv-role decode refuses
# Flags the operator owns once spec.prefill decides the roles.
ROLE_FLAGS = ("--kv-role", "--kv-transfer-port", "--kv-transfer-host")


def secret_fingerprint(secret: dict) -> str | None:
    """A short digest of the live Secret's value (None without the key), stamped on
    both pools' pod templates: a Secret recreated or edited rolls every engine, so no
    pod is left holding a value its peers no longer have."""
    value = (secret.get("data") or {}).get(KV_SECRET_KEY)
    return None if value is None else hashlib.sha256(value.encode()).hexdigest()[:16]


def has_prefill(spec: dict) -> bool:
    return spec.get("prefill") is not None


def role_of_main_pool(spec: dict) -> str:
    """``decode`` beside a prefill pool, else ``both`` (today's engine, flags left out)."""
    return "decode" if has_prefill(spec) else "both"


def prefill_pool_spec(spec: dict) -> dict:
    """The spec the prefill pool's pods are built from: the main pool's engine and
    resources with ``spec.prefill``'s fields over them (a field given replaces the
    main pool's whole, e.g. ``args``)."""
    prefill = spec.get("prefill") or {}
    engine = {**spec.get("engine", {}),
              **{k: v for k, v in (prefill.get("engine") or {}).items()
                 if k in PREFILL_ENGINE_KEYS}}
    return {**spec, "engine": engine,
            "resources": {**spec.get("resources", {}), **(prefill.get("resources") or {})}}


def owned_flag_in(args: list[str]) -> str | None:
    """The first role flag the user put in engine args, if any."""
    for a in args:
        for flag in ROLE_FLAGS:
            if a == flag or a.startswith(flag + "="):
                return flag
    return None


def refusal(spec: dict) -> str | None:
    """Why this spec's prefill pool cannot be realised (None: it can)."""
    if has_prefill(spec) and spec.get("engine", {}).get("kind", "llmserve") != "llmserve":
        return VLLM_REFUSAL
    return None


def role_args(role: str) -> list[str]:
    """The flags of one pool's engines; none for ``both`` (the colocated default)."""
    if role == "prefill":
        return ["--kv-role", "prefill", "--kv-transfer-port", str(KV_TRANSFER_PORT)]
    if role == "decode":
        return ["--kv-role", "decode"]
    return []


def role_env(role: str, secret_name: str) -> list[dict]:
    """Environment of one pool's engines: the deployment's shared secret (the side
    channel serves only peers that hold it) and, on a prefill pod, the address it
    advertises to decode engines (its own pod IP)."""
    if role == "both":
        return []
    env = [{"name": KV_SECRET_ENV, "valueFrom": {"secretKeyRef": {
        "name": secret_name, "key": KV_SECRET_KEY}}}]
    if role == "prefill":
        env.append({"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}})
    return env


def role_ports(role: str) -> list[dict]:
    """The side channel, on the pods that serve KV."""
    if role != "prefill":
        return []
    return [{"name": KV_TRANSFER_PORT_NAME, "containerPort": KV_TRANSFER_PORT,
             "protocol": "TCP"}]
