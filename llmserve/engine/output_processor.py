"""The output processor: the engine core's per-step token deltas turned into what callers
read (vLLM v1's OutputProcessor), on the frontend side of the core.

Per request it keeps what the core does not: each sequence's text (detokenizer.py),
and, unless the caller streams, the tokens and logprobs so far. Each step it

- detokenises the new tokens and looks for stop strings, once, here: a match cuts the
  text and ends the sequence in the core (``stop_sequence``) before the next step is
  scheduled;
- builds the request's output in the kind the caller asked for
  (``SamplingParams.output_kind``): CUMULATIVE (everything so far: the lists are the
  live ones, not copies), DELTA (only what is new, and nothing kept of what was sent;
  text that might still turn out to be the start of a stop string is held back until
  the next token or the end, so a stop string is never half-sent) or FINAL_ONLY (one
  output, when it finishes);
- counts what the metrics need (``IterationStats``).

Precedence, as a token is appended: EOS and stop token ids (the core's) end a sequence
before any stop string in that token's text can; a stop string ends it before
max_tokens or a grammar's end would (it then reads as "stop" with the string as its
stop reason).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from llmserve.core.request import Logprob, Request
from llmserve.core.sampling_params import RequestOutputKind
from llmserve.engine.detokenizer import Detokenizer, SequenceText
from llmserve.engine.output import (
    CompletionOutput,
    EngineCoreOutput,
    RequestOutput,
    SequenceDelta,
)


@dataclass
class IterationStats:
    """What a step's outputs add to the request metrics."""
    generation_tokens: int = 0
    prompt_tokens: int = 0  # of requests that produced their first token
    ttfts: list[float] = field(default_factory=list)
    queue_times: list[float] = field(default_factory=list)
    itls: list[float] = field(default_factory=list)  # per request that produced more
    e2e_latencies: list[float] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)


class ChoiceState:
    """One sequence of a request, as the caller sees it."""

    def __init__(self, index: int, req: Request, cumulative: bool):
        self.index = index
        self.text = SequenceText(req.prompt_token_ids, req.params)
        self.cumulative = cumulative
        self.token_ids: list[int] = []  # cumulative kinds only
        self.logprobs: list[Logprob] | None = [] if req.params.logprobs is not None else None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.num_tokens = 0
        self.sent = 0  # DELTA: characters of the text kept that were already sent
        stops, include = req.params.stop, req.params.include_stop_str_in_output
        # What a stop string may still start in: the text's last so many characters.
        self.tail = max(map(len, stops)) - 1 if stops else 0
        self.hold = 0 if include else self.tail

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def output(self) -> CompletionOutput:
        return CompletionOutput(self.index, self.text.text, self.token_ids, self.finish_reason,
                                self.stop_reason, self.logprobs)

    def delta_output(self, token_ids: list[int], logprobs) -> CompletionOutput:
        """What is new since the last delta. The text sent is then dropped, but for the
        tail a stop string could still start in, so a long stream keeps no copy of its
        text and appends to a short string."""
        text = self.text.text
        end = len(text) if self.finished else max(self.sent, len(text) - self.hold)
        new_text, self.sent = text[self.sent:end], end
        if self.sent > self.tail:
            cut = self.sent - self.tail
            self.text.text, self.sent = text[cut:], self.tail
        return CompletionOutput(self.index, new_text, token_ids, self.finish_reason,
                                self.stop_reason, logprobs)


class RequestState:
    def __init__(self, req: Request):
        self.request_id = req.request_id
        self.prompt, self.prompt_token_ids = req.prompt, req.prompt_token_ids
        self.kind = req.params.output_kind
        self.is_beam = req.params.beam is not None
        count = 0 if self.is_beam else req.params.n
        cumulative = self.kind is not RequestOutputKind.DELTA
        self.choices = [ChoiceState(i, req, cumulative) for i in range(count)]
        self.hypotheses: list[CompletionOutput] = []
        self.prompt_logprobs = None
        self.kv_transfer_params = None
        self.metrics: dict = {}
        self.finished = False
        self.last_output_time: float | None = None
        self.num_generated = 0


class OutputProcessor:
    def __init__(self, tokenizer,
                 stop_sequence: Callable[[str, int, int, str], EngineCoreOutput | None]):
        """``stop_sequence(request_id, index, num_output_tokens, stop)``: the engine
        core's, to end a sequence on a stop string found here."""
        self.tokenizer = tokenizer
        self.detokenizer = Detokenizer(tokenizer)
        self.stop_sequence = stop_sequence
        self.requests: dict[str, RequestState] = {}
        self.stats = IterationStats()

    def add_request(self, req: Request) -> None:
        self.requests[req.request_id] = RequestState(req)

    def abort(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def process(self, core_outputs: list[EngineCoreOutput]) -> list[RequestOutput]:
        """The step's outputs for the callers; ``stats`` holds what they add to the
        metrics (reset on each call)."""
        self.stats = IterationStats()
        now = time.monotonic()
        outputs = []
        for core_out in core_outputs:
            state = self.requests.get(core_out.request_id)
            if state is None:  # aborted meanwhile
                continue
            out = self._process_request(state, core_out, now)
            if out is not None:
                outputs.append(out)
        return outputs

    def _process_request(self, state: RequestState, core_out: EngineCoreOutput,
                         now: float) -> RequestOutput | None:
        self._update_request(state, core_out)
        new = {}
        for delta in core_out.deltas:
            choice = state.choices[delta.index]
            kept = self._update_choice(state, choice, delta)
            new[delta.index] = (delta.token_ids[:kept], delta.logprobs[:kept]
                                if choice.logprobs is not None else None)
        if core_out.hypotheses is not None:
            state.hypotheses = [self._hypothesis(k, h) for k, h in
                                enumerate(core_out.hypotheses)]
        self._count(state, core_out, now)
        if state.finished:
            del self.requests[state.request_id]
        return self._output(state, new)

    @staticmethod
    def _update_request(state: RequestState, core_out: EngineCoreOutput) -> None:
        if core_out.prompt_logprobs is not None:
            state.prompt_logprobs = core_out.prompt_logprobs
        state.kv_transfer_params = core_out.kv_transfer_params
        state.finished = core_out.finished
        state.metrics = {"arrival_time": core_out.arrival_time,
                         "first_scheduled_time": core_out.first_scheduled_time,
                         "first_token_time": core_out.first_token_time}

    def _update_choice(self, state: RequestState, choice: ChoiceState,
                       delta: SequenceDelta) -> int:
        """Detokenise the delta's tokens; how many of them the choice keeps (fewer when
        a stop string ends it inside the delta)."""
        last = len(delta.token_ids) - 1
        for i, token in enumerate(delta.token_ids):
            # A token that ended the sequence on its own leaves no stop string a chance.
            stop = self.detokenizer.update(choice.text, token,
                                           check_stop=not (i == last and delta.token_stop))
            if stop is not None:
                self._stop(state, choice, stop)
                return self._keep(choice, delta, i + 1)
        if delta.finish_reason is not None:
            choice.finish_reason, choice.stop_reason = delta.finish_reason, delta.stop_reason
        return self._keep(choice, delta, len(delta.token_ids))

    def _stop(self, state: RequestState, choice: ChoiceState, stop: str) -> None:
        """A stop string ends ``choice``; the core ends its sequence too (unless it
        already had, on its length or its grammar)."""
        choice.finish_reason, choice.stop_reason = "stop", stop
        final = self.stop_sequence(state.request_id, choice.index,
                                   choice.text.num_output_tokens, stop)
        if final is not None:  # that finished the request
            state.finished = True
            state.kv_transfer_params = final.kv_transfer_params

    @staticmethod
    def _keep(choice: ChoiceState, delta: SequenceDelta, n: int) -> int:
        choice.num_tokens += n
        if choice.cumulative:
            choice.token_ids += delta.token_ids[:n]
            if choice.logprobs is not None:
                choice.logprobs += delta.logprobs[:n]
        return n

    def _hypothesis(self, k: int, h) -> CompletionOutput:
        text = self.tokenizer.decode(h.token_ids, skip_special_tokens=True)
        return CompletionOutput(k, text, h.token_ids, h.finish_reason,
                                cum_logprob=h.cum_logprob)

    def _count(self, state: RequestState, core_out: EngineCoreOutput, now: float) -> None:
        s = self.stats
        generated = (sum(len(h.token_ids) for h in state.hypotheses) if state.is_beam
                     else sum(c.num_tokens for c in state.choices))
        s.generation_tokens += max(0, generated - state.num_generated)
        state.num_generated = generated
        arrival = core_out.arrival_time
        if state.last_output_time is None:  # its first output: the prompt is prefilled
            s.prompt_tokens += len(state.prompt_token_ids)
            s.ttfts.append(now - arrival)
            s.queue_times.append(core_out.first_scheduled_time - arrival)
        else:
            s.itls.append(now - state.last_output_time)
        state.last_output_time = now
        if state.finished:
            s.e2e_latencies.append(now - arrival)
            first = state.hypotheses[0] if state.is_beam else state.choices[0]
            s.finish_reasons.append(first.finish_reason)

    def _output(self, state: RequestState, new: dict) -> RequestOutput | None:
        if state.kind is RequestOutputKind.FINAL_ONLY and not state.finished:
            return None
        if state.is_beam:
            choices = state.hypotheses
        elif state.kind is RequestOutputKind.DELTA:
            choices = [state.choices[i].delta_output(*new[i]) for i in sorted(new)]
        else:
            choices = [c.output() for c in state.choices]
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, choices,
                             state.finished, metrics=state.metrics,
                             prompt_logprobs=state.prompt_logprobs,
                             kv_transfer_params=state.kv_transfer_params)
