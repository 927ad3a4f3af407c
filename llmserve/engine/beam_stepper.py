"""Beam search in the step loop: each live beam offers its best next tokens from its
logits; once every live beam of a request has offered (normally all in the same step),
``core/beam_search.py`` decides, and the sequences follow. A beam chosen k times forks
k - 1 new sequences that share its blocks copy-on-write (the scheduler's
``fork_beam``); a beam not chosen is finished and frees its blocks at once."""

from __future__ import annotations

import time

import torch

from llmserve.core.request import Request, Sequence, SequenceStatus
from llmserve.core.sched.scheduler import Scheduler
from llmserve.engine.hooks import StepHook


@torch.inference_mode()
def top_candidates(logits: torch.Tensor, seqs: list[Sequence],
                   vocab_size: int) -> list[list[tuple[int, float]]]:
    """Per row: the beam's K likeliest next tokens as (token id, logprob), best first."""
    logits = logits[:, :vocab_size].float()
    temps = [s.params.beam.temperature for s in seqs]
    if any(temps):
        scale = torch.tensor([t or 1.0 for t in temps], device=logits.device)
        logits = logits / scale[:, None]
    k = [s.request.beams.num_candidates for s in seqs]
    top = torch.log_softmax(logits, dim=-1).topk(max(k), dim=-1)
    return [list(zip(ids[:n], values[:n]))
            for ids, values, n in zip(top.indices.tolist(), top.values.tolist(), k)]


class BeamStepper:
    def __init__(self, scheduler: Scheduler, vocab_size: int, hooks: StepHook):
        self.scheduler = scheduler
        self.vocab_size = vocab_size
        self.hooks = hooks  # a fork is a feature's business (the KV check follows it)

    def __call__(self, seqs: list[Sequence], logits: torch.Tensor) -> list[Request]:
        """Offer the due beams' candidates and decide every request whose live beams
        have all offered. Returns the requests whose search ended."""
        for seq, top in zip(seqs, top_candidates(logits, seqs, self.vocab_size)):
            seq.request.beams.offer(seq.seq_id, top)
        ended = []
        for req in {s.request.request_id: s.request for s in seqs}.values():
            if req.beams.ready:
                self._decide(req)
                if req.beams.done:
                    ended.append(req)
        return ended

    def _decide(self, req: Request) -> None:
        search = req.beams
        live = {s.seq_id: s for s in req.live_sequences}
        chosen = search.select()
        now = time.monotonic()
        req.first_token_time = req.first_token_time or now
        req.last_token_time = now
        if search.done:
            for seq in live.values():
                self.scheduler.finish(seq, SequenceStatus.FINISHED_STOPPED)
            return
        parents = {c.parent for c in chosen}
        for key, seq in live.items():
            if key not in parents:  # dropped: its blocks go back now
                self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
        req.sequences = [s for s in req.sequences if not s.finished]  # (each has a copy
        # of the tokens: a long search would keep thousands)
        # Fork every extra pick before any parent takes its token: a child copies its
        # parent's tokens and blocks as they were when the parent offered.
        picks, used = [], set()
        for c in chosen:
            seq = live[c.parent]
            if c.parent in used:
                child = req.fork_beam(seq)
                self.scheduler.fork_beam(seq, child)
                if child.status is SequenceStatus.RUNNING:
                    self.hooks.forked(seq, child)
                seq = child
            used.add(c.parent)
            picks.append((seq, c))
        for seq, c in picks:
            seq.append_token(c.token_id)
            self.scheduler.resume(seq)
        search.advance([(seq.seq_id, c) for seq, c in picks])
