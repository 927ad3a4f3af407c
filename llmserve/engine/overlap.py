"""Async scheduling (``--async-scheduling``): step k is scheduled and launched before
step k-1's sampled tokens are read back, so the host's scheduling, input building and
output processing run while the device computes (vLLM v1's async scheduling, SGLang's
overlap scheduler).

One call of ``OverlappedSteps.step``:

1. Schedule batch k. A sequence whose token from step k-1 is still on the device holds
   a placeholder as its last token, so the scheduler sees an ordinary decode.
2. Launch batch k. Rows whose input is a placeholder read the token from step k-1's
   token tensor, on the device (``StepInputs.pending_rows``).
3. Read step k-1's tokens back (this waits for step k-1's sampler only; the device is
   busy with batch k meanwhile) and append them: stop checks, detokenisation, outputs.
4. Sample batch k's due rows on the device, and give each sequence a placeholder.

What this costs: a sequence that stopped at step k-1 on an EOS, a stop token or a stop
string was already in batch k. Its row there is discarded (one wasted token, as in
vLLM): it held a place in the batch, may have taken a block (and so preempted another
sequence under memory pressure), and was charged to its tenant. A sequence whose
token ends it for certain (max_tokens, the model's length) is not scheduled again.
Blocks freed at step 3 are reused only by later launches, which the device runs after
batch k. Blocks are offered to the prefix cache only once their tokens are known.
Every token reaches its caller one step later than without overlap.

What stays synchronous, and why: beam-search rows (the search decides on the host),
prompt logprobs, and grammar masks (computed after 3, once the matcher has consumed the
previous token). Sampling sees every real token, so penalties, min_tokens and stop
conditions are exactly as without overlap, and so are the outputs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from llmserve.core.request import Request, Sequence
from llmserve.model_executor.layers.sampler import SampledTokens

if TYPE_CHECKING:
    from llmserve.engine.llm_engine import LLMEngine
    from llmserve.engine.output import RequestOutput

# What a pending token reads as on the host until it is known: a valid id, so a stray
# read cannot index out of range; nothing on the host may act on it (see above).
PLACEHOLDER = 0


@dataclass
class InflightTokens:
    """Step k-1's sampled tokens, on the device until ``sampled.resolve()``."""
    seqs: list[Sequence]
    sampled: SampledTokens
    row_of: dict[int, int]  # seq_id -> row of ``sampled.tokens``
    # seq_ids holding a placeholder; the others end with this token whatever it is
    # and are not scheduled again (see ``_sample_ahead``).
    placed: set[int]


class OverlappedSteps:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.inflight: InflightTokens | None = None

    def has_pending(self) -> bool:
        return self.inflight is not None

    def drop_pending(self, seq: Sequence) -> None:
        """``seq`` ends (aborted) before its token in flight is read: the placeholder
        goes, and the token will be ignored."""
        if self.inflight is not None and seq.seq_id in self.inflight.placed:
            seq.token_ids.pop()

    def step(self) -> list[RequestOutput]:
        e = self.engine
        ts = time.perf_counter()
        batch = e._schedule()
        t0 = time.perf_counter()
        logits = due = None
        if batch.seqs:
            prev = self.inflight
            pending = (prev.row_of, prev.sampled.tokens) if prev is not None else None
            logits, prompt_scores, due = e.runner.run(batch, pending)
            e._record_prompt_logprobs(batch, prompt_scores)  # a sync, only when asked
            kv_tokens = batch.kv_tokens
            e._advance_computed(batch, time.monotonic())
        t1 = time.perf_counter()
        touched: dict[str, Request] = {}
        self._append_inflight(touched)
        outputs = e._outputs(touched)  # before new placeholders: outputs never show one
        if batch.seqs:
            e._cache_full_blocks(batch.seqs)
            beams: dict[str, Request] = {}
            self._sample_ahead([batch.seqs[i] for i in due], logits, beams)
            outputs += e._outputs(beams)
            e._observe_step(batch, kv_tokens, ts, t0, t1)
        return outputs

    def _append_inflight(self, touched: dict[str, Request]) -> None:
        """Step k-1's tokens, in place of their placeholders. A sequence finished
        meanwhile (aborted) takes nothing."""
        prev, self.inflight = self.inflight, None
        if prev is None:
            return
        sampled = prev.sampled.resolve()  # the step's one wait for the device
        for seq, token, lp in zip(prev.seqs, sampled.token_ids, sampled.logprobs):
            if seq.finished:
                continue
            self.engine._append(seq, token, lp, placed=seq.seq_id in prev.placed)
            touched[seq.request.request_id] = seq.request

    def _sample_ahead(self, due_seqs: list[Sequence], logits, beams: dict) -> None:
        """Sample the rows of sequences still live after step k-1's tokens; their
        tokens stay on the device, each sequence holding a placeholder. A sequence this
        token ends for certain (max_tokens or the model's length) gets none: with
        nothing left to compute, the scheduler leaves it out (no wasted row, block or
        place in the batch), and it finishes when its token is read."""
        live = [i for i, s in enumerate(due_seqs) if not s.finished]
        if len(live) < len(due_seqs):
            due_seqs, logits = [due_seqs[i] for i in live], logits[live]
        seqs, sampled = self.engine._sample(due_seqs, logits, None, beams, on_device=True)
        if sampled is None:
            return
        placed = set()
        for seq in seqs:
            if not self._ends_with_next_token(seq):
                seq.append_token(PLACEHOLDER)
                placed.add(seq.seq_id)
        self.inflight = InflightTokens(seqs, sampled,
                                       {s.seq_id: row for row, s in enumerate(seqs)}, placed)

    def _ends_with_next_token(self, seq: Sequence) -> bool:
        """The length checks of ``LLMEngine._append``, one token ahead."""
        return (seq.num_output_tokens + 1 >= seq.params.max_tokens
                or seq.num_tokens + 1 >= self.engine.max_model_len)
