"""A stand-in engine process for the gateway's multi-LoRA tests: it serves the
engine's model contract (``/v1/models`` with the base model first and one entry per
adapter naming its ``parent``; ``/v1/load_lora_adapter``, ``/v1/unload_lora_adapter``;
404 ``model_not_found`` for a model it does not serve) and answers completions and
chat with its own name as the text, so a test sees which engine served a request.

Run: python tests/fake_lora_engine.py --host H --port P --name E1 --base tiny
     [--adapter NAME=PATH ...]
"""

from __future__ import annotations

import argparse
import time

from aiohttp import web


class FakeLoraEngine:
    def __init__(self, name: str, base: str, adapters: dict[str, str]):
        self.name, self.base = name, base
        self.adapters = dict(adapters)  # name -> source path
        self.served = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.generate)
        app.router.add_post("/v1/chat/completions", self.generate)
        app.router.add_post("/v1/load_lora_adapter", self.load)
        app.router.add_post("/v1/unload_lora_adapter", self.unload)
        return app

    async def health(self, request):
        return web.json_response({"status": "ok"})

    async def metrics(self, request):
        return web.Response(text="vllm:num_requests_waiting 0\nvllm:kv_cache_usage_perc 0\n"
                                 f"fake:served_total {self.served}\n")

    async def models(self, request):
        created = int(time.time())
        data = [{"id": self.base, "object": "model", "created": created,
                 "owned_by": "llmserve", "root": self.base, "parent": None,
                 "max_model_len": 2048}]
        data += [{"id": name, "object": "model", "created": created, "owned_by": "llmserve",
                  "root": path, "parent": self.base, "max_model_len": 2048}
                 for name, path in self.adapters.items()]
        return web.json_response({"object": "list", "data": data})

    async def generate(self, request):
        body = await request.json()
        model = body.get("model")
        if model != self.base and model not in self.adapters:
            return error(404, f"The model `{model}` does not exist.", "NotFoundError",
                         "model_not_found", "model")
        self.served += 1
        usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
        if request.path.endswith("/chat/completions"):
            return web.json_response({
                "id": "chatcmpl-fake", "object": "chat.completion", "created": 0,
                "model": model, "usage": usage, "choices": [{
                    "index": 0, "finish_reason": "stop",
                    "message": {"role": "assistant", "content": self.name}}]})
        return web.json_response({
            "id": "cmpl-fake", "object": "text_completion", "created": 0, "model": model,
            "usage": usage, "choices": [{"index": 0, "text": self.name,
                                         "finish_reason": "stop", "logprobs": None}]})

    async def load(self, request):
        body = await request.json()
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not isinstance(path, str):
            return error(400, "lora_name and lora_path are required", "BadRequestError",
                         None, "lora_name")
        self.adapters[name] = path
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(self, request):
        name = (await request.json()).get("lora_name")
        if self.adapters.pop(name, None) is None:
            return error(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError",
                         "model_not_found", "lora_name")
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")


def error(status: int, message: str, kind: str, code, param) -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "param": param,
                                        "code": code}}, status=status)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--base", required=True)
    parser.add_argument("--adapter", action="append", default=[], help="NAME=PATH")
    args = parser.parse_args()
    adapters = dict(a.split("=", 1) for a in args.adapter)
    engine = FakeLoraEngine(args.name, args.base, adapters)
    web.run_app(engine.app(), host=args.host, port=args.port, print=None,
                handle_signals=True)


if __name__ == "__main__":
    main()
