"""A CPU forward waits for the event loop to write the last step's tokens
(``async_llm.py``'s ``_wait_written``): the engine thread's signal is set only after the
handlers its outputs woke have run, never before; a step with no outputs for the loop
leaves it set; and a CPU engine started by the server has the wait installed."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

from llmserve.config import EngineConfig
from llmserve.engine.async_llm import AsyncLLMEngine


class Recording(threading.Event):
    """An Event that notes what the handlers had received when it was set."""

    def __init__(self, got: list):
        super().__init__()
        self.got, self.seen_at_set = got, None

    def set(self):
        self.seen_at_set = list(self.got)
        super().set()


async def test_written_is_set_once_the_woken_handlers_have_run():
    engine = AsyncLLMEngine(EngineConfig(model="smollm2-135m-instruct"))
    engine._loop = asyncio.get_running_loop()
    got: list = []
    sinks = {f"r{i}": asyncio.Queue() for i in range(5)}
    engine._sinks.update(sinks)

    async def handler(name):  # a streaming response: one token in, one chunk out
        got.append((name, await sinks[name].get()))
        await asyncio.sleep(0)

    tasks = [asyncio.create_task(handler(name)) for name in sinks]
    await asyncio.sleep(0)  # every handler waits on its queue
    engine._written = Recording(got)
    outputs = [SimpleNamespace(request_id=name) for name in sinks]
    threading.Thread(target=engine._deliver_step, args=(outputs,)).start()
    assert await asyncio.to_thread(engine._written.wait, 10)
    assert sorted(name for name, _ in engine._written.seen_at_set) == sorted(sinks)
    await asyncio.gather(*tasks)

    # A step whose outputs no handler waits for (aborted requests) leaves it set.
    engine._deliver_step([SimpleNamespace(request_id="gone")])
    assert engine._written.is_set()


async def test_a_cpu_engine_waits_for_the_writes_before_each_forward(tiny_llama, monkeypatch):
    engine = AsyncLLMEngine(EngineConfig(model=str(tiny_llama), kv_cache_memory=1 << 22))
    await engine.start()
    try:
        assert engine.engine.before_forward == engine._wait_written
    finally:
        engine.shutdown()
    monkeypatch.setenv("LLMSERVE_FORWARD_AFTER_WRITES", "0")
    engine = AsyncLLMEngine(EngineConfig(model=str(tiny_llama), kv_cache_memory=1 << 22))
    await engine.start()
    try:
        assert engine.engine.before_forward is None
    finally:
        engine.shutdown()
