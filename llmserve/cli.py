"""The ``llmserve`` command: generate | serve | up (more as they land)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from llmserve.engine.models.loader import ModelLoadError


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default="smollm2-135m-instruct",
                   help="checkpoint directory, .gguf file or built-in name")
    g.add_argument("--served-model-name", default=None)
    g.add_argument("--device", default="auto")
    g.add_argument("--dtype", default="auto", help="auto | float32 | float16 | bfloat16")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--kv-cache-memory", type=int, default=None, help="KV cache bytes")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--max-num-seqs", type=int, default=128)
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget per step (default 2048 on CUDA, 512 on CPU)")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--no-chunked-prefill", dest="enable_chunked_prefill", action="store_false")
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false")
    g.add_argument("--preemption-mode", choices=["recompute", "swap"], default="recompute")
    g.add_argument("--swap-space", type=int, default=1 << 30, help="CPU swap bytes")
    g.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default="fcfs")
    g.add_argument("--attention-backend", choices=["auto", "triton", "torch"], default="auto")


ENGINE_KEYS = ("model", "served_model_name", "device", "dtype", "block_size", "kv_cache_memory",
               "gpu_memory_utilization", "max_num_seqs", "max_num_batched_tokens",
               "max_model_len", "enable_chunked_prefill", "enable_prefix_caching",
               "preemption_mode", "swap_space", "scheduling_policy", "attention_backend")


def engine_config(args):
    from llmserve.engine.config import EngineConfig
    return EngineConfig(**{k: getattr(args, k) for k in ENGINE_KEYS})


def cmd_generate(args) -> int:
    from llmserve.engine.llm_engine import LLM
    from llmserve.engine.sampling import SamplingParams
    llm = LLM(**{k: getattr(args, k) for k in ENGINE_KEYS})
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens,
                            seed=args.seed)
    prompts = args.prompt or ["What is the capital of France?",
                              "Write a haiku about paged KV caches."]
    outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    for prompt, out in zip(prompts, outs):
        print(f"> {prompt}\n{out.outputs[0].text}\n")
    return 0


def add_server_args(p: argparse.ArgumentParser, port: int) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=port)
    p.add_argument("--api-key", default=os.environ.get("LLMSERVE_API_KEY"),
                   help="require this Bearer token on /v1 paths (or LLMSERVE_API_KEY)")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds in-flight requests may take after SIGTERM")
    p.add_argument("--log-level", default="INFO")


def cmd_serve(args) -> int:
    from llmserve.engine.server import serve
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(serve(engine_config(args), args.host, args.port, args.api_key,
                      args.drain_timeout))
    return 0


def cmd_up(args) -> int:
    """The whole local platform on one machine: engine (+ gateway once it lands)."""
    from llmserve.engine.server import serve
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = engine_config(args)

    async def main() -> None:
        ready = asyncio.Event()
        task = asyncio.create_task(serve(config, args.host, args.port, args.api_key,
                                         args.drain_timeout, ready))
        done, _ = await asyncio.wait([task, asyncio.create_task(ready.wait())],
                                     return_when=asyncio.FIRST_COMPLETED)
        if task in done:  # failed to start: re-raise its error
            task.result()
        url = f"http://{args.host}:{args.port}"
        name = config.served_model_name or config.model
        auth = f" -H 'Authorization: Bearer {args.api_key}'" if args.api_key else ""
        print(f"\nllmserve is up: {url}  (model {name!r})\n"
              f"try:\n  curl -s {url}/v1/chat/completions -H 'Content-Type: application/json'"
              f"{auth} -d '{{\"model\": \"{name}\", \"messages\": "
              f"[{{\"role\": \"user\", \"content\": \"Hello!\"}}]}}'\n", flush=True)
        await task

    asyncio.run(main())
    return 0


def main(argv: list[str] | None = None) -> int:
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
    up = sub.add_parser("up", help="the local platform on the built-in model, one command")
    add_engine_args(up)
    add_server_args(up, 8000)
    up.set_defaults(func=cmd_up)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ModelLoadError, ValueError) as e:
        print(f"llmserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
