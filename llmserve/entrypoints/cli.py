"""The ``llmserve`` command: generate | serve | up (more as they land)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import typing
from dataclasses import Field, fields, replace

from llmserve import envs
from llmserve.config import EngineConfig
from llmserve.errors import EngineDeadError, EngineStartError, ModelLoadError, WorkerDiedError

# The engine's flags are EngineConfig's flag() fields: their names, defaults, choices
# and help live there, once.
ENGINE_FIELDS = tuple(f for f in fields(EngineConfig) if "help" in f.metadata)
ENGINE_KEYS = tuple(f.name for f in ENGINE_FIELDS)
# Fields whose argparse dest is not their name: under `up` the gateway has a
# --max-waiting of its own (its spill-over level), so the engine's overload flags keep
# their names but not their dests.
_DESTS = {"max_waiting": "engine_max_waiting", "max_queue_delay": "engine_max_queue_delay"}


def _dest(f: Field) -> str:
    return _DESTS.get(f.name, f.name)


def _flag_name(f: Field) -> str:
    """--max-num-seqs; a switch that is on by default is turned off: --no-prefix-caching
    for enable_prefix_caching."""
    if f.default is True:
        return "--no-" + f.name.removeprefix("enable_").replace("_", "-")
    return "--" + f.name.replace("_", "-")


def _value_type(hint) -> type:
    """What argparse converts a value to: int | None -> int; str | list[int] | None ->
    str (EngineConfig parses the list); list[str] | None (nargs="+") -> str."""
    args = typing.get_args(hint)
    direct = [t for t in (int, float, str) if t is hint or t in args]
    if direct:
        return direct[0]
    inner = [a for arg in args for a in typing.get_args(arg)]
    return next(t for t in (int, float, str) if t in inner)


def _add_engine_flag(group, f: Field, hint) -> None:
    meta = f.metadata
    kwargs = {"dest": _dest(f), "default": f.default, "help": meta["help"] or None}
    if isinstance(f.default, bool):
        kwargs["action"] = "store_false" if f.default else "store_true"
    elif hint == bool | None:  # default None (decided by the engine): --x and --no-x
        kwargs["action"] = argparse.BooleanOptionalAction
    else:
        kwargs.update(type=_value_type(hint), choices=meta["choices"],
                      metavar=meta.get("metavar"), nargs=meta.get("nargs"))
    group.add_argument(_flag_name(f), *meta.get("aliases", ()), **kwargs)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """EngineConfig's flags, in its field order, in the groups they name ("engine" if
    none)."""
    hints = typing.get_type_hints(EngineConfig)
    groups = {}  # title -> argparse group
    for f in ENGINE_FIELDS:
        title = f.metadata.get("group", "engine")
        if title not in groups:
            groups[title] = p.add_argument_group(title)
        _add_engine_flag(groups[title], f, hints[f.name])


def engine_kwargs(args) -> dict:
    """EngineConfig's keyword arguments from parsed engine flags."""
    return {f.name: getattr(args, _dest(f)) for f in ENGINE_FIELDS}


def engine_argv(args) -> list[str]:
    """The engine flags of ``args`` as a command line (what `up` hands its engines)."""
    argv = []
    for f in ENGINE_FIELDS:
        value = getattr(args, _dest(f))
        if isinstance(value, bool) and f.default is None:  # --x / --no-x: given when set
            argv += ["--" + ("" if value else "no-") + f.name.replace("_", "-")]
        elif isinstance(value, bool):  # switches: given when not at their default
            argv += [_flag_name(f)] if value != f.default else []
        elif isinstance(value, list):  # nargs="+": --lora-modules a=X b=Y
            argv += [_flag_name(f), *map(str, value)] if value else []
        elif value is not None:
            argv += [_flag_name(f), str(value)]
    return argv


def engine_config(args) -> EngineConfig:
    return EngineConfig(**engine_kwargs(args))


def configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def cmd_generate(args) -> int:
    from llmserve.entrypoints.llm import LLM
    llm = LLM(**engine_kwargs(args))
    try:
        _generate(llm, args)
    finally:
        llm.shutdown()
    return 0


def _generate(llm, args) -> None:
    from llmserve.core.sampling_params import SamplingParams
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens,
                            seed=args.seed)
    prompts = args.prompt or ["What is the capital of France?",
                              "Write a haiku about paged KV caches."]
    outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    for prompt, out in zip(prompts, outs):
        print(f"> {prompt}\n{out.outputs[0].text}\n")


def add_server_args(p: argparse.ArgumentParser, port: int) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=port)
    p.add_argument("--api-key", default=envs.LLMSERVE_API_KEY,
                   help="require this Bearer token on /v1 paths (or LLMSERVE_API_KEY)")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds in-flight requests may take after SIGTERM")
    p.add_argument("--header-timeout", type=float, default=30.0,
                   help="close a connection whose request head is incomplete (or that is "
                        "idle) after this many seconds (slow clients)")
    p.add_argument("--body-timeout", type=float, default=30.0,
                   help="answer 408 and close when a request body takes longer than this")
    p.add_argument("--log-level", default="INFO")


def cmd_serve(args) -> int:
    from llmserve.entrypoints.openai.api_server import serve
    configure_logging(args.log_level)
    asyncio.run(serve(engine_config(args), args.host, args.port, args.api_key,
                      args.drain_timeout, header_timeout=args.header_timeout,
                      body_timeout=args.body_timeout))
    return 0


def add_gateway_args(p: argparse.ArgumentParser, spill_over_flag: str = "--max-waiting") -> None:
    """``spill_over_flag``: the name of the gateway's --max-waiting (under `up` that name
    is the engines' overload flag, as under `serve`)."""
    g = p.add_argument_group("gateway")
    g.add_argument("--policy", choices=["prefix-hash", "least-load", "round-robin"],
                   default="prefix-hash")
    g.add_argument("--load-factor", type=float, default=1.25,
                   help="prefix-hash: an endpoint takes a request while its in-flight "
                        "load is within this factor of the mean")
    g.add_argument("--prefix-chars", type=int, default=100,
                   help="leading prompt characters that form the routing key")
    g.add_argument("--max-attempts", type=int, default=3)
    g.add_argument("--scrape-interval", type=float, default=2.0)
    g.add_argument(spill_over_flag, dest="max_waiting", type=float, default=16,
                   help="skip endpoints whose vllm:num_requests_waiting is above this")
    g.add_argument("--max-kv-usage", type=float, default=0.95,
                   help="skip endpoints whose vllm:kv_cache_usage_perc is above this")
    g.add_argument("--api-key-file", default=None,
                   help="file with one accepted API key per line (e.g. a mounted Secret); "
                        "LLMSERVE_API_KEYS (comma-separated) adds more")
    g.add_argument("--upstream-api-key", default=envs.LLMSERVE_UPSTREAM_API_KEY)
    g.add_argument("--no-endpoint-wait", type=float, default=0.0,
                   help="seconds a request waits for an endpoint when none exists "
                        "(scale from zero)")
    g.add_argument("--max-in-flight", type=int, default=None,
                   help="requests one engine may have in flight before the gateway holds "
                        "more back (0 = no cap). Default: with --tenants, the engine's "
                        "max_num_seqs as its /metrics reports it, so requests queue "
                        "fairly here; without, no cap")
    g.add_argument("--upstream-first-byte-timeout", type=float, default=60.0, metavar="S",
                   help="hung engines: after S s without an engine's response head, ask its "
                        "/health; no answer = hung: ejected, the request retried elsewhere "
                        "(an answer = busy: the request waits on). 0 = never")
    g.add_argument("--upstream-idle-timeout", type=float, default=30.0, metavar="S",
                   help="hung engines: the same after S s without a body chunk; a hung "
                        "engine's streams end with an SSE error event and [DONE]. 0 = never")
    d = p.add_argument_group("prefill/decode disaggregation (with a prefill pool)")
    d.add_argument("--pd-min-prompt-tokens", type=int, default=256, metavar="N",
                   help="prompts shorter than N tokens skip the prefill pool and go straight "
                        "to the decode pool")
    d.add_argument("--pd-prefill-timeout", type=float, default=60.0, metavar="S",
                   help="a prefill leg that has not answered in S s is abandoned (its engine "
                        "ejected until /health answers); the decode engine prefills instead")
    t = p.add_argument_group("tenants")
    t.add_argument("--tenants", default=None, metavar="FILE",
                   help="tenants file (classes, tenants, API keys, limits); re-read when it "
                        "changes. Enables per-tenant limits and fair queueing")
    t.add_argument("--peer", action="append", default=[], metavar="URL",
                   help="another gateway replica sharing the tenants' limits (repeatable)")
    t.add_argument("--peer-service", default=None, metavar="NAMESPACE/NAME",
                   help="the gateway's headless Service: its ready pods are the peers")
    t.add_argument("--peer-interval", type=float, default=1.0,
                   help="seconds between exchanges of counters with peers")


def gateway_config(args, backends: list[str]):
    from llmserve.gateway.server import GatewayConfig
    return GatewayConfig(backends=backends, k8s_service=getattr(args, "k8s_service", None),
                         k8s_port_name=getattr(args, "k8s_port_name", None),
                         policy=args.policy, load_factor=args.load_factor,
                         prefix_chars=args.prefix_chars, max_attempts=args.max_attempts,
                         scrape_interval=args.scrape_interval, max_waiting=args.max_waiting,
                         max_kv_usage=args.max_kv_usage, api_key_file=args.api_key_file,
                         upstream_api_key=args.upstream_api_key,
                         drain_timeout=args.drain_timeout,
                         no_endpoint_wait=args.no_endpoint_wait,
                         max_in_flight=args.max_in_flight, tenants_file=args.tenants,
                         peers=args.peer, peer_service=args.peer_service,
                         peer_interval=args.peer_interval,
                         header_timeout=args.header_timeout, body_timeout=args.body_timeout,
                         upstream_first_byte_timeout=args.upstream_first_byte_timeout,
                         upstream_idle_timeout=args.upstream_idle_timeout,
                         prefill_backends=getattr(args, "prefill_backend", None) or [],
                         prefill_k8s_service=getattr(args, "prefill_k8s_service", None),
                         pd_min_prompt_tokens=args.pd_min_prompt_tokens,
                         pd_prefill_timeout=args.pd_prefill_timeout,
                         otlp_traces_endpoint=args.otlp_traces_endpoint)


def cmd_gateway(args) -> int:
    from llmserve.gateway.server import serve_gateway
    configure_logging(args.log_level)
    if not args.backend and not args.k8s_service:
        raise ValueError("give --backend URL (repeatable) or --k8s-service NAMESPACE/NAME")
    for flag in ("k8s_service", "prefill_k8s_service"):
        if getattr(args, flag) and "/" not in getattr(args, flag):
            raise ValueError(f"--{flag.replace('_', '-')} must be NAMESPACE/NAME")
    if args.peer_service and "/" not in args.peer_service:
        raise ValueError("--peer-service must be NAMESPACE/NAME")
    if (args.peer or args.peer_service) and not args.tenants:
        raise ValueError("--peer / --peer-service share tenants' limits: give --tenants")
    asyncio.run(serve_gateway(gateway_config(args, args.backend or []), args.host, args.port))
    return 0


def add_up_parser(sub) -> argparse.ArgumentParser:
    """`up`: the engine flags (overload ones included, named as under `serve`), the
    server flags and the gateway's, whose spill-over level is --gateway-max-waiting."""
    up = sub.add_parser("up", help="the local platform on the built-in model, one command")
    add_engine_args(up)
    add_server_args(up, 8000)
    add_gateway_args(up, spill_over_flag="--gateway-max-waiting")
    up.add_argument("--engines", type=int, default=1, help="engine processes behind the gateway")
    up.set_defaults(func=cmd_up)
    return up


def up_gateway_config(args, backends: list[str]):
    """The gateway `up` runs in its own process: its --api-key is a key the gateway
    accepts, given in the config (not through the environment its engines inherit)."""
    config = gateway_config(args, backends)
    return replace(config, api_keys=args.api_key) if args.api_key else config


def check_up_args(args) -> None:
    """Refuse what the gateway would refuse, before the engines take their time to start."""
    if args.tenants:
        from llmserve.gateway.server import ApiKeys, check_tenant_keys, listed_keys
        from llmserve.gateway.tenants import TenantsFile
        TenantsFile(args.tenants)  # TenantsError (a ValueError) names what is wrong
        config = up_gateway_config(args, [])
        check_tenant_keys(args.tenants, ApiKeys(config.api_key_file, listed_keys(config)))
    if (args.peer or args.peer_service) and not args.tenants:
        raise ValueError("--peer / --peer-service share tenants' limits: give --tenants")
    if args.otlp_traces_endpoint:  # the engines' own refusal would go to /dev/null
        from llmserve.tracing import traces_url
        traces_url(args.otlp_traces_endpoint)


def cmd_up(args) -> int:
    """The local platform on one machine: engine processes behind the gateway (which
    applies --tenants; the engines order their queues by the tenants it names)."""
    import subprocess

    from llmserve.entrypoints.launcher import ServerProcess
    from llmserve.gateway.server import listed_keys, serve_gateway
    check_up_args(args)
    configure_logging(args.log_level)
    engine_args = ["serve", "--log-level", "WARNING", *engine_argv(args)]
    print(f"starting {args.engines} engine(s) with {args.model} ...", flush=True)
    engines = []
    try:
        for _ in range(args.engines):
            engines.append(ServerProcess(engine_args, "127.0.0.1", stdout=subprocess.DEVNULL))
        config = up_gateway_config(args, [e.url for e in engines])
        name = args.served_model_name or args.model

        async def main() -> None:
            ready = asyncio.Event()
            task = asyncio.create_task(serve_gateway(config, args.host, args.port, ready))
            done, _ = await asyncio.wait([task, asyncio.create_task(ready.wait())],
                                         return_when=asyncio.FIRST_COMPLETED)
            if task in done:
                task.result()
            url = f"http://{args.host}:{args.port}"
            key = (listed_keys(config) or "").split(",")[0]
            auth = f" -H 'Authorization: Bearer {key}'" if key else ""
            print(f"\nllmserve is up: {url}  (model {name!r}, {len(engines)} engine(s): "
                  f"{', '.join(e.url for e in engines)})\n"
                  f"try:\n  curl -s {url}/v1/chat/completions -H 'Content-Type: "
                  f"application/json'{auth} -d '{{\"model\": \"{name}\", \"messages\": "
                  f"[{{\"role\": \"user\", \"content\": \"Hello!\"}}]}}'\n", flush=True)
            await task

        asyncio.run(main())
    finally:
        for e in engines:
            e.stop()
    return 0


def cmd_operator(args) -> int:
    """The kopf operator (what `kopf run` would do, with our handlers)."""
    import kopf

    import llmserve.operator.handlers  # noqa: F401 - registers the handlers
    configure_logging(args.log_level)
    namespaces = args.namespace or []
    liveness = f"http://0.0.0.0:{args.health_port}/healthz" if args.health_port else None
    if args.metrics_port:
        from llmserve.operator.metrics import serve
        serve(args.metrics_port)
    kopf.run(standalone=True, clusterwide=not namespaces, namespaces=namespaces,
             liveness_endpoint=liveness)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """Every subcommand and its flags (tests/test_cli_flags.py pins the flag sets)."""
    parser = argparse.ArgumentParser(prog="llmserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="offline chat generation, printed to stdout")
    add_engine_args(gen)
    gen.add_argument("--prompt", action="append", help="a user message (repeatable)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.set_defaults(func=cmd_generate)
    srv = sub.add_parser("serve", help="one engine behind the OpenAI-compatible HTTP API")
    add_engine_args(srv)
    add_server_args(srv, 8000)
    srv.set_defaults(func=cmd_serve)
    add_up_parser(sub)
    gw = sub.add_parser("gateway", help="prefix-aware router in front of engines")
    gw.add_argument("--backend", action="append", help="engine base URL (repeatable)")
    gw.add_argument("--k8s-service", default=None,
                    help="NAMESPACE/NAME: follow the EndpointSlices of this Service")
    gw.add_argument("--k8s-port-name", default=None,
                    help="EndpointSlice port to use (of the prefill Service too)")
    gw.add_argument("--prefill-backend", action="append", metavar="URL",
                    help="a prefill engine's base URL (repeatable): long prompts are "
                         "prefilled there and decoded by --backend / --k8s-service")
    gw.add_argument("--prefill-k8s-service", default=None, metavar="NAMESPACE/NAME",
                    help="follow the EndpointSlices of this Service as the prefill pool")
    add_server_args(gw, 8080)
    add_gateway_args(gw)
    # Under `up` the engines' flag of the same name serves the gateway too.
    gw.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                    help="export OpenTelemetry traces of requests to this OTLP/HTTP "
                         "collector, e.g. http://localhost:4318 (default: off)")
    gw.set_defaults(func=cmd_gateway)
    op = sub.add_parser("operator", help="the kopf operator for LLMDeployment resources")
    op.add_argument("--namespace", action="append",
                    help="watch only this namespace (repeatable; default: all)")
    op.add_argument("--health-port", type=int, default=8081, help="0 disables /healthz")
    op.add_argument("--metrics-port", type=int, default=0,
                    help="serve the operator's Prometheus /metrics (the autoscaler's "
                         "signals and decisions) on this port; 0 (default): off")
    op.add_argument("--log-level", default="INFO")
    op.set_defaults(func=cmd_operator)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ModelLoadError, ValueError) as e:
        print(f"llmserve: error: {e}", file=sys.stderr)
        return 2
    except (EngineStartError, EngineDeadError, WorkerDiedError) as e:
        print(f"llmserve: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
