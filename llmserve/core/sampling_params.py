"""What a request asks of the sampler, validated up front: ``SamplingParams`` and, inside
it, ``StructuredOutputsParams`` (the grammar its output must match)."""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field, replace

MAX_N = 16
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0  # OpenAI's range: -100 bans a token, +100 all but forces it


class RequestOutputKind(enum.Enum):
    """What each output of a request holds (vLLM's names): everything so far, only what
    is new since the previous output (streaming), or one output when it finishes."""
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


class ParamError(ValueError):
    """A parameter the engine rejects (it alone knows the vocabulary); ``param`` names
    the field, so the server's 400 can."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0 disables
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the model's maximum length
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives per token, 0 = sampled only
    # vLLM's prompt_logprobs: the log-probability of every prompt token after the first
    # (and this many top alternatives); the prompt is computed in full for it, never
    # taken from the prefix cache.
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    extra_eos_token_ids: list[int] = field(default_factory=list, repr=False)
    # Constrain the output to a JSON schema, regex, choice or grammar (structured.py).
    structured_outputs: StructuredOutputsParams | None = None
    # Token controls: OpenAI's logit_bias (token id -> bias added to its logit), vLLM's
    # allowed_token_ids (nothing else may be sampled) and bad_words (never generated).
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # bad_words as token ids, filled in by the engine, which has the tokenizer.
    bad_words_token_ids: list[list[int]] = field(default_factory=list, repr=False)
    # Beam search (beam_search.py) instead of sampling; n is then the beam width.
    beam: BeamSearchParams | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == 0:
            self.top_k = -1
        self.validate()

    def validate(self) -> None:
        def check(ok: bool, name: str, msg: str) -> None:
            if not ok:
                raise ValueError(f"{name} {msg}")

        check(_is_int(self.n) and 1 <= self.n <= MAX_N, "n", f"must be an integer in [1, {MAX_N}]")
        check(_is_num(self.temperature) and 0.0 <= self.temperature <= 2.0,
              "temperature", "must be in [0, 2]")
        check(_is_num(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]")
        check(_is_int(self.top_k) and (self.top_k == -1 or self.top_k >= 1),
              "top_k", "must be -1 (disabled) or a positive integer")
        check(_is_num(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]")
        check(self.seed is None or (_is_int(self.seed) and -2**63 <= self.seed < 2**63),
              "seed", "must be a 64-bit signed integer")
        check(self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1),
              "max_tokens", "must be a positive integer")
        check(_is_int(self.min_tokens) and self.min_tokens >= 0,
              "min_tokens", "must be a non-negative integer")
        if self.max_tokens is not None:
            check(self.min_tokens <= self.max_tokens, "min_tokens", "must not exceed max_tokens")
        check(all(isinstance(s, str) and s for s in self.stop), "stop",
              "must be a non-empty string or a list of them")
        check(all(_is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
              "must be a list of non-negative integers")
        check(self.logprobs is None
              or (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
              "logprobs", f"must be an integer in [0, {MAX_LOGPROBS}]")
        check(self.prompt_logprobs is None
              or (_is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= MAX_LOGPROBS),
              "prompt_logprobs", f"must be an integer in [0, {MAX_LOGPROBS}]")
        check(_is_num(self.presence_penalty) and -2.0 <= self.presence_penalty <= 2.0,
              "presence_penalty", "must be in [-2, 2]")
        check(_is_num(self.frequency_penalty) and -2.0 <= self.frequency_penalty <= 2.0,
              "frequency_penalty", "must be in [-2, 2]")
        check(_is_num(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 2.0,
              "repetition_penalty", "must be in (0, 2]")
        check(self.structured_outputs is None
              or isinstance(self.structured_outputs, StructuredOutputsParams),
              "structured_outputs", "must be a StructuredOutputsParams")
        check(self.structured_outputs is None or not self.min_tokens, "min_tokens",
              "cannot be combined with structured outputs: the grammar decides where the "
              "output ends")
        self._validate_token_controls(check)

    def _validate_token_controls(self, check) -> None:
        bias = self.logit_bias
        check(bias is None or isinstance(bias, dict), "logit_bias",
              "must map token ids to numbers")
        for token, value in (bias or {}).items():
            check(_is_int(token) and token >= 0, "logit_bias",
                  f"keys must be token ids (non-negative integers); got {token!r}")
            check(_is_num(value) and -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS, "logit_bias",
                  f"values must be in [-100, 100]; got {value!r} for token {token}")
        allowed = self.allowed_token_ids
        check(allowed is None or (isinstance(allowed, list) and allowed
                                  and all(_is_int(t) and t >= 0 for t in allowed)),
              "allowed_token_ids", "must be a non-empty list of token ids (non-negative "
              "integers)")
        words = self.bad_words
        check(words is None or (isinstance(words, list)
                                and all(isinstance(w, str) and w.strip() for w in words)),
              "bad_words", "must be a list of strings that are not blank")

    def check_token_ids(self, vocab_size: int) -> None:
        """Raise ParamError naming the field if an id is outside the vocabulary."""
        for name, ids in (("logit_bias", self.logit_bias or ()),
                          ("allowed_token_ids", self.allowed_token_ids or ()),
                          ("stop_token_ids", self.stop_token_ids or ())):
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise ParamError(name, f"{name} names token id {bad[0]}, outside the "
                                       f"vocabulary [0, {vocab_size})")

    @property
    def has_token_controls(self) -> bool:
        return bool(self.logit_bias or self.allowed_token_ids or self.bad_words_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    def sample_seed(self, index: int) -> int | None:
        """Seed of the index-th parallel sample: sample i of a seeded n-way request
        equals a single-sample request with seed + i."""
        return None if self.seed is None else self.seed + index

    def copy(self) -> SamplingParams:
        """A copy the engine may fill in (``max_tokens``) without touching the caller's."""
        return replace(self)


@dataclass
class BeamSearchParams:
    """vLLM's offline beam search parameters (``LLM.beam_search``)."""
    beam_width: int
    max_tokens: int | None  # None: up to the model's length (the engine fills it in)
    ignore_eos: bool = False
    temperature: float = 0.0  # 0: the model's logprobs; t > 0: of logits / t
    length_penalty: float = 1.0
    early_stopping: bool | str = False  # True, False or "never" (transformers')

    def __post_init__(self) -> None:
        def check(ok: bool, name: str, msg: str) -> None:
            if not ok:
                raise ValueError(f"{name} {msg}")

        check(_is_int(self.beam_width) and 1 <= self.beam_width <= MAX_N, "beam_width",
              f"must be an integer in [1, {MAX_N}]")
        check(self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1),
              "max_tokens", "must be a positive integer")
        check(_is_num(self.temperature) and 0.0 <= self.temperature <= 2.0, "temperature",
              "must be in [0, 2]")
        check(_is_num(self.length_penalty) and abs(self.length_penalty) <= 10,
              "length_penalty", "must be a number in [-10, 10]")
        check(self.early_stopping in (True, False, "never"), "early_stopping",
              "must be true, false or \"never\"")


def beam_sampling_params(beam: BeamSearchParams) -> SamplingParams:
    """The request a beam search is: n beams, the same length limit."""
    return SamplingParams(n=beam.beam_width, max_tokens=beam.max_tokens,
                          ignore_eos=beam.ignore_eos, beam=beam)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x  # rejects NaN


KINDS = ("json", "json_object", "regex", "choice", "grammar")


class GrammarError(ValueError):
    """The spec cannot be compiled: bad syntax, or a construct llguidance lacks."""


@dataclass(frozen=True)
class StructuredOutputsParams:
    """What a request's output must match; exactly one field is set (vLLM's names)."""

    json: str | dict | None = None  # a JSON schema (object or its text)
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None  # Lark, or GBNF as llama.cpp writes it
    json_object: bool | None = None  # any JSON object

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured outputs need exactly one of "
                             f"{', '.join(KINDS)}; got {given or 'none'}")
        if self.choice is not None:
            if not (isinstance(self.choice, (list, tuple)) and self.choice
                    and all(isinstance(c, str) and c for c in self.choice)):
                raise ValueError("'choice' must be a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", tuple(self.choice))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                raise ValueError(f"'{name}' must be a non-empty string")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError("'json' must be a JSON schema (an object or its text)")
        if self.json_object not in (None, True, False):
            raise ValueError("'json_object' must be a boolean")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple[str, str]:
        """Canonical (kind, text): equal specs share one compiled grammar."""
        kind = self.kind
        if kind == "json":
            schema = self.json if isinstance(self.json, dict) else _loads_schema(self.json)
            return kind, json.dumps(schema, sort_keys=True)
        if kind == "choice":
            return kind, json.dumps(list(self.choice))
        if kind == "json_object":
            return kind, ""
        return kind, getattr(self, kind)


def _loads_schema(text: str) -> dict:
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as e:
        raise GrammarError(f"the JSON schema is not valid JSON: {e}") from e
    if not isinstance(schema, dict):
        raise GrammarError("a JSON schema must be an object")
    return schema
