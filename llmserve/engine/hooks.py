"""The step-hook protocol: how a feature takes part in the engine step without the step
knowing the feature.

``EngineCore.step`` is one pipeline, the same for every configuration:

    before_schedule -> schedule -> after_schedule -> forward -> after_forward
        -> sample -> append each token (accept_token) -> finish (finishing)

A feature (prefill/decode transfer, LoRA, speculative decoding, structured outputs,
the KV integrity check) is a ``StepHook`` that overrides the points it needs; the base
class does nothing at each, so the engine calls every hook at every point. The order
of the hooks is the order features were listed in ``features.py``; no hook depends on
another having run first at the same point.

What a hook may do at each point:

- ``add_request``: check or prepare a request before it is queued; raising ValueError
  refuses it and must leave nothing behind.
- ``before_schedule``: look at the running sequences (a draft's tokens are proposed
  here, so the scheduler can fit them).
- ``schedule_again``: the step scheduled nothing; return True after freeing something
  the queue's head may be waiting for, and the engine schedules once more.
- ``after_schedule``: the batch is fixed and its block moves applied (start work that
  overlaps the forward, check the KV the batch will read).
- ``after_forward``: the forward ran and the sequences' computed counts include it.
- ``forked``: a sequence now shares its blocks with a new one (n > 1, beams).
- ``token_masks``: the token bitmask rows of sequences that carry a grammar matcher
  (1 + k rows for one with a k-token draft), for the sampler.
- ``verified``: a sequence's draft was verified: ``num_accepted`` of its
  ``num_draft`` tokens held, and its KV is valid up to ``num_computed`` tokens.
- ``accept_token``: a token was appended; return a finishing status to stop the
  sequence there (checked after the token-level stops: EOS, stop ids, lengths).
- ``finishing``: the sequence is about to finish, its blocks not yet freed.
- ``aborted``: the request was aborted (its sequences are finished already).
- ``after_step``: the whole step took ``seconds``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from llmserve.core.request import Request, Sequence, SequenceStatus
    from llmserve.core.sched.output import ScheduledBatch


class StepHook:
    """A feature's part in the step. Override what the feature needs."""

    def add_request(self, req: Request) -> None:
        pass

    def before_schedule(self, running: list[Sequence]) -> None:
        pass

    def schedule_again(self) -> bool:
        return False

    def after_schedule(self, batch: ScheduledBatch) -> None:
        pass

    def after_forward(self, batch: ScheduledBatch) -> None:
        pass

    def forked(self, parent: Sequence, child: Sequence) -> None:
        pass

    def token_masks(self, seqs: list[Sequence]) -> torch.Tensor | None:
        return None

    def verified(self, seq: Sequence, num_draft: int, num_accepted: int,
                 num_computed: int) -> None:
        pass

    def accept_token(self, seq: Sequence, token: int) -> SequenceStatus | None:
        return None

    def finishing(self, seq: Sequence, status: SequenceStatus) -> None:
        pass

    def aborted(self, req: Request) -> None:
        pass

    def after_step(self, batch: ScheduledBatch, seconds: float) -> None:
        pass

    def reset_counters(self) -> None:
        """After the warm-up: counters start at zero."""


class Hooks(StepHook):
    """The features' hooks as one: each point calls every hook in order."""

    def __init__(self, hooks: list[StepHook]):
        self.hooks = hooks

    def add_request(self, req):
        for h in self.hooks:
            h.add_request(req)

    def before_schedule(self, running):
        for h in self.hooks:
            h.before_schedule(running)

    def schedule_again(self):
        # Every hook gets the chance to free what it holds (no short-circuit).
        return any([h.schedule_again() for h in self.hooks])

    def after_schedule(self, batch):
        for h in self.hooks:
            h.after_schedule(batch)

    def after_forward(self, batch):
        for h in self.hooks:
            h.after_forward(batch)

    def forked(self, parent, child):
        for h in self.hooks:
            h.forked(parent, child)

    def token_masks(self, seqs):
        return next((m for h in self.hooks if (m := h.token_masks(seqs)) is not None), None)

    def verified(self, seq, num_draft, num_accepted, num_computed):
        for h in self.hooks:
            h.verified(seq, num_draft, num_accepted, num_computed)

    def accept_token(self, seq, token):
        status = None
        for h in self.hooks:
            status = h.accept_token(seq, token) or status
        return status

    def finishing(self, seq, status):
        for h in self.hooks:
            h.finishing(seq, status)

    def aborted(self, req):
        for h in self.hooks:
            h.aborted(req)

    def after_step(self, batch, seconds):
        for h in self.hooks:
            h.after_step(batch, seconds)

    def reset_counters(self):
        for h in self.hooks:
            h.reset_counters()
