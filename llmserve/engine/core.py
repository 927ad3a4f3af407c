"""EngineCore: the one step loop (schedule -> execute -> update from output) over the
requests it runs, with the features plugged in as step hooks (hooks.py).

Token ids in, per-request deltas out (``EngineCoreOutput``): what the core appended in
the step, nothing it already emitted. Text, stop strings and the shapes callers read
belong to the output processor (output_processor.py); checks that need only the
prompt and the fixed sizes belong to the input processor (input_processor.py).

Invariants:
- a token is emitted exactly once, in the step that appended it (a placeholder under
  async scheduling is never appended through ``_append``, so never emitted);
- a finished sequence holds no block once ``_finish`` returns (P/D leases are holds
  of their own, taken in ``finishing``);
- the batch queue holds at most one sampled step: none after ``step`` without async
  scheduling, the last step's with it (its tokens are read in the next ``step``).

The step, in the order both modes run it:

1. schedule (``before_schedule`` hooks first: drafts are proposed there) and apply the
   block moves; ``after_schedule`` hooks;
2. execute: the forward; prompt logprobs; computed counts move on;
3. async scheduling only: the previous step's tokens, read back now, are appended;
4. the blocks the forward filled go to the prefix cache; ``after_forward`` hooks;
5. sample (beams are decided here, parallel samples fork, grammar masks apply);
6. without async scheduling the tokens are appended now (drafts verified); with it the
   sampled step waits in the batch queue, each sequence holding a placeholder.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass

from llmserve.config import EngineConfig
from llmserve.core.beam_search import BeamSearch
from llmserve.core.block_manager import BlockManager
from llmserve.core.request import Logprob, Request, Sequence, SequenceStatus
from llmserve.core.sched.async_scheduler import AsyncScheduler
from llmserve.core.sched.cost_model import StepCostModel
from llmserve.core.sched.output import ScheduledBatch
from llmserve.core.sched.overload import check_admission, expired
from llmserve.core.sched.scheduler import Scheduler
from llmserve.engine.beam_stepper import BeamStepper
from llmserve.engine.features import Features
from llmserve.engine.model_config import ModelConfig
from llmserve.engine.output import EngineCoreOutput, SequenceDelta
from llmserve.engine.runners import RunnerGroup
from llmserve.engine.step_stats import EngineStats, SchedulerStats, scheduler_stats
from llmserve.model_executor.layers.sampler import Sampler
from llmserve.model_executor.models.supported import model_sliding_window
from llmserve.spec_decode.rejection_sampler import verify


@dataclass
class SampledStep:
    """A step's sampling, not yet appended: the plain rows' tokens (on the device
    until resolved, under async scheduling), and the drafted rows to verify."""
    seqs: list[Sequence]
    sampled: object | None  # SamplerOutput, or SampledTokens on the device
    drafted: list[Sequence]
    draft_logits: object | None
    placed: set[int]  # async scheduling: seq ids holding a placeholder


class EngineCore:
    def __init__(self, config: EngineConfig, model: ModelConfig):
        self.config, self.model = config, model
        self.max_model_len = model.max_model_len
        self.executor = RunnerGroup.build(config, model)
        self.runner = self.executor.runner
        self.block_manager = self._block_manager()
        scheduler_class = AsyncScheduler if config.async_scheduling else Scheduler
        self.scheduler = scheduler_class(config, self.block_manager)
        self.sampler = Sampler(model.vocab_size, model.eos_token_ids)
        self.requests: dict[str, Request] = {}
        self.features = Features.build(config, model, self.executor, self.block_manager,
                                       self.sampler, self.requests)
        self.hooks = self.features.hooks
        self.beam_stepper = BeamStepper(self.scheduler, model.vocab_size, self.hooks)
        self.batch_queue: deque[SampledStep] = deque()
        self.stats = EngineStats()
        self.last_step: tuple[float, float | None] | None = None  # (actual, predicted) s
        self._ids = itertools.count()
        self._deltas: dict[int, SequenceDelta] = {}  # seq id -> this step's delta
        self._touched: dict[str, Request] = {}

    def _block_manager(self) -> BlockManager:
        c = self.config
        # A prefill engine keeps a windowed prompt's every block: its decode peer
        # imports the whole prefix.
        window = model_sliding_window(self.model.hf_config) if c.kv_role != "prefill" else None
        return BlockManager(self.runner.num_blocks, c.block_size, c.enable_prefix_caching,
                            c.watermark, self.runner.num_cpu_blocks, sliding_window=window)

    def shutdown(self) -> None:
        self.executor.shutdown()
        self.features.shutdown()

    # --- requests ---------------------------------------------------------------------
    def add_request(self, req: Request) -> Request:
        """Queue a request the input processor built. Raises OverloadedError when the
        waiting queue is full and ValueError when an id is in use or a feature refuses
        it (a bad adapter, a grammar), changing nothing."""
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        check_admission(self.config.max_waiting, self.config.max_queue_delay,
                        self.scheduler.waiting,
                        max(0, self.config.max_num_seqs - len(self.scheduler.running)))
        self.hooks.add_request(req)
        if req.params.beam is not None:
            req.beams = BeamSearch(req.params.beam, frozenset(self.model.eos_token_ids))
            req.beams.start(req.sequences[0].seq_id)
        self.requests[req.request_id] = req
        # Parallel samples: only the first is prefilled; the others fork from it when
        # it samples its first token and share its blocks (copy-on-write).
        self.scheduler.add(req.sequences[0])
        return req

    def next_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def abort(self, request_id: str) -> bool:
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        for seq in req.sequences:
            if not seq.finished:
                if self._holds_place(seq):  # its token in flight is not an output
                    self.scheduler.drop_place(seq)
                self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
        self.hooks.aborted(req)
        req.finished_time = time.monotonic()
        return True

    def stop_sequence(self, request_id: str, index: int, num_output_tokens: int,
                      stop: str) -> EngineCoreOutput | None:
        """The output processor found stop string ``stop`` in sequence ``index``'s
        text, its output ending after ``num_output_tokens`` tokens: the sequence
        finishes there (its tokens after that, computed in the same step by a draft,
        are dropped). Returns the request's output if this finished it."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        seq = next(s for s in req.sequences if s.index == index)
        if seq.finished:
            return None
        if self._holds_place(seq):
            self.scheduler.drop_place(seq)
        del seq.token_ids[seq.num_prompt_tokens + num_output_tokens:]
        seq.stop_reason = stop
        self._finish(seq, SequenceStatus.FINISHED_STOPPED)
        # Between steps: the output processor has this finish already.
        self._deltas.pop(seq.seq_id, None)
        self._touched.pop(request_id, None)
        if not req.finished:
            return None
        self.requests.pop(request_id, None)
        req.finished_time = time.monotonic()
        return self._output_of(req, [])

    def expire_waiting(self, now: float | None = None) -> list[str]:
        """Abort the requests that waited unscheduled longer than ``max_queue_delay``;
        their ids (the caller answers them 503)."""
        gone = expired(self.config.max_queue_delay, self.scheduler.waiting,
                       time.monotonic() if now is None else now)
        for req in gone:
            self.abort(req.request_id)
        return [r.request_id for r in gone]

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or bool(self.batch_queue)

    def scheduler_stats(self) -> SchedulerStats:
        return scheduler_stats(self)

    # --- the step -----------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        start = time.perf_counter()
        batch = self._schedule()
        t0 = time.perf_counter()
        logits = due = None
        if batch.seqs:
            logits, due, kv_tokens = self._execute(batch)
        t1 = time.perf_counter()
        if self.batch_queue:  # async scheduling: the previous step's tokens, read now
            self._update(self.batch_queue.popleft())
        if batch.seqs:
            self._cache_full_blocks(batch.seqs)
            self.hooks.after_forward(batch)
            sampled = self._sample(batch, logits, due)
            if not self.config.async_scheduling:
                self._update(sampled)
            elif sampled.sampled is not None:
                self.batch_queue.append(sampled)
            self._observe_step(batch, kv_tokens, start, t0, t1)
        return self._emit()

    def _schedule(self) -> ScheduledBatch:
        """The next batch, with its block moves applied (and flushed to the workers when
        nothing runs). A step that schedules nothing gives the hooks a chance to free
        what the queue's head may wait for (P/D's imported prefixes), then tries again."""
        self.hooks.before_schedule(self.scheduler.running)
        batch = self._schedule_once()
        if not batch.seqs and self.hooks.schedule_again():
            batch = self._schedule_once()
        return batch

    def _schedule_once(self) -> ScheduledBatch:
        batch = self.scheduler.schedule()
        if batch.has_block_ops:
            self.executor.apply_block_ops(batch)
        self.hooks.after_schedule(batch)
        if not batch.seqs:
            self.executor.flush_block_ops()
        return batch

    def _execute(self, batch: ScheduledBatch):
        """The forward. Returns (logits, rows that sample, the KV tokens it read)."""
        pending = self._pending_tokens()
        logits, prompt_scores, due = self.executor.run(batch, pending)
        self._record_prompt_logprobs(batch, prompt_scores)
        kv_tokens = batch.kv_tokens  # before num_computed_tokens moves on
        now = time.monotonic()
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            # A draft's slots count once verified (``_accept_drafts``).
            seq.num_computed_tokens += n - len(seq.spec_token_ids)
            if seq.request.first_scheduled_time is None:
                seq.request.first_scheduled_time = now
        return logits, due, kv_tokens

    def _pending_tokens(self):
        """Async scheduling: (seq id -> row, the token tensor) of the step in the batch
        queue, so rows whose input is a placeholder read their token on the device."""
        if not self.batch_queue:
            return None
        prev = self.batch_queue[-1]
        return {s.seq_id: row for row, s in enumerate(prev.seqs)}, prev.sampled.tokens

    def _holds_place(self, seq: Sequence) -> bool:
        return any(seq.seq_id in s.placed for s in self.batch_queue)

    def _cache_full_blocks(self, seqs) -> None:
        """Offer the blocks the step filled to the prefix cache (their tokens must be
        known: under async scheduling, once the pending ones are resolved), then free
        those that fell out of a sliding window."""
        for seq in seqs:
            if not seq.finished:
                self.block_manager.cache_full_blocks(seq)
                self.block_manager.free_outside_window(seq)

    # --- sampling ------------------------------------------------------------------------
    def _sample(self, batch: ScheduledBatch, logits, due: list[int]) -> SampledStep:
        """Beam rows are decided now (the search runs on the host); drafted rows wait
        for verification; the others, and the parallel samples forked now, are sampled
        (on the device, under async scheduling). Nothing is appended yet."""
        due_seqs = [batch.seqs[i] for i in due]
        if self.config.async_scheduling:  # finished meanwhile (when their token was read)
            live = [i for i, s in enumerate(due_seqs) if not s.finished]
            if len(live) < len(due_seqs):
                due_seqs, logits = [due_seqs[i] for i in live], logits[live]
        due_seqs, logits, drafted, draft_logits = split_drafted(due_seqs, logits)
        if due_seqs:
            due_seqs, logits = self._advance_beams(due_seqs, logits)
        sampled = None
        if due_seqs:
            due_seqs, logits = self._fork_children(due_seqs, logits)
            rows = [i for i, s in enumerate(due_seqs) if s.matcher is not None]
            bitmask = self.hooks.token_masks([due_seqs[i] for i in rows]) if rows else None
            sample = self.sampler.sample if self.config.async_scheduling else self.sampler
            sampled = sample(logits, due_seqs, rows, bitmask)
        placed = set()
        if self.config.async_scheduling and sampled is not None:
            placed = self.scheduler.hold_places(due_seqs, self.max_model_len)
        return SampledStep(due_seqs, sampled, drafted, draft_logits, placed)

    def _advance_beams(self, due_seqs: list[Sequence], logits):
        """Hand the beam-search rows to the beam stepper; the other rows (and their
        logits) are returned for sampling."""
        beam_rows = [i for i, s in enumerate(due_seqs) if s.request.beams is not None]
        if not beam_rows:
            return due_seqs, logits
        for req in self.beam_stepper([due_seqs[i] for i in beam_rows], logits[beam_rows]):
            self._touched[req.request_id] = req
        rest = [i for i, s in enumerate(due_seqs) if s.request.beams is None]
        return [due_seqs[i] for i in rest], logits[rest]

    def _fork_children(self, due_seqs: list[Sequence], logits):
        """Parallel samples fork from their first sample as it samples its first token,
        and sample from its logits row."""
        rows = list(range(len(due_seqs)))
        for row, seq in enumerate(list(due_seqs)):
            for child in self.scheduler.fork_children(seq):
                self.hooks.forked(seq, child)
                due_seqs.append(child)
                rows.append(row)
        if len(rows) > logits.shape[0]:
            logits = logits[rows]
        return due_seqs, logits

    # --- updating from the output -----------------------------------------------------------
    def _update(self, step: SampledStep) -> None:
        """Append the step's tokens: the plain rows', then the verified drafts'. A
        sequence finished meanwhile (aborted, stopped) takes nothing."""
        if step.sampled is not None:
            out = step.sampled.resolve() if self.config.async_scheduling else step.sampled
            for seq, token, lp in zip(step.seqs, out.token_ids, out.logprobs):
                if not seq.finished:
                    self._append(seq, token, lp, placed=seq.seq_id in step.placed)
        if step.drafted:
            self._accept_drafts(step.drafted, step.draft_logits)

    def _accept_drafts(self, seqs: list[Sequence], logits) -> None:
        """Verify the drafts (rejection_sampler.py; a grammar's masks at every position),
        append the tokens one by one (so stop conditions and max_tokens cut a draft),
        then roll the KV back to the accepted tokens: their slots count as computed, the
        blocks past them are freed, and only then are the blocks they filled offered to
        the prefix cache."""
        for seq, (tokens, logprobs) in zip(seqs, verify(self.sampler, logits, seqs,
                                                        self.hooks.token_masks)):
            computed = seq.num_computed_tokens + len(tokens) - 1
            self.hooks.verified(seq, len(seq.spec_token_ids), len(tokens) - 1, computed)
            seq.spec_token_ids = []
            for token, lp in zip(tokens, logprobs):
                self._append(seq, token, lp)
                if seq.finished:  # its blocks are freed already
                    break
            if not seq.finished:
                seq.num_computed_tokens = computed
                self.block_manager.truncate(seq)
                self._cache_full_blocks([seq])

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
        delta = self._delta(seq)
        delta.token_ids.append(token)
        if seq.params.logprobs is not None:
            delta.logprobs.append(Logprob(token, lp[0], lp[1]) if lp is not None else None)
        status = self._stop_status(seq, token)
        if status is not None:
            self._finish(seq, status)

    def _stop_status(self, seq: Sequence, token: int) -> SequenceStatus | None:
        """How ``token`` ends ``seq``, if it does. Stop strings are the output
        processor's (it has the text); it stops the sequence through
        ``stop_sequence``."""
        p = seq.params
        if seq.num_output_tokens >= p.min_tokens:
            if token in p.stop_token_ids:
                seq.stop_reason = token
                self._delta(seq).token_stop = True
                return SequenceStatus.FINISHED_STOPPED
            if not p.ignore_eos and token in self.model.eos_token_ids:
                self._delta(seq).token_stop = True
                return SequenceStatus.FINISHED_STOPPED
        status = self.hooks.accept_token(seq, token)
        if status is None and (seq.num_output_tokens >= p.max_tokens
                               or seq.num_tokens >= self.max_model_len):
            status = SequenceStatus.FINISHED_LENGTH
        return status

    def _finish(self, seq: Sequence, status: SequenceStatus) -> None:
        self.hooks.finishing(seq, status)
        self.scheduler.finish(seq, status)
        delta = self._delta(seq)
        delta.finish_reason, delta.stop_reason = status.value, seq.stop_reason

    def _delta(self, seq: Sequence) -> SequenceDelta:
        delta = self._deltas.get(seq.seq_id)
        if delta is None:
            delta = self._deltas[seq.seq_id] = SequenceDelta(seq.index)
            self._touched[seq.request.request_id] = seq.request
        return delta

    def _emit(self) -> list[EngineCoreOutput]:
        """The step's outputs, one per request that changed; finished requests leave."""
        outputs = []
        for req in self._touched.values():
            deltas = [d for s in req.sequences if (d := self._deltas.get(s.seq_id))]
            outputs.append(self._output_of(req, deltas))
            if req.finished:
                req.finished_time = time.monotonic()
                self.requests.pop(req.request_id, None)
        self._touched, self._deltas = {}, {}
        return outputs

    def _output_of(self, req: Request, deltas: list[SequenceDelta]) -> EngineCoreOutput:
        first = not req.emitted
        req.emitted = True
        return EngineCoreOutput(
            req.request_id, deltas, req.finished, req.arrival_time,
            req.first_scheduled_time, req.first_token_time,
            prompt_logprobs=req.prompt_logprobs if first else None,
            kv_transfer_params=req.kv_transfer_params,
            hypotheses=(req.beams.results() if req.beams is not None and req.beams.done
                        else None))

    def _record_prompt_logprobs(self, batch: ScheduledBatch, scores) -> None:
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

    def _observe_step(self, batch: ScheduledBatch, kv_tokens: int, start: float,
                      t0: float, t1: float) -> None:
        end = time.perf_counter()
        self.stats.record_step(batch, t0 - start, t1 - t0, end - t1)
        # The whole step, as a stream sees it between two tokens.
        cost = self.scheduler.cost_model
        if batch.predicted_s is not None:
            cost.observe_error(end - start, batch.predicted_s)
        cost.observe(batch.num_tokens, kv_tokens, len(batch.seqs), end - start)
        self.hooks.after_step(batch, end - start)
        self.last_step = (end - start, batch.predicted_s)

    def reset_after_warm_up(self) -> None:
        """Counters at zero, the cost model unfitted (warm-up steps include
        compilation)."""
        bm = self.block_manager
        bm.check_all_free()
        bm.prefix_queries = bm.prefix_hits = 0
        self.scheduler.num_preemptions = self.scheduler.num_swapped_out = 0
        self.scheduler.cost_model = StepCostModel()
        self.stats = EngineStats()
        self.last_step = None
        self.hooks.reset_counters()


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
