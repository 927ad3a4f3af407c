"""The engine's adapters by name: what ``--lora-modules`` and
``/v1/load_lora_adapter`` registered, each with an id of its own.

Reading and checking an adapter (``parse``) touches only the disk and the CPU and may
run on any thread; ``register`` and ``unregister`` change the names and run on the
engine's thread. Lookups by name (the HTTP server resolving a request's ``model``) take
the lock, so they may come from the event loop.

Unregistering a name never disturbs the requests already running under it: each
request holds its ``LoRARequest`` (name, id, source), and the slots keep or re-read the
weights by id until the last of them finishes.
"""

from __future__ import annotations

import itertools
import threading

from llmserve.core.lora_request import LoRARequest
from llmserve.model_executor.lora.adapter import (
    LoRAAdapter,
    LoRAError,
    load_adapter,
    resolve_adapter_source,
)
from llmserve.model_executor.lora.modules import check_lora_name


class LoRARegistry:
    def __init__(self, hf_config, max_rank: int, slots, base_name: str):
        self.hf_config, self.max_rank = hf_config, max_rank
        self.slots = slots  # rank 0's LoRASlots: its cache receives parsed adapters
        self.base_name = base_name
        self._by_name: dict[str, LoRARequest] = {}
        # Ids the engine hands out, far above the small ones offline users pick.
        self._ids = itertools.count(1 << 20)
        self._lock = threading.Lock()

    def parse(self, source: str) -> LoRAAdapter:
        """Read and check the adapter at ``source``; LoRAError saying what is wrong."""
        return load_adapter(resolve_adapter_source(source), self.hf_config, self.max_rank,
                            source)

    def register(self, name: str, source: str, adapter: LoRAAdapter) -> tuple[LoRARequest, bool]:
        """Register ``name`` (engine thread). Returns (its request, whether it is new);
        the same name and source again is not an error (loads are idempotent)."""
        check_lora_name(name)
        if name == self.base_name:
            raise LoRAError(f"adapter name {name!r} is the base model's name")
        with self._lock:
            known = self._by_name.get(name)
            if known is not None:
                if known.lora_path == source:
                    return known, False
                raise LoRAError(f"adapter {name!r} is already loaded from {known.lora_path}; "
                                f"unload it first to load it from {source}")
            lora = LoRARequest(name, next(self._ids), source)
            self._by_name[name] = lora
        self.slots.cache.put(lora.lora_int_id, adapter)
        return lora, True

    def unregister(self, name: str) -> LoRARequest | None:
        with self._lock:
            return self._by_name.pop(name, None)

    def lookup(self, name: str) -> LoRARequest | None:
        with self._lock:
            return self._by_name.get(name)

    def adapters(self) -> list[LoRARequest]:
        with self._lock:
            return list(self._by_name.values())

    def ensure_loaded(self, lora: LoRARequest) -> None:
        """An offline caller's own LoRARequest: read and check it the first time its id
        is seen (engine thread), so a bad adapter fails its request, not a later step."""
        if self.slots.cache.get(lora.lora_int_id) is None:
            self.slots.cache.put(lora.lora_int_id, self.parse(lora.lora_path))
