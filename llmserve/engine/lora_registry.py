"""The engine's adapters by name: what ``--lora-modules`` and
``/v1/load_lora_adapter`` registered, each with an id of its own.

Reading and checking an adapter (``parse``) touches only the disk (or the Hub) and the
CPU and may run on any thread; ``register``, ``unregister`` and ``adopt`` change the
engine's state and run on its thread. Lookups by name (the HTTP server resolving a
request's ``model``) take the lock, so they may come from the event loop.

A source is resolved once per adapter id: an ``hf://`` source without a revision is
pinned to the snapshot it resolved to, so re-reading an adapter later (after its
parsed weights left host memory) reads the same weights, and never calls the Hub.
A live request's adapter never leaves host memory (``AdapterCache.in_use``), so steps
never read a source at all.

Unregistering a name never disturbs the requests already running under it: each
request holds its ``LoRARequest`` (name, id, source), and its weights stay cached until
the last of them finishes.
"""

from __future__ import annotations

import itertools
import threading
from pathlib import Path

from llmserve.config.lora import check_lora_name
from llmserve.core.lora_request import LoRARequest
from llmserve.engine.hooks import StepHook
from llmserve.model_executor.lora.adapter import (
    LoRAAdapter,
    LoRAError,
    load_adapter,
    resolve_adapter_source,
)


class LoRARegistry(StepHook):
    """Also the step hook of LoRA: a request's adapter is read and checked before the
    request is queued (``add_request``)."""

    def __init__(self, hf_config, max_rank: int, slots, base_name: str, live_requests):
        """``live_requests``: the engine's requests by id (their adapters stay cached)."""
        self.hf_config, self.max_rank = hf_config, max_rank
        self.cache = slots.cache  # rank 0's: the slots load from it
        self.cache.in_use = lambda: {r.lora.lora_int_id for r in list(live_requests.values())
                                     if r.lora is not None}
        self.base_name = base_name
        self._by_name: dict[str, LoRARequest] = {}
        self._sources: dict[int, tuple[str, Path]] = {}  # id -> (source, local directory)
        # Ids the engine hands out, far above the small ones offline users pick.
        self._ids = itertools.count(1 << 20)
        self._lock = threading.Lock()

    # --- reading (any thread) -------------------------------------------------------------
    def parse(self, source: str, local: Path | None = None) -> tuple[LoRAAdapter, Path]:
        """Read and check the adapter at ``source`` (from ``local``, its directory, when
        already resolved). Returns it and its directory; LoRAError says what is wrong."""
        local = local or resolve_adapter_source(source)
        return load_adapter(local, self.hf_config, self.max_rank, source), local

    def prefetch(self, lora: LoRARequest) -> tuple[LoRAAdapter, Path] | None:
        """The request's adapter read ahead, off the engine thread, when it is not in
        host memory (None when it is)."""
        if self.cache.get(lora.lora_int_id) is not None:
            return None
        with self._lock:
            known = self._sources.get(lora.lora_int_id)
        return self.parse(lora.lora_path, known[1] if known else None)

    # --- the engine thread ----------------------------------------------------------------
    def register(self, name: str, source: str, parsed: tuple[LoRAAdapter, Path]
                 ) -> tuple[LoRARequest, bool]:
        """Register ``name``. Returns (its request, whether it is new); the same name and
        source again is not an error (loads are idempotent)."""
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
        self.adopt(lora, parsed)
        return lora, True

    def adopt(self, lora: LoRARequest, parsed: tuple[LoRAAdapter, Path]) -> None:
        """Keep a parsed adapter in host memory under its id (and pin its directory)."""
        adapter, local = parsed
        with self._lock:
            self._sources.setdefault(lora.lora_int_id, (lora.lora_path, local))
        self.cache.put(lora.lora_int_id, adapter)

    def unregister(self, name: str) -> LoRARequest | None:
        with self._lock:
            return self._by_name.pop(name, None)

    def ensure_loaded(self, lora: LoRARequest) -> None:
        """A request's adapter in host memory before the request is queued: an offline
        caller's own LoRARequest is read and checked the first time its id is seen, so
        a bad adapter fails its request, never a step. One id names one source."""
        with self._lock:
            known = self._sources.get(lora.lora_int_id)
        if known is not None and known[0] != lora.lora_path:
            raise LoRAError(f"lora_int_id {lora.lora_int_id} already names the adapter at "
                            f"{known[0]}, not {lora.lora_path}")
        parsed = self.prefetch(lora)
        if parsed is not None:
            self.adopt(lora, parsed)

    def add_request(self, req) -> None:
        if req.lora is not None:
            self.ensure_loaded(req.lora)  # LoRAError (a ValueError) for a bad adapter

    # --- lookups (any thread) -------------------------------------------------------------
    def lookup(self, name: str) -> LoRARequest | None:
        with self._lock:
            return self._by_name.get(name)

    def adapters(self) -> list[LoRARequest]:
        with self._lock:
            return list(self._by_name.values())
