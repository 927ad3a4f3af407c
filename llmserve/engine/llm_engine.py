"""The engine step loop (schedule -> run -> postprocess) and the offline ``LLM`` API."""

from __future__ import annotations

import itertools
import json
import logging
import threading
import time
import weakref
from dataclasses import replace
from pathlib import Path

from llmserve.config import EngineConfig
from llmserve.core.beam_search import BeamSearch
from llmserve.core.block_manager import BlockManager
from llmserve.core.lora_request import LoRARequest
from llmserve.core.request import Logprob, Request, Sequence, SequenceStatus, Tenancy
from llmserve.core.sampling_params import ParamError, SamplingParams
from llmserve.core.sched.cost_model import StepCostModel
from llmserve.core.sched.overload import check_admission, expired
from llmserve.core.sched.scheduler import Scheduler
from llmserve.distributed.shapes import check_tensor_parallel
from llmserve.engine.bad_words import bad_words_token_ids
from llmserve.engine.beam_search import BeamStepper
from llmserve.engine.detokenizer import Detokenizer
from llmserve.engine.disagg import KVTransferSide
from llmserve.engine.lora_registry import LoRARegistry
from llmserve.engine.output import RequestOutput
from llmserve.engine.overlap import OverlappedSteps
from llmserve.executor.executor import Executor
from llmserve.model_executor.layers.quantization import (
    bf16_storage_for_int4,
    resolve_quantization,
)
from llmserve.model_executor.layers.sampler import Sampler
from llmserve.model_executor.lora.modules import parse_lora_modules
from llmserve.model_executor.model_loader.gguf import gguf_layer_weight_types
from llmserve.model_executor.model_loader.sources import (
    load_config,
    load_tokenizer,
    resolve_model,
)
from llmserve.model_executor.models.supported import check_model_config, model_sliding_window
from llmserve.spec_decode.draft_model import DraftModel
from llmserve.spec_decode.rejection_sampler import verify
from llmserve.spec_decode.speculator import Speculator
from llmserve.structured_output.grammar import StructuredOutputs
from llmserve.worker.kv_integrity import SequenceKVCheck

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.model_path = resolve_model(config.model)
        self._resolve_quantization()
        self.hf_config = load_config(self.model_path)
        self.tokenizer = load_tokenizer(self.model_path)
        self.model_name = config.served_model_name or config.model
        model_max = getattr(self.hf_config, "max_position_embeddings", None) or 4096
        self.max_model_len = min(config.max_model_len or model_max, model_max)
        check_model_config(self.hf_config, self.max_model_len)
        if not config.enable_chunked_prefill:
            # Unchunked, a whole prompt must fit one step's budget.
            config.max_num_batched_tokens = max(config.max_num_batched_tokens,
                                                self.max_model_len)
        check_tensor_parallel(self.hf_config, config.tensor_parallel_size, config.model)
        # A draft model's cache has the target's blocks: the budget sizes them for both.
        self.draft = (DraftModel(config, self.hf_config, self.max_model_len)
                      if config.speculative is not None and config.speculative.model else None)
        self.runner = self._build_runner()
        # Tensor-parallel workers stop with the engine, or at exit if it is never shut down.
        self._stop_workers = weakref.finalize(self, self.runner.shutdown)
        if self.draft is not None:
            self.draft.build(self.runner.num_blocks, self.runner.num_cpu_blocks)
        # A prefill engine keeps a windowed prompt's every block: its decode peer
        # imports the whole prefix.
        window = model_sliding_window(self.hf_config) if config.kv_role != "prefill" else None
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size,
                                          config.enable_prefix_caching, config.watermark,
                                          self.runner.num_cpu_blocks, sliding_window=window)
        self.scheduler = Scheduler(config, self.block_manager)
        self.kv_check = (SequenceKVCheck(self.runner.kv_cache, config.block_size)
                         if config.check_kv_integrity else None)
        self.eos_token_ids = self._eos_token_ids()
        vocab = self.hf_config.vocab_size
        self.sampler = Sampler(vocab, self.eos_token_ids)
        self.detokenizer = Detokenizer(self.tokenizer, self.eos_token_ids)
        self.beam_stepper = BeamStepper(self.scheduler, self.tokenizer, vocab, self.kv_check)
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self.stats = EngineStats()
        self.last_step: tuple[float, float | None] | None = None  # (actual, predicted) s
        self._structured: StructuredOutputs | None = None
        self._structured_lock = threading.Lock()
        # Async scheduling: step N+1 launched before step N's tokens are read back.
        self.overlap = OverlappedSteps(self) if config.async_scheduling else None
        # P/D: leases (prefill role) or imported prefixes (decode role).
        self.kv_transfer = KVTransferSide(self) if config.kv_role != "both" else None
        # Speculative decoding (n-gram or draft-model drafts, verified in the step that
        # computes them).
        self.spec = (Speculator(config.speculative, self.max_model_len, self.draft,
                                 self.sampler)
                     if config.speculative is not None else None)
        # Multi-LoRA: the adapters by name; --lora-modules are read and checked now.
        self.loras = (LoRARegistry(self.hf_config, config.max_lora_rank, self.runner.lora,
                                   self.model_name, self.requests)
                      if config.enable_lora else None)
        for name, source in parse_lora_modules(config.lora_modules or []):
            self.loras.register(name, source, self.loras.parse(source))

    def _resolve_quantization(self) -> None:
        """``--quantization auto`` becomes a mode, before any rank builds its model."""
        c = self.config
        gguf_types = gguf_layer_weight_types(self.model_path)
        if c.dtype_from_cpu and bf16_storage_for_int4(c.quantization, gguf_types, c.device,
                                                      c.tensor_parallel_size):
            log.info("dtype auto -> bfloat16 storage for int4 (this CPU has no bf16 "
                     "arithmetic; the int4 kernels compute in float32)")
            c.dtype = "bfloat16"
        resolved = resolve_quantization(c.quantization, gguf_types, c.device, c.torch_dtype,
                                        c.tensor_parallel_size)
        if c.quantization == "auto":
            log.info("quantization auto -> %s (checkpoint: %s, %s on %s)", resolved,
                     f"GGUF {sorted(gguf_types)}" if gguf_types else "not a GGUF",
                     c.dtype, c.device)
        c.quantization = resolved

    def _build_runner(self) -> Executor:
        """Rank 0's model runner; with tensor parallelism, once every worker built its."""
        draft = self.draft
        return Executor.start(self.config, self.hf_config, self.model_path, self.max_model_len,
                              extra_bytes_per_block=draft.bytes_per_block() if draft else 0,
                              reserved_bytes=draft.weight_bytes() if draft else 0)

    def check_health(self) -> None:
        """Raises WorkerDiedError once a tensor-parallel worker has died."""
        self.runner.check_health()

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (nothing to do on one rank)."""
        self._stop_workers()

    def structured_outputs(self) -> StructuredOutputs:
        """The grammar compiler and mask worker, built on first use (wrapping the
        tokenizer for llguidance takes about a second)."""
        with self._structured_lock:
            if self._structured is None:
                self._structured = StructuredOutputs(self.tokenizer, self.hf_config.vocab_size,
                                                     self.eos_token_ids)
            return self._structured

    def _eos_token_ids(self) -> set[int]:
        ids = set()
        for source in (self.hf_config.eos_token_id, self.tokenizer.eos_token_id):
            if isinstance(source, int):
                ids.add(source)
            elif source:
                ids.update(source)
        gen = Path(self.model_path) / "generation_config.json"
        if gen.is_file():
            eos = json.loads(gen.read_text()).get("eos_token_id")
            ids.update([eos] if isinstance(eos, int) else eos or [])
        return ids

    # --- requests -------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
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
        params = params or SamplingParams()
        check_cache_salt(cache_salt)
        self._check_lora(lora_request)
        ids = prompt_token_ids if prompt_token_ids is not None else self.tokenize(prompt)
        self.validate_prompt(ids, params)
        check_admission(self.config.max_waiting, self.config.max_queue_delay,
                        self.scheduler.waiting,
                        max(0, self.config.max_num_seqs - len(self.scheduler.running)))
        if params.max_tokens is None:
            params.max_tokens = self.max_model_len - len(ids)
        if params.beam is not None:  # the search stops where sampling would
            params.beam = replace(params.beam, max_tokens=params.max_tokens)
        if params.bad_words:
            params.bad_words_token_ids = bad_words_token_ids(
                params.bad_words, self.tokenizer, self.hf_config.vocab_size)
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text = prompt if isinstance(prompt, str) else None
        req = Request(request_id, text, list(ids), params, priority=priority,
                      cache_salt=(lora_request.cache_salt if lora_request else b"")
                      + (cache_salt or "").encode(),
                      lora=lora_request,
                      tenant=tenant.name if tenant else "",
                      tenant_weight=tenant.weight if tenant else 1.0,
                      remote_decode=remote_decode and self.kv_transfer is not None,
                      kv_hold=list(kv_hold or []))
        if params.beam is not None:
            req.beams = BeamSearch(params.beam, frozenset(self.eos_token_ids))
            req.beams.start(req.sequences[0].seq_id)
        if params.structured_outputs is not None:  # GrammarError is a ValueError
            for seq in req.sequences:  # each parallel sample has its own parser state
                seq.matcher = self.structured_outputs().matcher(params.structured_outputs)
        self.requests[request_id] = req
        # Parallel samples: only the first is prefilled; the others fork from it when
        # it samples its first token and share its blocks (copy-on-write).
        self.scheduler.add(req.sequences[0])
        return req

    def _check_lora(self, lora: LoRARequest | None) -> None:
        if lora is None:
            return
        if self.loras is None:
            raise ValueError("this engine serves no LoRA adapters (start it with "
                             "--enable-lora)")
        self.loras.ensure_loaded(lora)  # LoRAError (a ValueError) for a bad adapter

    def validate_prompt(self, ids: list[int], params: SamplingParams) -> None:
        if not ids:
            raise ValueError("the prompt is empty")
        vocab = self.hf_config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        params.check_token_ids(vocab)
        total = len(ids) + (params.max_tokens or 0)
        if len(ids) >= self.max_model_len or total > self.max_model_len:
            raise ValueError(
                f"this model's maximum context length is {self.max_model_len} tokens; the "
                f"prompt has {len(ids)} and max_tokens asks for {params.max_tokens or 0} more")
        chunk = (self.config.max_num_batched_tokens if self.config.enable_chunked_prefill
                 else total)  # unchunked, a recompute prefills everything at once
        blocks = self.block_manager.blocks_at_once(total, chunk)
        if blocks > self.block_manager.num_blocks:
            raise ValueError(f"the prompt plus max_tokens needs {blocks} KV blocks; the "
                             f"cache has {self.block_manager.num_blocks}")

    def abort(self, request_id: str) -> bool:
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        for seq in req.sequences:
            if not seq.finished:
                if self.overlap is not None:  # its token in flight is not an output
                    self.overlap.drop_pending(seq)
                self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
        if self.kv_transfer is not None:
            self.kv_transfer.release_hold(req)
        req.finished_time = time.monotonic()
        return True

    def expire_waiting(self, now: float | None = None) -> list[str]:
        """Abort the requests that waited unscheduled longer than ``max_queue_delay``;
        their ids (the caller answers them 503)."""
        gone = expired(self.config.max_queue_delay, self.scheduler.waiting,
                       time.monotonic() if now is None else now)
        for req in gone:
            self.abort(req.request_id)
        return [r.request_id for r in gone]

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or (self.overlap is not None
                                             and self.overlap.has_pending())

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
        self.runner.warm_up_kernels(self.max_model_len, self.config.max_num_seqs)
        if self.draft is not None:
            self.draft.runner.warm_up_kernels(self.max_model_len, self.config.max_num_seqs)
        bm.check_all_free()
        bm.prefix_queries = bm.prefix_hits = 0
        self.scheduler.num_preemptions = self.scheduler.num_swapped_out = 0
        self.scheduler.cost_model = StepCostModel()  # warm-up steps include compilation
        self.stats = EngineStats()
        if self.spec is not None:
            # counters at zero
            self.spec = Speculator(self.spec.config, self.max_model_len, self.draft,
                                   self.sampler)

    # --- the step ---------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One step: schedule, run the model, sample and append the new tokens. With
        ``async_scheduling`` the tokens appended are the previous step's (overlap.py)."""
        if self.overlap is not None:
            return self.overlap.step()
        ts = time.perf_counter()
        if self.spec is not None:
            self.spec.propose(self.scheduler.running)
        batch = self._schedule()
        if not batch.seqs:
            return []
        now = time.monotonic()
        t0 = time.perf_counter()
        if self.spec is not None:
            self.spec.fill(batch)  # a draft model's tokens, into the slots just reserved
        pending_masks = self._start_grammar_masks(batch)
        logits, prompt_scores, due = self.runner.run(batch)
        self._record_prompt_logprobs(batch, prompt_scores)
        t1 = time.perf_counter()
        kv_tokens = batch.kv_tokens  # before num_computed_tokens moves on
        self._advance_computed(batch, now)
        self._cache_full_blocks(batch.seqs)
        if self.kv_check:
            self.kv_check.after_forward(batch)
        touched: dict[str, Request] = {}
        due_seqs = [batch.seqs[i] for i in due]
        drafted, draft_logits = [], None
        if self.spec is not None:
            due_seqs, logits, drafted, draft_logits = split_drafted(due_seqs, logits)
        due_seqs, sampled = self._sample(due_seqs, logits, pending_masks, touched)
        if sampled is not None:
            for seq, token, lp in zip(due_seqs, sampled.token_ids, sampled.logprobs):
                self._append(seq, token, lp)
                touched[seq.request.request_id] = seq.request
        if drafted:
            self._accept_drafts(drafted, draft_logits, touched, pending_masks)
        self._observe_step(batch, kv_tokens, ts, t0, t1)
        return self._outputs(touched)

    def _schedule(self):
        """The next batch, with its block moves applied (and flushed to the workers
        when nothing runs). P/D: a step that schedules nothing while imported prefixes
        are held for waiting requests frees those holds and tries again."""
        batch = self._schedule_once()
        if not batch.seqs and self.kv_transfer is not None and \
                self.kv_transfer.drop_waiting_holds():
            batch = self._schedule_once()
        return batch

    def _schedule_once(self):
        batch = self.scheduler.schedule()
        if batch.has_block_ops:
            self.runner.apply_block_ops(batch)
            if self.draft is not None:
                self.draft.apply_block_ops(batch)
        if self.kv_check:
            self.kv_check.before_forward(batch)
        if not batch.seqs:
            self.runner.flush_block_ops()
        return batch

    def _advance_computed(self, batch, now: float) -> None:
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            # A draft's slots count once verified (``_accept_drafts``).
            seq.num_computed_tokens += n - len(seq.spec_token_ids)
            if seq.request.first_scheduled_time is None:
                seq.request.first_scheduled_time = now
                if seq.request.kv_hold:  # its prefix is in its block table now
                    self.kv_transfer.release_hold(seq.request)

    def _cache_full_blocks(self, seqs) -> None:
        """Offer the blocks the step filled to the prefix cache (their tokens must be
        known: under async scheduling, once the pending ones are resolved), then free
        those that fell out of a sliding window."""
        for seq in seqs:
            if not seq.finished:
                self.block_manager.cache_full_blocks(seq)
                self.block_manager.free_outside_window(seq)

    def _accept_drafts(self, seqs: list[Sequence], logits, touched: dict,
                       pending_masks=None) -> None:
        """Verify the drafts (rejection_sampler.py; a grammar's masks at every position),
        append the tokens one by one (so stop conditions and max_tokens cut a draft),
        then roll the KV back to the accepted tokens: their slots count as computed, the
        blocks past them are freed, and only then are the blocks they filled offered to
        the prefix cache."""
        def masks(constrained):
            return self.structured_outputs().masks(constrained, pending_masks)

        for seq, (tokens, logprobs) in zip(seqs, verify(self.sampler, logits, seqs, masks)):
            self.spec.record(seq, len(seq.spec_token_ids), len(tokens) - 1)
            seq.spec_token_ids = []
            computed = seq.num_computed_tokens + len(tokens) - 1
            if self.draft is not None:
                self.draft.verified(seq, computed)
            for token, lp in zip(tokens, logprobs):
                self._append(seq, token, lp)
                if seq.finished:  # its blocks are freed already
                    break
            touched[seq.request.request_id] = seq.request
            if not seq.finished:
                seq.num_computed_tokens = computed
                self.block_manager.truncate(seq)
                self._cache_full_blocks([seq])

    def _sample(self, due_seqs: list[Sequence], logits, pending_masks, touched: dict,
                on_device: bool = False):
        """Beam rows go to the beam stepper; the others (and the parallel samples
        forked now) are sampled. Returns (the sampled sequences, the SamplerOutput, or
        with ``on_device`` the SampledTokens still on the device, or None when no row
        samples); nothing is appended yet."""
        if due_seqs:
            due_seqs, logits = self._advance_beams(due_seqs, logits, touched)
        if not due_seqs:
            return [], None
        rows = list(range(len(due_seqs)))
        for row, seq in enumerate(list(due_seqs)):
            for child in self.scheduler.fork_children(seq):
                if self.kv_check:
                    self.kv_check.forked(seq, child)
                due_seqs.append(child)
                rows.append(row)  # the child samples from its parent's logits
        if len(rows) > logits.shape[0]:
            logits = logits[rows]
        rows = [i for i, s in enumerate(due_seqs) if s.matcher is not None]
        bitmask = (self.structured_outputs().masks([due_seqs[i] for i in rows],
                                                   pending_masks) if rows else None)
        sample = self.sampler.sample if on_device else self.sampler
        return due_seqs, sample(logits, due_seqs, rows, bitmask)

    def _observe_step(self, batch, kv_tokens: int, ts: float, t0: float, t1: float) -> None:
        end = time.perf_counter()
        self.stats.record_step(batch, t0 - ts, t1 - t0, end - t1)
        # The whole step, as a stream sees it between two tokens.
        cost = self.scheduler.cost_model
        if batch.predicted_s is not None:
            cost.observe_error(end - ts, batch.predicted_s)
        cost.observe(batch.num_tokens, kv_tokens, len(batch.seqs), end - ts)
        if self.spec is not None:
            self.spec.observe_step(end - ts)
        self.last_step = (end - ts, batch.predicted_s)

    def _outputs(self, touched: dict[str, Request]) -> list[RequestOutput]:
        outputs = []
        for req in touched.values():
            outputs.append(RequestOutput.of(req))
            if req.finished:
                req.finished_time = time.monotonic()
                self.requests.pop(req.request_id, None)
        return outputs

    def _record_prompt_logprobs(self, batch, scores) -> None:
        """Record the prompt logprobs this step's chunks scored (before the sequences'
        computed counts move on). A recomputed chunk scores tokens already scored:
        only new ones are appended."""
        if scores is None:
            return
        row = 0
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            positions = seq.prompt_logprob_positions(n)
            if not positions:
                continue
            targets = [seq.token_ids[p + 1] for p in positions]
            scored = scores.rows(row, row + len(positions)).logprobs(
                targets, seq.params.prompt_logprobs)
            row += len(positions)
            have = seq.request.prompt_logprobs
            for p, lp in zip(positions, scored):
                if p + 1 == len(have):
                    have.append(lp)

    def _advance_beams(self, due_seqs: list[Sequence], logits, touched: dict):
        """Hand the beam-search rows to the beam stepper; the other rows (and their
        logits) are returned for sampling."""
        beam_rows = [i for i, s in enumerate(due_seqs) if s.request.beams is not None]
        if not beam_rows:
            return due_seqs, logits
        for req in self.beam_stepper([due_seqs[i] for i in beam_rows], logits[beam_rows]):
            touched[req.request_id] = req
        rest = [i for i, s in enumerate(due_seqs) if s.request.beams is None]
        return [due_seqs[i] for i in rest], logits[rest]

    def _start_grammar_masks(self, batch):
        """Masks of the constrained sequences that sample this step, computed on a
        worker thread while the model runs."""
        due = [s for s, n in zip(batch.seqs, batch.num_new_tokens)
               if s.matcher is not None and s.num_computed_tokens + n >= s.num_tokens]
        return self.structured_outputs().start_masks(due) if due else None

    def _append(self, seq: Sequence, token: int, lp, placed: bool = False) -> None:
        """Append ``token`` to ``seq`` (or, ``placed``, take it as the one its pending
        placeholder stood for) and finish ``seq`` if it must stop."""
        if placed:
            seq.token_ids[-1] = token
        else:
            seq.append_token(token)
        req = seq.request
        now = time.monotonic()
        if req.first_token_time is None:
            req.first_token_time = now
        req.last_token_time = now
        if lp is not None:
            seq.logprobs.append(Logprob(token, lp[0], lp[1]))
        status = self.detokenizer.update(seq, token)
        if seq.matcher is not None and status is None:
            # The mask only offered tokens the grammar allows; a refusal means the
            # parser hit a resource limit. Either way, nothing more may follow.
            if not seq.matcher.consume_token(token) or seq.matcher.is_stopped():
                status = SequenceStatus.FINISHED_STOPPED
        if status is None and (seq.num_output_tokens >= seq.params.max_tokens
                               or seq.num_tokens >= self.max_model_len):
            status = SequenceStatus.FINISHED_LENGTH
        if status is not None:
            if seq.request.remote_decode:  # leg 1: keep the prompt's KV for the decode engine
                self.kv_transfer.hold_for_decode(seq, status)
            self.scheduler.finish(seq, status)


def split_drafted(due_seqs: list[Sequence], logits):
    """Speculative decoding: (the sequences sampled as usual and their logits rows, the
    drafted sequences and theirs: 1 + k rows each, in order)."""
    plain, plain_rows, drafted, draft_rows, row = [], [], [], [], 0
    for seq in due_seqs:
        k = len(seq.spec_token_ids)
        if k:
            drafted.append(seq)
            draft_rows += range(row, row + k + 1)
        else:
            plain.append(seq)
            plain_rows.append(row)
        row += 1 + k
    if not drafted:
        return due_seqs, logits, [], None
    return plain, logits[plain_rows] if plain else None, drafted, logits[draft_rows]


def check_cache_salt(cache_salt: str | None) -> None:
    """A request's own prefix-cache salt: any text but NUL, which marks the salts of
    LoRA adapters (``LoRARequest.cache_salt``), so a client cannot forge one."""
    if cache_salt and "\x00" in cache_salt:
        raise ParamError("cache_salt", "cache_salt must not contain NUL characters")


class EngineStats:
    """Step counters for benchmarks: where the time goes."""

    def __init__(self):
        self.steps = 0
        self.tokens = 0
        self.schedule_s = 0.0
        self.forward_s = 0.0  # batch preparation + forward + logits
        self.post_s = 0.0  # sampling + detokenisation + bookkeeping

    def record_step(self, batch, schedule_s: float, forward_s: float, post_s: float) -> None:
        self.steps += 1
        self.tokens += batch.num_tokens
        self.schedule_s += schedule_s
        self.forward_s += forward_s
        self.post_s += post_s
