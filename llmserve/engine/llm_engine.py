"""``LLMEngine``: the engine as one object, in one thread (vLLM v1's LLMEngine): the input
processor (requests in, checked once), the engine core (the step loop) and the output
processor (text, stop strings, the caller's output kind). ``step()`` returns the
callers' ``RequestOutput``s; the offline ``LLM`` and the async server both drive it."""

from __future__ import annotations

import logging
import time

from llmserve.config import EngineConfig
from llmserve.core.lora_request import LoRARequest
from llmserve.core.request import Request, Tenancy
from llmserve.core.sampling_params import SamplingParams
from llmserve.engine.core import EngineCore
from llmserve.engine.input_processor import InputProcessor
from llmserve.engine.model_config import resolve
from llmserve.engine.output import RequestOutput
from llmserve.engine.output_processor import IterationStats, OutputProcessor
from llmserve.engine.step_stats import SchedulerStats

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config, self.model = resolve(config)
        self.core = EngineCore(self.config, self.model)
        self.inputs = InputProcessor(self.config, self.model, self.core.block_manager)
        self.outputs = OutputProcessor(self.model.tokenizer, self.core.stop_sequence)
        self.iteration_stats = IterationStats()  # what the last step's outputs added

    # --- what the engine is (fixed once built) ---------------------------------------------
    @property
    def tokenizer(self):
        return self.model.tokenizer

    @property
    def hf_config(self):
        return self.model.hf_config

    @property
    def model_name(self) -> str:
        return self.model.name

    @property
    def model_path(self):
        return self.model.path

    @property
    def max_model_len(self) -> int:
        return self.model.max_model_len

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.model.eos_token_ids

    # --- the core's parts, by the names callers and tests reach them -------------------------
    @property
    def runner(self):
        return self.core.runner

    @property
    def tp_group(self):
        return self.core.executor.tp_group

    @property
    def draft(self):
        return self.core.executor.draft

    @property
    def block_manager(self):
        return self.core.block_manager

    @property
    def scheduler(self):
        return self.core.scheduler

    @property
    def requests(self) -> dict[str, Request]:
        return self.core.requests

    @property
    def stats(self):
        return self.core.stats

    @property
    def kv_transfer(self):
        return self.core.features.kv_transfer

    @property
    def loras(self):
        return self.core.features.loras

    @property
    def spec(self):
        """The speculator (spec_decode/speculator.py), or None."""
        speculation = self.core.features.speculation
        return speculation.speculator if speculation is not None else None

    def structured_outputs(self):
        """The grammar compiler (built on first use; safe from any thread)."""
        return self.core.features.structured.outputs()

    def check_health(self) -> None:
        """Raises WorkerDiedError once a tensor-parallel worker has died."""
        self.core.executor.check_health()

    def shutdown(self) -> None:
        self.core.shutdown()

    # --- requests ---------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        return self.inputs.tokenize(prompt)

    def validate_prompt(self, ids: list[int], params: SamplingParams) -> None:
        self.inputs.validate_prompt(ids, params)

    def check_lora(self, lora: LoRARequest | None) -> None:
        """Read and check ``lora``'s adapter now (LoRAError, a ValueError, if it cannot
        serve), so a batch of prompts fails before any is queued."""
        if lora is None:
            return
        if self.loras is None:
            raise ValueError("this engine serves no LoRA adapters (start it with "
                             "--enable-lora)")
        self.loras.ensure_loaded(lora)

    def add_request(self, prompt: str | list[int] | None, params: SamplingParams | None = None,
                    request_id: str | None = None, priority: int = 0,
                    prompt_token_ids: list[int] | None = None,
                    cache_salt: str | None = None, tenant: Tenancy | None = None,
                    remote_decode: bool = False, kv_hold: list[int] | None = None,
                    lora_request: LoRARequest | None = None) -> Request:
        """Queue a request. Raises ValueError, changing nothing, when it can never run,
        and OverloadedError when the waiting queue is at ``max_waiting``. P/D:
        ``remote_decode`` holds the prompt's KV for a decode engine when the request
        finishes (prefill role); ``kv_hold`` are blocks of an imported prefix the request
        takes over (decode role; the caller gives them back if this raises).
        ``lora_request``: the adapter it runs under (None: the base model)."""
        req = self.inputs.process(prompt, params, request_id or self.core.next_request_id(),
                                  priority, prompt_token_ids, cache_salt, tenant,
                                  remote_decode, kv_hold, lora_request)
        return self.add_processed(req)

    def add_processed(self, req: Request) -> Request:
        """Queue a request the input processor built (on another thread, say)."""
        self.core.add_request(req)
        self.outputs.add_request(req)
        return req

    def abort(self, request_id: str) -> bool:
        self.outputs.abort(request_id)
        return self.core.abort(request_id)

    def expire_waiting(self, now: float | None = None) -> list[str]:
        """Abort the requests that waited unscheduled longer than ``max_queue_delay``;
        their ids (the caller answers them 503)."""
        gone = self.core.expire_waiting(now)
        for request_id in gone:
            self.outputs.abort(request_id)
        return gone

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    # --- the step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One engine step: the outputs of the requests it changed, each in its
        ``output_kind``."""
        outputs = self.outputs.process(self.core.step())
        self.iteration_stats = self.outputs.stats
        return outputs

    def scheduler_stats(self) -> SchedulerStats:
        return self.core.scheduler_stats()

    def warm_up(self) -> None:
        """Run a prefill, a mixed prefill + decode step, greedy and sampled decodes,
        and every attention kernel variant the config can reach, before serving: a
        kernel that cannot compile fails the start-up, not the first request, and the
        first request does not pay for compilation. Leaves no trace: blocks are freed,
        nothing enters the prefix cache, counters start at zero."""
        assert not self.has_unfinished(), "warm up before serving"
        bm = self.block_manager
        caching, bm.enable_prefix_caching = bm.enable_prefix_caching, False
        try:
            capacity = bm.num_blocks * bm.block_size // 4
            prompt_len = max(1, min(64, self.config.max_num_batched_tokens, capacity,
                                    self.max_model_len - 4))
            first = list(range(3, 3 + prompt_len))
            self.add_request(first, SamplingParams(temperature=0, max_tokens=3,
                                                   ignore_eos=True), "warmup-greedy")
            self.step()  # a prefill (chunked if the budget is small)
            self.add_request(first[:max(1, prompt_len // 2)],
                             SamplingParams(temperature=1.0, top_p=0.9, max_tokens=3,
                                            ignore_eos=True, seed=0), "warmup-sampled")
            while self.has_unfinished():  # a mixed step, then decodes
                self.step()
        finally:
            bm.enable_prefix_caching = caching
        t0 = time.perf_counter()
        self.core.executor.warm_up_kernels(self.max_model_len, self.config.max_num_seqs)
        log.debug("kernels warmed up in %.1f s", time.perf_counter() - t0)
        self.core.reset_after_warm_up()
        self.iteration_stats = IterationStats()
