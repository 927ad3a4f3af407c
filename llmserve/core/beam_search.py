"""Beam search: which beams live on after each step, which hypotheses are finished, and
when the search is over. Plain Python over (token, logprob) candidates; the engine
moves the sequences (forks share blocks copy-on-write, dropped beams free theirs).

The rules are transformers' (``generate(num_beams=W)``, the test oracle), per step:

- every live beam offers its top K next tokens, K = max(2, 1 + #EOS ids) x W, scored by
  its cumulative logprob plus the token's; the top K over all beams are ranked;
- a candidate that stops (an EOS id, or reaching max_tokens) and ranks among the first
  W becomes a finished hypothesis, scored ``cum_logprob / generated_len ** length_penalty``;
  the W best hypotheses are kept;
- the W best candidates that do not stop are the next beams (a beam chosen twice forks);
- the search ends when every candidate stops (max_tokens), when W hypotheses are in and
  ``early_stopping`` is True, or when no live beam can still beat the worst of W
  hypotheses (``early_stopping`` False: judged at the current length; "never": at
  max_tokens when the penalty favours length).

Invariants: at most W live beams; ``hypotheses`` is sorted best first and holds at most W;
once ``done``, nothing is offered or selected again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llmserve.core.sampling_params import BeamSearchParams

__all__ = ["BeamSearch", "BeamSearchParams", "Candidate", "Hypothesis"]


@dataclass
class Hypothesis:
    """A finished beam: its generated tokens (with the EOS that ended it, if one did)."""
    token_ids: list[int]
    cum_logprob: float
    score: float  # cum_logprob / len(token_ids) ** length_penalty
    finish_reason: str  # "stop" (EOS) or "length"


@dataclass
class Candidate:
    parent: int  # the live beam's key (the engine's sequence id)
    token_id: int
    cum_logprob: float


@dataclass
class BeamSearch:
    params: BeamSearchParams
    eos_token_ids: frozenset[int]
    cum_logprobs: dict[int, float] = field(default_factory=dict)  # live beam -> score
    offers: dict[int, list[tuple[int, float]]] = field(default_factory=dict)
    tokens: dict[int, list[int]] = field(default_factory=dict)  # live beam -> generated
    hypotheses: list[Hypothesis] = field(default_factory=list)
    generated: int = 0  # tokens every live beam has generated
    can_improve: bool = True  # transformers' early-stop heuristic, once False stays so
    done: bool = False

    def __post_init__(self) -> None:
        if self.params.ignore_eos:
            self.eos_token_ids = frozenset()

    @property
    def width(self) -> int:
        return self.params.beam_width

    @property
    def num_candidates(self) -> int:
        """K: how many next tokens each beam offers."""
        return max(2, 1 + len(self.eos_token_ids)) * self.width

    def start(self, key: int) -> None:
        """The first beam: the prompt, nothing generated yet."""
        self.cum_logprobs, self.tokens = {key: 0.0}, {key: []}

    def offer(self, key: int, top: list[tuple[int, float]]) -> None:
        """Live beam ``key``'s best next tokens, (token id, logprob) best first."""
        assert not self.done and key in self.cum_logprobs
        self.offers[key] = top

    @property
    def ready(self) -> bool:
        """Every live beam has offered: the step can be decided."""
        return not self.done and len(self.offers) == len(self.cum_logprobs)

    def select(self) -> list[Candidate]:
        """Decide the step: the next beams, best first (their ``parent`` is the beam
        they extend). Updates the hypotheses and ``done``; the caller re-keys the next
        beams with ``advance``."""
        assert self.ready
        ranked = sorted((Candidate(key, t, self.cum_logprobs[key] + lp)
                         for key in self.cum_logprobs for t, lp in self.offers[key]),
                        key=lambda c: -c.cum_logprob)[:self.num_candidates]
        length = self.generated + 1
        stops = [c.token_id in self.eos_token_ids or length >= self.params.max_tokens
                 for c in ranked]
        self._add_hypotheses([c for c, s in zip(ranked[:self.width], stops) if s], length)
        beams = [c for c, s in zip(ranked, stops) if not s][:self.width]
        self.offers.clear()
        self.generated = length
        self._update_can_improve(beams)
        full = len(self.hypotheses) == self.width
        self.done = (all(stops) or not self.can_improve
                     or (full and self.params.early_stopping is True))
        return beams

    def advance(self, beams: list[tuple[int, Candidate]]) -> None:
        """The next live beams as (new key, the candidate it took)."""
        self.tokens = {key: self.tokens[c.parent] + [c.token_id] for key, c in beams}
        self.cum_logprobs = {key: c.cum_logprob for key, c in beams}

    def _add_hypotheses(self, stopped: list[Candidate], length: int) -> None:
        full = len(self.hypotheses) == self.width
        if not self.can_improve or (full and self.params.early_stopping is True):
            return
        for c in stopped:
            eos = c.token_id in self.eos_token_ids
            self.hypotheses.append(Hypothesis(
                self.tokens[c.parent] + [c.token_id], c.cum_logprob,
                c.cum_logprob / length ** self.params.length_penalty,
                "stop" if eos else "length"))
        self.hypotheses.sort(key=lambda h: -h.score)
        del self.hypotheses[self.width:]

    def _update_can_improve(self, beams: list[Candidate]) -> None:
        """Whether the best live beam could still beat the worst kept hypothesis."""
        if len(self.hypotheses) < self.width or not beams:
            return
        p = self.params
        length = (p.max_tokens if p.early_stopping == "never" and p.length_penalty > 0
                  else self.generated)
        best_possible = beams[0].cum_logprob / length ** p.length_penalty
        if best_possible <= self.hypotheses[-1].score:
            self.can_improve = False

    def results(self) -> list[Hypothesis]:
        """The finished hypotheses, best first (at most W). Should the search have
        stopped with fewer, the live beams fill in, scored the same way."""
        out = list(self.hypotheses)
        if len(out) < self.width and self.generated:
            lp = self.params.length_penalty
            live = sorted((Hypothesis(self.tokens[k], s, s / self.generated ** lp, "length")
                           for k, s in self.cum_logprobs.items()), key=lambda h: -h.score)
            out += live[:self.width - len(out)]
        return out
