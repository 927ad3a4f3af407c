"""The ``llmserve`` command: generate | serve | up | gateway | operator."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from dataclasses import replace

from llmserve import envs
from llmserve.config import EngineConfig
from llmserve.entrypoints.config_flags import add_flags, config_kwargs, flag_fields, flag_name
from llmserve.errors import EngineDeadError, EngineStartError, ModelLoadError, WorkerDiedError
from llmserve.gateway.config import GatewayConfig
from llmserve.http_serving import BODY_TIMEOUT, DRAIN_TIMEOUT, HEADER_TIMEOUT

# The engine's flags are EngineConfig's flag() fields: their names, defaults, choices
# and help live there, once.
ENGINE_FIELDS = flag_fields(EngineConfig)
ENGINE_KEYS = tuple(f.name for f in ENGINE_FIELDS)
# Fields whose argparse dest is not their name: under `up` the gateway has a
# --max-waiting of its own (its spill-over level), so the engine's overload flags keep
# their names but not their dests.
_DESTS = {"max_waiting": "engine_max_waiting", "max_queue_delay": "engine_max_queue_delay"}

# The gateway's flags are GatewayConfig's, likewise. Where the engines are is asked of
# `gateway` only (`up` starts its own), ahead of the server flags, as its help lists
# them; under `up` the engines' --otlp-traces-endpoint serves the gateway too.
_DISCOVERY = ("backends", "k8s_service", "k8s_port_name", "prefill_backends",
              "prefill_k8s_service")
GATEWAY_FIELDS = flag_fields(GatewayConfig)
_GATEWAY_DISCOVERY = tuple(f for f in GATEWAY_FIELDS if f.name in _DISCOVERY)
_GATEWAY_ROUTING = tuple(f for f in GATEWAY_FIELDS if f.name not in _DISCOVERY)
_UP_GATEWAY = tuple(f for f in _GATEWAY_ROUTING if f.name != "otlp_traces_endpoint")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """EngineConfig's flags, in its field order, in the groups they name ("engine" if
    none)."""
    add_flags(p, EngineConfig, ENGINE_FIELDS, "engine", dests=_DESTS)


def engine_kwargs(args) -> dict:
    """EngineConfig's keyword arguments from parsed engine flags."""
    return config_kwargs(args, ENGINE_FIELDS, _DESTS)


def engine_argv(args) -> list[str]:
    """The engine flags of ``args`` as a command line (what `up` hands its engines)."""
    argv = []
    for f in ENGINE_FIELDS:
        value = getattr(args, _DESTS.get(f.name, f.name))
        if isinstance(value, bool) and f.default is None:  # --x / --no-x: given when set
            argv += ["--" + ("" if value else "no-") + f.name.replace("_", "-")]
        elif isinstance(value, bool):  # switches: given when not at their default
            argv += [flag_name(f)] if value != f.default else []
        elif isinstance(value, list):  # nargs="+": --lora-modules a=X b=Y
            argv += [flag_name(f), *map(str, value)] if value else []
        elif value is not None:
            argv += [flag_name(f), str(value)]
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
    p.add_argument("--drain-timeout", type=float, default=DRAIN_TIMEOUT,
                   help="seconds in-flight requests may take after SIGTERM")
    p.add_argument("--header-timeout", type=float, default=HEADER_TIMEOUT,
                   help="close a connection whose request head is incomplete (or that is "
                        "idle) after this many seconds (slow clients)")
    p.add_argument("--body-timeout", type=float, default=BODY_TIMEOUT,
                   help="answer 408 and close when a request body takes longer than this")
    p.add_argument("--log-level", default="INFO")


def cmd_serve(args) -> int:
    from llmserve.entrypoints.openai.api_server import serve
    configure_logging(args.log_level)
    asyncio.run(serve(engine_config(args), args.host, args.port, args.api_key,
                      args.drain_timeout, header_timeout=args.header_timeout,
                      body_timeout=args.body_timeout))
    return 0


def add_gateway_args(p: argparse.ArgumentParser, up: bool = False) -> None:
    """GatewayConfig's routing, disaggregation and tenants flags. Under ``up`` its
    --max-waiting is --gateway-max-waiting (that name is the engines' overload flag, as
    under `serve`)."""
    if up:
        add_flags(p, GatewayConfig, _UP_GATEWAY, "gateway",
                  names={"max_waiting": "--gateway-max-waiting"})
    else:
        add_flags(p, GatewayConfig, _GATEWAY_ROUTING, "gateway")


def gateway_config(args, backends: list[str]) -> GatewayConfig:
    """The gateway's config from parsed flags; ``backends``: `gateway`'s --backend or the
    engines `up` started."""
    # The GatewayConfig flags this command has; under `up` --otlp-traces-endpoint is the
    # engines' flag, of the same dest.
    present = [f for f in GATEWAY_FIELDS if hasattr(args, f.name)]
    return GatewayConfig(**{**config_kwargs(args, present), "backends": backends,
                            "drain_timeout": args.drain_timeout,
                            "header_timeout": args.header_timeout,
                            "body_timeout": args.body_timeout})


def cmd_gateway(args) -> int:
    from llmserve.gateway.server import serve_gateway
    configure_logging(args.log_level)
    if not args.backends and not args.k8s_service:
        raise ValueError("give --backend URL (repeatable) or --k8s-service NAMESPACE/NAME")
    for flag in ("k8s_service", "prefill_k8s_service"):
        if getattr(args, flag) and "/" not in getattr(args, flag):
            raise ValueError(f"--{flag.replace('_', '-')} must be NAMESPACE/NAME")
    if args.peer_service and "/" not in args.peer_service:
        raise ValueError("--peer-service must be NAMESPACE/NAME")
    if (args.peers or args.peer_service) and not args.tenants_file:
        raise ValueError("--peer / --peer-service share tenants' limits: give --tenants")
    asyncio.run(serve_gateway(gateway_config(args, args.backends or []), args.host, args.port))
    return 0


def add_up_parser(sub) -> argparse.ArgumentParser:
    """`up`: the engine flags (overload ones included, named as under `serve`), the
    server flags and the gateway's, whose spill-over level is --gateway-max-waiting."""
    up = sub.add_parser("up", help="the local platform on the built-in model, one command")
    add_engine_args(up)
    add_server_args(up, 8000)
    add_gateway_args(up, up=True)
    up.add_argument("--engines", type=int, default=1, help="engine processes behind the gateway")
    up.set_defaults(func=cmd_up)
    return up


def up_gateway_config(args, backends: list[str]) -> GatewayConfig:
    """The gateway `up` runs in its own process: its --api-key is a key the gateway
    accepts, given in the config (not through the environment its engines inherit)."""
    config = gateway_config(args, backends)
    return replace(config, api_keys=args.api_key) if args.api_key else config


def check_up_args(args) -> None:
    """Refuse what the gateway would refuse, before the engines take their time to start."""
    if args.tenants_file:
        from llmserve.gateway.server import ApiKeys, check_tenant_keys, listed_keys
        from llmserve.gateway.tenants import TenantsFile
        TenantsFile(args.tenants_file)  # TenantsError (a ValueError) names what is wrong
        config = up_gateway_config(args, [])
        check_tenant_keys(args.tenants_file, ApiKeys(config.api_key_file, listed_keys(config)))
    if (args.peers or args.peer_service) and not args.tenants_file:
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
    """Every subcommand and its flags (tests/entrypoints/test_cli_flags.py pins the flag sets)."""
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
    add_flags(gw, GatewayConfig, _GATEWAY_DISCOVERY, "gateway")
    add_server_args(gw, 8080)
    add_gateway_args(gw)
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
