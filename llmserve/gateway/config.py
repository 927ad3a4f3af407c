"""Gateway configuration: every setting of the router in one place, with its default.

``GatewayConfig`` is to the gateway what ``EngineConfig`` is to the engine: a field
marked ``flag()`` is also a flag of ``llmserve gateway`` (and of ``llmserve up``), with
its name, default, choices and help taken from here (``entrypoints/config_flags.py``).
Fields without ``flag()`` are set by code: the server flags both servers share
(``--drain-timeout``, ``--header-timeout``, ``--body-timeout``), ``up``'s key, and
settings no command exposes.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmserve.flags import flag
from llmserve.http_serving import BODY_TIMEOUT, DRAIN_TIMEOUT, HEADER_TIMEOUT

OPTIONS = None  # flag() group: the command's own options, not a section of their own
PD_GROUP = "prefill/decode disaggregation (with a prefill pool)"
TENANTS_GROUP = "tenants"


@dataclass
class GatewayConfig:
    # Where the engines are: a static list, or the EndpointSlices of a Service.
    backends: list[str] | None = flag(None, "engine base URL (repeatable)",
                                      option="--backend", action="append",
                                      metavar="BACKEND", group=OPTIONS)
    k8s_service: str | None = flag(
        None, "NAMESPACE/NAME: follow the EndpointSlices of this Service", group=OPTIONS)
    k8s_port_name: str | None = flag(
        None, "EndpointSlice port to use (of the prefill Service too)", group=OPTIONS)
    # Prefill/decode disaggregation (disagg.py): the prefill pool; the backends above are
    # then the decode pool.
    prefill_backends: list[str] | None = flag(
        None, "a prefill engine's base URL (repeatable): long prompts are prefilled there "
        "and decoded by --backend / --k8s-service", option="--prefill-backend",
        action="append", metavar="URL", group=OPTIONS)
    prefill_k8s_service: str | None = flag(
        None, "follow the EndpointSlices of this Service as the prefill pool",
        metavar="NAMESPACE/NAME", group=OPTIONS)
    # Routing and spill-over (routing.py, endpoints.py).
    policy: str = flag("prefix-hash", choices=("prefix-hash", "least-load", "round-robin"))
    load_factor: float = flag(1.25, "prefix-hash: an endpoint takes a request while its "
                              "in-flight load is within this factor of the mean")
    prefix_chars: int = flag(100, "leading prompt characters that form the routing key")
    max_attempts: int = flag(3)
    scrape_interval: float = flag(2.0)
    # `up` names this flag --gateway-max-waiting: its --max-waiting is the engines'.
    max_waiting: float = flag(16, "skip endpoints whose vllm:num_requests_waiting is "
                              "above this")
    max_kv_usage: float = flag(0.95, "skip endpoints whose vllm:kv_cache_usage_perc is "
                               "above this")
    eject_seconds: float = 10.0
    # API keys (server.ApiKeys): a file, plus a comma-separated list: `up` gives its
    # --api-key here; None: $LLMSERVE_API_KEYS.
    api_key_file: str | None = flag(
        None, "file with one accepted API key per line (e.g. a mounted Secret); "
        "LLMSERVE_API_KEYS (comma-separated) adds more")
    api_keys: str | None = None
    upstream_api_key: str | None = flag(None, env="LLMSERVE_UPSTREAM_API_KEY")
    max_body_bytes: int = 4 << 20
    no_endpoint_wait: float = flag(0.0, "seconds a request waits for an endpoint when "
                                   "none exists (scale from zero)")
    # With tenants, the cap is what makes the class queues matter (endpoints.py reads
    # each engine's max_num_seqs).
    max_in_flight: int | None = flag(
        None, "requests one engine may have in flight before the gateway holds more back "
        "(0 = no cap). Default: with --tenants, the engine's max_num_seqs as its /metrics "
        "reports it, so requests queue fairly here; without, no cap")
    # Hung engines: seconds a request waits for the response head / for the next body
    # chunk before the gateway asks the engine's /health (0 = never). Only an engine
    # that does not answer is hung (ejected, its requests ended); one that answers is
    # busy and the request waits on. So these bound how long a hang goes unnoticed,
    # never how long a request may take: a healthy engine may send no head for minutes
    # (a long prefill behind a deep queue under load; a non-streamed answer comes whole,
    # after its last token). 60 s for the head: long enough that even a long prefill
    # under load rarely costs a probe, and probes should be rare, since a wrong verdict
    # (a probe unanswered on a starved CPU) ends every request on the engine. 30 s
    # between chunks: a healthy stream sends a token every fraction of a second even
    # under load, so half a minute of silence is already suspicious.
    upstream_first_byte_timeout: float = flag(
        60.0, "hung engines: after S s without an engine's response head, ask its /health; "
        "no answer = hung: ejected, the request retried elsewhere (an answer = busy: the "
        "request waits on). 0 = never", metavar="S")
    upstream_idle_timeout: float = flag(
        30.0, "hung engines: the same after S s without a body chunk; a hung engine's "
        "streams end with an SSE error event and [DONE]. 0 = never", metavar="S")
    # The shortest prompt worth a prefill leg, and how long that leg may take before the
    # decode engine is asked to prefill instead.
    pd_min_prompt_tokens: int = flag(
        256, "prompts shorter than N tokens skip the prefill pool and go straight to the "
        "decode pool", metavar="N", group=PD_GROUP)
    pd_prefill_timeout: float = flag(
        60.0, "a prefill leg that has not answered in S s is abandoned (its engine ejected "
        "until /health answers); the decode engine prefills instead", metavar="S",
        group=PD_GROUP)
    # Tenants (tenants.py, admission.py) and the replicas that share their limits.
    tenants_file: str | None = flag(
        None, "tenants file (classes, tenants, API keys, limits); re-read when it changes. "
        "Enables per-tenant limits and fair queueing", option="--tenants", metavar="FILE",
        group=TENANTS_GROUP)
    peers: list[str] | None = flag(
        None, "another gateway replica sharing the tenants' limits (repeatable)",
        option="--peer", action="append", metavar="URL", group=TENANTS_GROUP)
    peer_service: str | None = flag(
        None, "the gateway's headless Service: its ready pods are the peers",
        metavar="NAMESPACE/NAME", group=TENANTS_GROUP)
    peer_interval: float = flag(1.0, "seconds between exchanges of counters with peers",
                                group=TENANTS_GROUP)
    # Set from the server flags `gateway` shares with `serve`. Slow clients: seconds to
    # send a request head / a request body.
    drain_timeout: float = DRAIN_TIMEOUT
    header_timeout: float = HEADER_TIMEOUT
    body_timeout: float = BODY_TIMEOUT
    # OpenTelemetry (spans.py): where to export spans; None = off (a no-op tracer).
    # Under `up`, the engines' flag of the same name serves the gateway too.
    otlp_traces_endpoint: str | None = flag(
        None, "export OpenTelemetry traces of requests to this OTLP/HTTP collector, e.g. "
        "http://localhost:4318 (default: off)", metavar="URL", group=OPTIONS)
