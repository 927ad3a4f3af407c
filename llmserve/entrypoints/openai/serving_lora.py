"""``/v1/models``' adapter entries and the adapter endpoints of ``--enable-lora``:
``POST /v1/load_lora_adapter {"lora_name", "lora_path"}`` and
``POST /v1/unload_lora_adapter {"lora_name"}``, vLLM's names and answers. Both sit behind
the API key (every /v1 route does) and are absent with ``--disable-lora-updates``."""

from __future__ import annotations

from aiohttp import web

from llmserve.entrypoints.openai.protocol import APIError, bad_request
from llmserve.entrypoints.openai.serving_engine import ENGINE, check_admitting, read_json
from llmserve.model_executor.lora.adapter import LoRAError


def adapter_entries(request: web.Request, created: int) -> list[dict]:
    engine = request.app[ENGINE]
    return [{"id": lora.lora_name, "object": "model", "created": created,
             "owned_by": "llmserve", "root": lora.lora_path, "parent": engine.model_name,
             "max_model_len": engine.max_model_len} for lora in engine.loras()]


def _field(body, name: str) -> str:
    value = body.get(name) if isinstance(body, dict) else None
    if not isinstance(value, str) or not value:
        raise bad_request(f"'{name}' is required and must be a non-empty string", name)
    return value


async def load_lora_adapter(request: web.Request) -> web.Response:
    check_admitting(request)
    body = await read_json(request)
    name, source = _field(body, "lora_name"), _field(body, "lora_path")
    try:
        _, new = await request.app[ENGINE].load_lora(name, source)
    except (LoRAError, ValueError) as e:
        raise bad_request(str(e), "lora_path" if isinstance(e, LoRAError) else "lora_name") \
            from e
    verb = "added" if new else "was already loaded"
    return web.Response(text=f"Success: LoRA adapter '{name}' {verb} successfully."
                        if new else f"Success: LoRA adapter '{name}' {verb}.")


async def unload_lora_adapter(request: web.Request) -> web.Response:
    body = await read_json(request)
    name = _field(body, "lora_name")
    if await request.app[ENGINE].unload_lora(name) is None:
        raise APIError(404, f"the LoRA adapter '{name}' is not loaded", "not_found_error",
                       "lora_name", "model_not_found")
    return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")


def add_routes(app: web.Application, engine) -> None:
    if engine.config.enable_lora and not engine.config.disable_lora_updates:
        app.router.add_post("/v1/load_lora_adapter", load_lora_adapter)
        app.router.add_post("/v1/unload_lora_adapter", unload_lora_adapter)
