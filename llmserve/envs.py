"""Every environment variable llmserve reads, declared once: its name, type, default and
what it does (as vLLM's ``envs.py``). Code reads one as ``envs.NAME``; nothing else in
llmserve reads ``os.environ`` (tests/entrypoints/test_envs.py checks both ways).

A value is read when it is asked for, not at import, so a pod's environment, a child
process's, or a test's ``monkeypatch.setenv`` applies from the next read on. Unset, a
variable is its default; set (even to ""), its text converted by its type.

Shared by every layer, importing nothing of llmserve.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class EnvVar:
    type: Callable[[str], Any]  # the set text -> the value
    default: Any  # the value while unset
    doc: str


def on_unless_zero(text: str) -> bool:
    """A switch that is on by default: only "0" turns it off."""
    return text != "0"


VARIABLES: dict[str, EnvVar] = {
    # --- files --------------------------------------------------------------------
    "LLMSERVE_CACHE": EnvVar(
        str, None, "converted checkpoints and built C kernels (empty or unset: the user's "
        "cache folder, ~/.cache/llmserve on Linux)"),
    # --- keys and secrets ---------------------------------------------------------
    "LLMSERVE_API_KEY": EnvVar(
        str, None, "the default of --api-key (serve, gateway, up)"),
    "LLMSERVE_API_KEYS": EnvVar(
        str, None, "comma-separated API keys the gateway accepts besides --api-key-file's"),
    "LLMSERVE_UPSTREAM_API_KEY": EnvVar(
        str, None, "the default of the gateway's --upstream-api-key"),
    "LLMSERVE_KV_TRANSFER_SECRET": EnvVar(
        str, "", "the deployment's shared secret for the P/D side channel (the operator "
        "sets it from a Secret; empty: none)"),
    # --- the engine server --------------------------------------------------------
    "LLMSERVE_RESPONSES_STORE_MAX": EnvVar(
        int, 1024, "/v1/responses: stored conversations kept for previous_response_id"),
    "LLMSERVE_RESPONSES_STORE_TTL_S": EnvVar(
        float, 3600.0, "/v1/responses: seconds a stored conversation is kept"),
    "LLMSERVE_RESPONSES_STORE_MAX_CHARS": EnvVar(
        int, 64 << 20, "/v1/responses: characters of JSON kept in all"),
    # --- CPU engine ---------------------------------------------------------------
    "LLMSERVE_CPU_DTYPE": EnvVar(
        str, None, "the dtype --dtype auto picks on a CPU (empty or unset: from the CPU's "
        "features)"),
    "LLMSERVE_CPU_KERNELS": EnvVar(
        str, "native", "torch: the CPU path runs without our C kernels"),
    "LLMSERVE_CPU_MARCH": EnvVar(
        str, None, "the -march our C kernels are built for (tests: another CPU kind this "
        "one can run)"),
    "LLMSERVE_BF16_GEMM": EnvVar(
        str, "auto", "the bf16 GEMM on CPU: auto, native (ours) or onednn"),
    "LLMSERVE_CPU_INT8_ACTIVATIONS": EnvVar(
        on_unless_zero, True, "0: int4 products never round their activations to int8 "
        "(kernels/cpu/decoder.py's int8_activations)"),
    "LLMSERVE_CPU_HUGE_PAGES": EnvVar(
        on_unless_zero, True, "0: CPU weights stay on 4 KB pages (to measure against)"),
    "LLMSERVE_TP_TIMEOUT_S": EnvVar(
        float, 600.0, "seconds a tensor-parallel collective may take before it fails "
        "(read when distributed/comm.py is imported)"),
    # --- the operator -------------------------------------------------------------
    "LLMSERVE_IMAGE": EnvVar(
        str, "ghcr.io/llmserve/llmserve:0.1.0", "the engine and gateway image the "
        "operator deploys (read at import)"),
    "LLMSERVE_GPU_IMAGE": EnvVar(
        str, "ghcr.io/llmserve/llmserve-cuda:0.1.0", "the image of GPU engines (read at "
        "import)"),
    "LLMSERVE_VLLM_IMAGE": EnvVar(
        str, "vllm/vllm-openai:latest", "the image of engine kind vllm (read at import)"),
    "LLMSERVE_OTLP_TRACES_ENDPOINT": EnvVar(
        str, None, "the operator's default --otlp-traces-endpoint for deployments that "
        "name none (the chart sets it)"),
    # --- other programs' variables that llmserve follows --------------------------
    "POD_IP": EnvVar(
        str, None, "this pod's address (Kubernetes downward API): what a prefill engine "
        "and a gateway replica advertise"),
    "OTEL_SERVICE_NAME": EnvVar(
        str, None, "OpenTelemetry's service name, overriding llmserve's"),
    "ATEN_CPU_CAPABILITY": EnvVar(
        str, "", "PyTorch's forced CPU ISA (avx2, default): our C kernels match it"),
    "ONEDNN_MAX_CPU_ISA": EnvVar(
        str, None, "oneDNN's ISA cap: below AMX, our kernels are built without AMX too"),
    "CC": EnvVar(str, None, "the C compiler for our CPU kernels (unset: cc, else gcc)"),
    "UCX_TLS": EnvVar(
        str, "", "UCX's transports: shared memory only turns NIXL's peer error handling "
        "off"),
    # huggingface_hub's, read as it reads them (it reads most only at its own import).
    "HF_HUB_CACHE": EnvVar(str, None, "huggingface_hub's cache folder"),
    "HUGGINGFACE_HUB_CACHE": EnvVar(str, None, "huggingface_hub's legacy cache folder"),
    "HF_HOME": EnvVar(str, None, "huggingface_hub's home (its cache: HF_HOME/hub)"),
    "XDG_CACHE_HOME": EnvVar(str, None, "the user's cache folder (huggingface_hub's last "
                             "fallback)"),
    "HF_HUB_OFFLINE": EnvVar(str, None, "1/true/yes/on: no downloads from the Hub"),
    "TRANSFORMERS_OFFLINE": EnvVar(str, None, "as HF_HUB_OFFLINE"),
    "HF_TOKEN": EnvVar(str, None, "the Hub token"),
    "HUGGING_FACE_HUB_TOKEN": EnvVar(str, None, "the Hub token (legacy name)"),
    "HF_HUB_ETAG_TIMEOUT": EnvVar(str, None, "seconds to wait for the Hub's metadata"),
    "HF_ENDPOINT": EnvVar(str, None, "the Hub's URL"),
}


def __getattr__(name: str) -> Any:
    """``envs.NAME``: the variable's value now."""
    if name not in VARIABLES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return _value(name)


def __dir__() -> list[str]:
    return sorted([*globals(), *VARIABLES])


def _value(name: str) -> Any:
    var = VARIABLES[name]
    text = os.environ.get(name)
    return var.default if text is None else var.type(text)


def cache_root() -> Path:
    """Converted checkpoints, built C kernels: ``$LLMSERVE_CACHE``, else the user's
    cache folder (``~/.cache/llmserve`` on Linux)."""
    if _value("LLMSERVE_CACHE"):  # set: platformdirs is not needed (GPU image)
        return Path(_value("LLMSERVE_CACHE"))
    from platformdirs import user_cache_dir
    return Path(user_cache_dir("llmserve"))


def kv_transfer_secret() -> bytes | None:
    """The deployment's shared secret for the P/D side channel
    (``$LLMSERVE_KV_TRANSFER_SECRET``; the operator sets it from a Secret), or None."""
    secret = _value("LLMSERVE_KV_TRANSFER_SECRET")
    return secret.encode() if secret else None
