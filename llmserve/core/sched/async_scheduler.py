"""The scheduler under async scheduling (``--async-scheduling``): step k is scheduled
and launched before step k-1's sampled tokens are read back, so the host's scheduling,
input building and output processing run while the device computes (vLLM v1's async
scheduling, SGLang's overlap scheduler).

What differs from ``Scheduler`` is one piece of bookkeeping: a sequence whose sampled
token is still on the device holds a *placeholder* as its last token, so scheduling
sees an ordinary decode. The engine's step loop keeps the sampled step in its batch
queue until the next step has launched, then puts each real token in its placeholder's
place (``EngineCore.step``).

Invariants:
- a placeholder is only ever a sequence's last token, and at most one per sequence;
- nothing on the host acts on a placeholder's value (the device reads the real token
  for the rows that need it: ``StepInputs.pending_rows``); outputs never show one;
- a sequence whose next token ends it for certain (max_tokens, the model's length) gets
  no placeholder: with nothing left to compute the scheduler leaves it out (no wasted
  row, block or place in the batch), and it finishes when its token is read.

What this costs: a sequence that stopped at step k-1 on an EOS, a stop token or a stop
string was already in batch k. Its row there is discarded (one wasted token, as in
vLLM): it held a place in the batch, may have taken a block (and so preempted another
sequence under memory pressure), and was charged to its tenant. Blocks freed when step
k-1's tokens are read are reused only by later launches, which the device runs after
batch k. Every token reaches its caller one step later than without overlap.
"""

from __future__ import annotations

from llmserve.core.request import Sequence
from llmserve.core.sched.scheduler import Scheduler

# What a pending token reads as on the host until it is known: a valid id, so a stray
# read cannot index out of range.
PLACEHOLDER = 0


class AsyncScheduler(Scheduler):
    def hold_places(self, seqs: list[Sequence], max_model_len: int) -> set[int]:
        """After ``seqs`` sampled on the device: a placeholder for each that goes on
        after its token. Returns the seq ids that took one."""
        placed = set()
        for seq in seqs:
            ends = (seq.num_output_tokens + 1 >= seq.params.max_tokens
                    or seq.num_tokens + 1 >= max_model_len)
            if not ends:
                seq.append_token(PLACEHOLDER)
                placed.add(seq.seq_id)
        return placed

    @staticmethod
    def drop_place(seq: Sequence) -> None:
        """``seq`` ends before its pending token is read: the placeholder goes."""
        seq.token_ids.pop()
