"""What the engine hands back: vLLM-shaped RequestOutput / CompletionOutput."""

from __future__ import annotations

from dataclasses import dataclass, field

from llmserve.core.request import Logprob, Request, Sequence


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or token that matched
    logprobs: list[Logprob] | None = None
    cum_logprob: float | None = None  # beam search: the hypothesis' total logprob

    @classmethod
    def of(cls, seq: Sequence) -> CompletionOutput:
        reason = seq.status.value if seq.finished else None
        return cls(index=seq.index, text=seq.text, token_ids=seq.output_token_ids,
                   finish_reason=reason, stop_reason=seq.stop_reason,
                   logprobs=list(seq.logprobs) if seq.params.logprobs is not None else None)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: dict = field(default_factory=dict)
    # With SamplingParams.prompt_logprobs: one per prompt token, None for the first.
    prompt_logprobs: list[Logprob | None] | None = None
    # A prefill engine's leg-1 answer: where the prompt's KV is held (engine/disagg.py).
    kv_transfer_params: dict | None = None

    @classmethod
    def of(cls, req: Request) -> RequestOutput:
        return cls(request_id=req.request_id, prompt=req.prompt,
                   prompt_token_ids=req.prompt_token_ids,
                   outputs=(beam_outputs(req) if req.beams is not None
                            else [CompletionOutput.of(s) for s in req.sequences]),
                   finished=req.finished,
                   prompt_logprobs=(list(req.prompt_logprobs)
                                    if req.prompt_logprobs is not None else None),
                   kv_transfer_params=req.kv_transfer_params,
                   metrics={"arrival_time": req.arrival_time,
                            "first_scheduled_time": req.first_scheduled_time,
                            "first_token_time": req.first_token_time})


def beam_outputs(req: Request) -> list[CompletionOutput]:
    """A beam search's hypotheses, best first, once it has ended (none before)."""
    if not req.beams.done:
        return []
    return [CompletionOutput(k, h.text, h.token_ids, h.finish_reason, cum_logprob=h.cum_logprob)
            for k, h in enumerate(req.beams.results())]


@dataclass
class BeamSearchSequence:
    """One hypothesis of ``LLM.beam_search``, as vLLM shapes it: ``tokens`` and ``text``
    are the whole sequence, prompt included."""
    tokens: list[int]
    text: str
    cum_logprob: float
    finish_reason: str  # "stop" (an EOS) or "length"
    num_prompt_tokens: int

    @property
    def output_token_ids(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens:]


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # best first
