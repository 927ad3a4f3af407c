"""Freeing what one engine held before the next is built: the next sizes its KV cache
from the device's free memory, which an engine still alive, or the allocator's cache of
its blocks, would take from it."""

from __future__ import annotations

import contextlib
import gc

import torch


def release_device_memory() -> None:
    """Free what dropped engines and models held before the next one is built: their
    reference cycles (gc), then the PyTorch allocator's cached blocks, which
    ``torch.cuda.mem_get_info`` (the engine's KV sizing) counts as used."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


@contextlib.contextmanager
def recorded_engines(res: dict, key: str):
    """One side of a GPU check: the block appends the engines it builds to the list
    this yields. An exception becomes ``res[key] = {"error": ...}`` (the check records
    it and goes on); either way the engines are shut down and the device memory freed
    before the next side builds its own."""
    engines: list = []
    try:
        yield engines
    except Exception as e:  # noqa: BLE001 - record and go on
        res[key] = {"error": repr(e)[:500]}
    finally:
        for engine in engines:
            engine.shutdown()
        engines.clear()
        release_device_memory()
