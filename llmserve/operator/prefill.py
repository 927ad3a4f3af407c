"""Prefill/decode disaggregation, the operator's part: what ``spec.prefill`` means.

With ``spec.prefill`` an LLMDeployment runs two engine pools: ``<name>-prefill``
computes prompts, the main pool (``<name>-engine``) decodes, reading each prompt's KV
from the prefill engine that computed it; the gateway sends every long request through
both (docs/architecture.md, "Prefill/decode disaggregation"). This module holds the
spec-level rules, as pure functions of the spec: the prefill pool's engine and
resources (the main pool's, with ``spec.prefill``'s fields over them), and the flags,
environment and ports a pod of each role gets. ``builders`` turns them into manifests.
"""

from __future__ import annotations

import json

KV_TRANSFER_PORT = 5600  # our side channel, and vLLM's NIXL side channel's default
KV_TRANSFER_PORT_NAME = "kv-transfer"
KV_SECRET_KEY = "secret"
KV_SECRET_ENV = "LLMSERVE_KV_TRANSFER_SECRET"
# vLLM's own P/D: both pools run its NixlConnector as kv_both; the decode side pulls
# the blocks named by the prefill response's kv_transfer_params, the shape our gateway
# forwards unchanged (the two legs are the same requests for either engine).
VLLM_KV_TRANSFER_CONFIG = json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_both"},
                                     separators=(",", ":"))
# spec.prefill.engine may set these (the CRD lists the same); the rest (kind, dtype,
# port, maxModelLen, tensorParallelSize) must match the decode pool's, so they are
# the main pool's: KV moves between engines of the same shape and dtype.
PREFILL_ENGINE_KEYS = ("image", "args", "maxNumSeqs", "maxNumBatchedTokens",
                       "kvCacheMemory", "maxWaiting", "maxQueueDelaySeconds")
# Flags the operator owns once spec.prefill decides the roles.
ROLE_FLAGS = ("--kv-role", "--kv-transfer-port", "--kv-transfer-host", "--kv-transfer-config")


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


def role_args(kind: str, role: str) -> list[str]:
    """The flags of one pool's engines; none for ``both`` (the colocated default)."""
    if role == "both":
        return []
    if kind == "vllm":
        return ["--kv-transfer-config", VLLM_KV_TRANSFER_CONFIG]
    if role == "prefill":
        return ["--kv-role", "prefill", "--kv-transfer-port", str(KV_TRANSFER_PORT)]
    return ["--kv-role", "decode"]


def listens_for_kv(kind: str, role: str) -> bool:
    """Whether this pool's pods serve KV to peers: our prefill engines; with vLLM every
    engine (kv_both opens the NIXL side channel on both pools)."""
    return role == "prefill" or (kind == "vllm" and role != "both")


def role_env(kind: str, role: str, secret_name: str) -> list[dict]:
    """Environment of one pool's engines: the deployment's shared secret (the side
    channel serves only peers that hold it) and, where a pod serves KV, the address it
    advertises to decode engines (its own pod IP)."""
    if role == "both":
        return []
    pod_ip = {"valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
    env = [{"name": KV_SECRET_ENV, "valueFrom": {"secretKeyRef": {
        "name": secret_name, "key": KV_SECRET_KEY}}}]
    if listens_for_kv(kind, role):
        env.append({"name": "POD_IP", **pod_ip})
        if kind == "vllm":
            env += [{"name": "VLLM_NIXL_SIDE_CHANNEL_HOST", **pod_ip},
                    {"name": "VLLM_NIXL_SIDE_CHANNEL_PORT", "value": str(KV_TRANSFER_PORT)}]
    return env


def role_ports(kind: str, role: str) -> list[dict]:
    if not listens_for_kv(kind, role):
        return []
    return [{"name": KV_TRANSFER_PORT_NAME, "containerPort": KV_TRANSFER_PORT,
             "protocol": "TCP"}]
