"""SamplingParams: what a request asks of the sampler, validated up front."""

from __future__ import annotations

from dataclasses import dataclass, field

from llmserve.engine.structured import StructuredOutputsParams

MAX_N = 16
MAX_LOGPROBS = 20


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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    extra_eos_token_ids: list[int] = field(default_factory=list, repr=False)
    # Constrain the output to a JSON schema, regex, choice or grammar (structured.py).
    structured_outputs: StructuredOutputsParams | None = None

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


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x  # rejects NaN
