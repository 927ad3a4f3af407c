"""Where an LLMDeployment's engines and gateway send OpenTelemetry traces.

``spec.observability.otlpTracesEndpoint`` wins; unset, the operator's default
(``$LLMSERVE_OTLP_TRACES_ENDPOINT``, which the chart sets from
``operator.otlpTracesEndpoint``); an empty string turns traces off for that
deployment even when the operator has a default. The engine (llmserve's and vLLM's)
and the gateway take the same flag, so one endpoint follows a request across both.
"""

from __future__ import annotations

from llmserve import envs

DEFAULT_ENV = "LLMSERVE_OTLP_TRACES_ENDPOINT"
FLAG = "--otlp-traces-endpoint"


def traces_endpoint(spec: dict) -> str | None:
    """The collector URL for this spec, or None for no tracing (read at each render,
    so the operator's default applies to every reconcile after it changes)."""
    observability = spec.get("observability") or {}
    if "otlpTracesEndpoint" in observability:
        return observability["otlpTracesEndpoint"] or None
    return envs.LLMSERVE_OTLP_TRACES_ENDPOINT or None


def tracing_args(spec: dict) -> list[str]:
    """The flag the engine and gateway containers get (none without an endpoint)."""
    endpoint = traces_endpoint(spec)
    return [FLAG, endpoint] if endpoint else []
