"""What the engine hands back.

Two shapes, as in vLLM v1:

- ``EngineCoreOutput``: what the engine core produced for one request in one step, in
  token ids only: each sequence's new tokens (and logprobs), and how it finished. The
  core keeps no copy of what it already emitted.
- ``RequestOutput`` / ``CompletionOutput``: what callers read, built from those by the
  output processor (output_processor.py), with the text: everything so far, only
  what is new (streaming), or once, when the request finishes
  (``SamplingParams.output_kind``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llmserve.core.beam_search import Hypothesis
from llmserve.core.request import Logprob


@dataclass
class SequenceDelta:
    """One sequence's part of a step: the tokens appended to it, in order."""
    index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprob | None] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | None = None  # the stop token id that ended it
    # Its last token ended it before any stop string could (EOS or a stop token id,
    # once min_tokens were out): the output processor looks for no stop string in it.
    token_stop: bool = False


@dataclass
class EngineCoreOutput:
    request_id: str
    deltas: list[SequenceDelta]  # the sequences that changed, by index
    finished: bool
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    # The prompt's logprobs (SamplingParams.prompt_logprobs), complete by the request's
    # first output, which carries them.
    prompt_logprobs: list[Logprob | None] | None = None
    kv_transfer_params: dict | None = None  # a prefill engine's leg-1 answer (disagg.py)
    hypotheses: list[Hypothesis] | None = None  # beam search, once it ends


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or token that matched
    logprobs: list[Logprob] | None = None
    cum_logprob: float | None = None  # beam search: the hypothesis' total logprob


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
