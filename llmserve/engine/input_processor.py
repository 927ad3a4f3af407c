"""What a caller submits, turned into the engine's ``Request`` and checked once, before
anything is queued: a request that can never run is refused here with a ValueError
naming why (a ``ParamError`` names its field).

It reads only what is fixed once the engine is built (the tokenizer, the vocabulary,
the model's length, the KV cache's size), so the server calls it on its own thread and
hands the engine thread a request that needs no second look. What depends on the
engine's state (a full queue, an id in use, an adapter's weights) is the engine
core's to check as it queues the request.
"""

from __future__ import annotations

from dataclasses import replace

from llmserve.config import EngineConfig
from llmserve.core.block_manager import BlockManager
from llmserve.core.lora_request import LoRARequest
from llmserve.core.request import Request, Tenancy
from llmserve.core.sampling_params import ParamError, SamplingParams
from llmserve.engine.bad_words import bad_words_token_ids
from llmserve.engine.model_config import ModelConfig


class InputProcessor:
    def __init__(self, config: EngineConfig, model: ModelConfig, block_manager: BlockManager):
        self.config, self.model = config, model
        self.block_manager = block_manager  # read only: its size and block arithmetic

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.model.tokenizer.encode(prompt)
        return list(prompt)

    def process(self, prompt: str | list[int] | None, params: SamplingParams | None,
                request_id: str, priority: int = 0,
                prompt_token_ids: list[int] | None = None, cache_salt: str | None = None,
                tenant: Tenancy | None = None, remote_decode: bool = False,
                kv_hold: list[int] | None = None,
                lora_request: LoRARequest | None = None) -> Request:
        """The request to queue. Fills in what the caller left to the engine
        (``max_tokens``, the beam search's length, bad words as token ids) in
        ``params``, which the request keeps."""
        params = params or SamplingParams()
        check_cache_salt(cache_salt)
        if lora_request is not None and not self.config.enable_lora:
            raise ValueError("this engine serves no LoRA adapters (start it with "
                             "--enable-lora)")
        ids = prompt_token_ids if prompt_token_ids is not None else self.tokenize(prompt)
        self.validate_prompt(ids, params)
        if params.max_tokens is None:
            params.max_tokens = self.model.max_model_len - len(ids)
        if params.beam is not None:  # the search stops where sampling would
            params.beam = replace(params.beam, max_tokens=params.max_tokens)
        if params.bad_words:
            params.bad_words_token_ids = bad_words_token_ids(
                params.bad_words, self.model.tokenizer, self.model.vocab_size)
        salt = (lora_request.cache_salt if lora_request else b"") + (cache_salt or "").encode()
        return Request(request_id, prompt if isinstance(prompt, str) else None, list(ids),
                       params, priority=priority, cache_salt=salt, lora=lora_request,
                       tenant=tenant.name if tenant else "",
                       tenant_weight=tenant.weight if tenant else 1.0,
                       remote_decode=remote_decode and self.config.kv_role != "both",
                       kv_hold=list(kv_hold or []))

    def validate_prompt(self, ids: list[int], params: SamplingParams) -> None:
        if not ids:
            raise ValueError("the prompt is empty")
        vocab = self.model.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        params.check_token_ids(vocab)
        max_len = self.model.max_model_len
        total = len(ids) + (params.max_tokens or 0)
        if len(ids) >= max_len or total > max_len:
            raise ValueError(
                f"this model's maximum context length is {max_len} tokens; the "
                f"prompt has {len(ids)} and max_tokens asks for {params.max_tokens or 0} more")
        chunk = (self.config.max_num_batched_tokens if self.config.enable_chunked_prefill
                 else total)  # unchunked, a recompute prefills everything at once
        blocks = self.block_manager.blocks_at_once(total, chunk)
        if blocks > self.block_manager.num_blocks:
            raise ValueError(f"the prompt plus max_tokens needs {blocks} KV blocks; the "
                             f"cache has {self.block_manager.num_blocks}")


def check_cache_salt(cache_salt: str | None) -> None:
    """A request's own prefix-cache salt: any text but NUL, which marks the salts of
    LoRA adapters (``LoRARequest.cache_salt``), so a client cannot forge one."""
    if cache_salt and "\x00" in cache_salt:
        raise ParamError("cache_salt", "cache_salt must not contain NUL characters")
