"""Asyncio front of the engine.

The step loop runs in its own thread, so model compute never blocks the event
loop (PyTorch releases the GIL inside its kernels). Requests and aborts reach the
engine thread through a queue; outputs come back to each request's asyncio.Queue
through ``call_soon_threadsafe``. Only the engine thread touches the engine's state
(requests, scheduler, KV cache, model). The event loop reaches the engine only through
this class, and reads only what is fixed once the engine is built, before start()
returns, and never changes after (see "fixed at start" below): the tokenizer, the
model's name and lengths, the KV cache's size. Two things are shared, each safe across
threads: the grammar compiler (under its own lock) and the metrics (the engine thread
updates them, prometheus_client's are thread-safe, /metrics reads them). Anything else
goes through the inbox.

The engine is also *built* in that thread: on CPU, a model whose weights were
loaded by another thread runs its steps about 1.5x slower (measured: 48 ms versus
87 ms per decode step of the built-in model), so one thread owns all torch work.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from llmserve.config import EngineConfig
from llmserve.core.lora_request import LoRARequest
from llmserve.core.request import Request, Tenancy
from llmserve.core.sampling_params import SamplingParams, StructuredOutputsParams
from llmserve.core.sched.overload import OverloadedError, queue_full, waiting_requests
from llmserve.distributed.kv_transfer.params import RemoteDecode, RemotePrefill
from llmserve.engine.kv_transfer_service import KVTransferService
from llmserve.engine.llm_engine import LLMEngine
from llmserve.engine.metrics import EngineMetrics
from llmserve.engine.output import RequestOutput
from llmserve.errors import EngineDeadError, EngineStartError  # noqa: F401 - re-exported
from llmserve.platforms.memory import page_out_libraries, release_freed_memory

log = logging.getLogger(__name__)


def _put_each(pairs: list[tuple[asyncio.Queue, object]]) -> None:
    for sink, item in pairs:
        sink.put_nowait(item)


@dataclass
class _Add:
    request: Request  # built and checked by the input processor, on the event loop
    sink: asyncio.Queue
    remote: RemotePrefill | None = None  # P/D leg 2 on a decode engine: where the KV is
    lora_parsed: tuple | None = None  # its adapter's weights, read off the engine thread


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Call:
    """Run ``fn(engine)`` on the engine thread; its result (or exception) settles
    ``future`` on the event loop."""
    fn: object
    future: asyncio.Future


class AsyncLLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.engine: LLMEngine | None = None  # built by the engine thread
        self.metrics: EngineMetrics | None = None
        self._ready = threading.Event()
        self._inbox: queue.Queue = queue.Queue()
        self._wake = threading.Event()
        self._sinks: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop = False
        self.error: BaseException | None = None
        # Overload fast path (max_waiting): requests handed to the engine thread but not
        # yet queued there, and the unscheduled requests it last saw waiting. A burst is
        # refused here at once, not one engine step later per request.
        self._count_lock = threading.Lock()
        self._pending_adds = 0
        self.num_waiting = 0
        self.free_slots = config.max_num_seqs  # sequence slots free at the last look
        self.kv_service: KVTransferService | None = None  # P/D (kv_role prefill|decode)

    # --- lifecycle ----------------------------------------------------------------
    async def start(self) -> None:
        """Build the engine in its thread and start the step loop; raises what the
        build raised (e.g. ModelLoadError)."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()
        await self._loop.run_in_executor(None, self._ready.wait)
        if self.error is not None:
            raise self.error
        if self.engine.kv_transfer is not None:
            self.kv_service = KVTransferService(self, self.engine.kv_transfer)
            self.kv_service.start(self._wake.set)

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        if self._thread:
            self._thread.join(timeout=10)
        if self.kv_service is not None:
            self.kv_service.close()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    @property
    def num_in_flight(self) -> int:
        return len(self._sinks)

    # --- fixed at start: safe to read from the event loop ----------------------------
    # Set by the engine thread before start() returns and never rebound. The tokenizer is
    # shared with the engine thread's detokenizer: encoding, decoding and templates only
    # read it (neither side changes its truncation or padding, the one thing a fast
    # tokenizer mutates per call).
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.hf_config.vocab_size

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        return self.engine.tokenize(prompt)

    async def compile_grammar(self, spec: StructuredOutputsParams) -> None:
        """Compile (or find cached) a request's grammar off the event loop; raises
        GrammarError. The compiler is built on first use (wrapping the tokenizer takes
        ~0.3 s, off the loop too) and compiles under its own lock, so the engine thread
        may use it meanwhile."""
        await asyncio.to_thread(lambda: self.engine.structured_outputs().compile(spec))

    # --- requests ----------------------------------------------------------------
    def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                 request_id: str, prompt: str | None = None, priority: int = 0,
                 cache_salt: str | None = None, tenant: Tenancy | None = None,
                 kv_transfer: RemoteDecode | RemotePrefill | None = None,
                 lora_request: LoRARequest | None = None
                 ) -> AsyncIterator[RequestOutput]:
        """The request's outputs as they come (each in ``params.output_kind``); the
        request is aborted if the consumer stops early. Raises at once, before anything
        is queued, EngineDeadError when the engine is not running and ValueError for a
        request that can never run (checked here, once: the input processor reads only
        what is fixed at start). ``kv_transfer``: a P/D leg, honoured when this engine
        has that role (ignored otherwise, as vLLM does). ``lora_request``: the adapter
        (``lora(name)``)."""
        if not self.alive:
            raise EngineDeadError("the engine is not running")
        role = self.config.kv_role
        request = self.engine.inputs.process(
            prompt, params, request_id, priority, prompt_token_ids, cache_salt, tenant,
            remote_decode=isinstance(kv_transfer, RemoteDecode) and role == "prefill",
            lora_request=lora_request)
        add = _Add(request, asyncio.Queue())
        if isinstance(kv_transfer, RemotePrefill) and role == "decode":
            add.remote = kv_transfer
        return self._stream(add)

    async def _stream(self, add: _Add) -> AsyncIterator[RequestOutput]:
        req = add.request
        if add.remote is not None:  # P/D leg 2: bring the prompt's KV over first
            req.kv_hold = await self.kv_service.import_prefix(
                req.prompt_token_ids, req.cache_salt, add.remote)
        if req.lora is not None:  # read from its source here, never on the engine thread
            add.lora_parsed = await asyncio.to_thread(self.engine.loras.prefetch, req.lora)
        try:
            self._admit()
        except BaseException:
            self.release_hold(req.kv_hold)
            raise
        self._sinks[req.request_id] = add.sink
        self._inbox.put(add)
        self._wake.set()
        finished = False
        try:
            while True:
                item = await add.sink.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self._sinks.pop(req.request_id, None)
            if not finished:
                self.abort(req.request_id)

    def _admit(self) -> None:
        """Refuse at once when the waiting queue is already full (the engine thread
        checks again, exactly, when it queues the request)."""
        limit = self.config.max_waiting
        with self._count_lock:
            # Pending requests will fill free slots first, and only then wait.
            if limit is not None and \
                    self._pending_adds + self.num_waiting >= limit + self.free_slots:
                self.metrics.on_overload("queue_full")
                raise queue_full(self._pending_adds + self.num_waiting, limit,
                                 self.config.max_queue_delay)
            self._pending_adds += 1

    # --- LoRA adapters (--enable-lora) -------------------------------------------------
    def lora(self, name: str) -> LoRARequest | None:
        """The adapter registered as ``name`` (None: no such adapter, or LoRA off)."""
        registry = self.engine.loras
        return registry.lookup(name) if registry is not None else None

    def loras(self) -> list[LoRARequest]:
        registry = self.engine.loras
        return registry.adapters() if registry is not None else []

    async def load_lora(self, name: str, source: str) -> tuple[LoRARequest, bool]:
        """Read and check the adapter off the event loop and the engine thread, then
        register it between steps. Returns (its request, whether it is new); raises
        LoRAError (a ValueError) naming what is wrong, changing nothing."""
        registry = self.engine.loras
        if registry is None:
            raise ValueError("this engine serves no LoRA adapters (start it with "
                             "--enable-lora)")
        known = registry.lookup(name)
        if known is not None and known.lora_path == source:
            return known, False
        adapter = await asyncio.to_thread(registry.parse, source)
        return await self.on_engine(lambda e: e.loras.register(name, source, adapter))

    async def unload_lora(self, name: str) -> LoRARequest | None:
        """Forget ``name``; requests already running under it finish with it."""
        if self.engine.loras is None:
            return None
        return await self.on_engine(lambda e: e.loras.unregister(name))

    def abort(self, request_id: str) -> None:
        self._inbox.put(_Abort(request_id))
        self._wake.set()

    def on_engine(self, fn) -> asyncio.Future:
        """Run ``fn(engine)`` on the engine thread, between steps; await its result."""
        future = self._loop.create_future()
        self._inbox.put(_Call(fn, future))
        self._wake.set()
        return future

    def release_hold(self, block_ids: list[int]) -> None:
        """Give back blocks of an imported prefix no request took over."""
        if block_ids:
            self.on_engine(lambda e: e.block_manager.unhold(block_ids))

    # --- the engine thread ---------------------------------------------------------
    def _run(self) -> None:
        try:
            self.engine = LLMEngine(self.config)
            if self.engine.config.device == "cpu":
                # Loading ran far more library code than serving does: hand it back,
                # and let the warm-up bring back what a step runs.
                page_out_libraries()
            self._warm_up()
            self.metrics = EngineMetrics(self.engine.model_name,
                                         max_num_seqs=self.config.max_num_seqs,
                                         max_loras=self.config.max_loras)
        except BaseException as e:  # noqa: BLE001 - reported by start()
            self.error = e
            if self.engine is not None:
                self.engine.shutdown()
            self._ready.set()
            return
        release_freed_memory(after_start_up=True)  # what loading and warm-up freed
        self._ready.set()
        worked_since_trim = False
        try:
            while not self._stop:
                self.engine.check_health()  # a dead tensor-parallel worker ends the loop
                self._drain_inbox()
                if self.kv_service is not None:
                    self.kv_service.collect_leases()
                self._expire_waiting()
                self._publish_waiting()
                if not self.engine.has_unfinished():
                    self.metrics.record(self.engine.scheduler_stats())
                    woken = self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    if not woken and worked_since_trim:  # idle for 0.5 s after work
                        release_freed_memory()
                        worked_since_trim = False
                    continue
                worked_since_trim = True
                outputs = self.engine.step()
                self.metrics.record(self.engine.scheduler_stats(), self.engine.iteration_stats)
                self._deliver_step(outputs)
        except BaseException as e:  # noqa: BLE001 - a dead engine must fail every request
            log.exception("engine loop died")
            self.error = e
            for request_id in list(self._sinks):
                self._deliver(request_id, EngineDeadError(f"engine loop died: {e!r}"))
        finally:
            self.engine.shutdown()

    def _warm_up(self) -> None:
        """Before start() returns, i.e. before the server listens and /health answers."""
        t0 = time.perf_counter()
        try:
            self.engine.warm_up()
        except Exception as e:
            backend = "triton" if self.engine.runner.use_triton else "torch"
            raise EngineStartError(f"the engine failed its warm-up on {self.config.device} "
                                   f"with the {backend} attention backend: {e}") from e
        log.info("warm-up done in %.1f s", time.perf_counter() - t0)

    def _drain_inbox(self) -> None:
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, _Abort):
                if self.engine.abort(cmd.request_id):
                    self.metrics.aborted += 1
                continue
            if isinstance(cmd, _Call):
                self._call(cmd)
                continue
            with self._count_lock:
                self._pending_adds -= 1
            self._add(cmd)

    def _add(self, cmd: _Add) -> None:
        req = cmd.request
        if req.request_id not in self._sinks:  # cancelled before it got here
            self.engine.block_manager.unhold(req.kv_hold)
            return
        try:
            if cmd.lora_parsed is not None:
                self.engine.loras.adopt(req.lora, cmd.lora_parsed)
            self.engine.add_processed(req)
        except (ValueError, OverloadedError) as e:
            self.engine.block_manager.unhold(req.kv_hold)
            if isinstance(e, OverloadedError):
                self.metrics.on_overload("queue_full")
            self._deliver(req.request_id, e)

    def _call(self, cmd: _Call) -> None:
        try:
            result, error = cmd.fn(self.engine), None
        except Exception as e:  # noqa: BLE001 - handed to the awaiting coroutine
            result, error = None, e

        def settle() -> None:
            if cmd.future.done():  # its awaiter was cancelled
                return
            if error is not None:
                cmd.future.set_exception(error)
            else:
                cmd.future.set_result(result)
        self._loop.call_soon_threadsafe(settle)

    def _publish_waiting(self) -> None:
        if self.config.max_waiting is not None:
            sched = self.engine.scheduler
            self.num_waiting = len(waiting_requests(sched.waiting))
            self.free_slots = max(0, self.config.max_num_seqs - len(sched.running))

    def _expire_waiting(self) -> None:
        if self.config.max_queue_delay is None:
            return
        for request_id in self.engine.expire_waiting():
            self.metrics.on_overload("queue_delay")
            self._deliver(request_id, OverloadedError(
                f"the request waited more than max_queue_delay="
                f"{self.config.max_queue_delay:g} s without being scheduled; retry later "
                f"or elsewhere", retry_after=self.config.max_queue_delay))

    def _deliver(self, request_id: str, item) -> None:
        sink = self._sinks.get(request_id)
        if sink is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(sink.put_nowait, item)

    def _deliver_step(self, outputs: list[RequestOutput]) -> None:
        """A step's outputs onto the event loop in one call: each call_soon_threadsafe
        writes to the loop's wake-up socket, a system call on the engine thread between
        two steps, and 32 streams made 32 of them a step."""
        pairs = [(sink, out) for out in outputs
                 if (sink := self._sinks.get(out.request_id)) is not None]
        if pairs and self._loop is not None:
            self._loop.call_soon_threadsafe(_put_each, pairs)
