"""Request and sequence state.

A Request is what a user submitted; it owns one Sequence per parallel sample
(n > 1). The scheduler and block manager only ever see Sequences.

A sequence's life: WAITING -> RUNNING -> FINISHED_*, with RUNNING -> WAITING
(preempted, recompute) or RUNNING -> SWAPPED -> RUNNING (preempted, swap).
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

from llmserve.core.beam_search import BeamSearch
from llmserve.core.lora_request import LoRARequest
from llmserve.core.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self.value in ("stop", "length", "abort")


_seq_counter = itertools.count()


@dataclass
class Logprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob) of the top alternatives, best first
    rank: int | None = None  # 1 + how many tokens were likelier (prompt logprobs)


class Sequence:
    def __init__(self, request: Request, index: int, prompt_token_ids: list[int]):
        self.seq_id = next(_seq_counter)
        self.request = request
        self.index = index
        self.params: SamplingParams = request.params
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        # Tokens whose K/V is in the cache. The model has to run on
        # token_ids[num_computed_tokens:] before this sequence can sample again.
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.cpu_block_table: list[int] = []  # while swapped out
        self.block_hashes: list[bytes] = []  # prefix-cache keys of full token blocks
        self.num_cached_blocks = 0  # leading blocks registered in the prefix cache
        self.status = SequenceStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        self.recomputed_until = 0  # tokens computed before a recompute preemption
        # Parser state of a constrained output (structured.py); survives preemption,
        # since it follows the tokens, not the KV cache.
        self.matcher = None
        # Speculative decoding: this step's draft (spec_decode/), verified and cleared
        # by the engine once the step ran. Never part of token_ids.
        self.spec_token_ids: list[int] = []
        # Its drafts' (accepted, tried) tokens, decayed: spec_decode/draft_policy.py
        # (None: no draft yet, the policy's prior).
        self.draft_stats: tuple[float, float] | None = None
        # Leading positions whose draft-model KV is valid (spec_decode/draft_model.py).
        self.num_draft_computed = 0
        # An unseeded sampled sequence drafted by a draft model: the random seed its
        # draws are keyed by from its first draft on, so the draft model and the
        # verification share their randomness (spec_decode/draft_model.py).
        self.coupling_seed: int | None = None

    # --- sizes -------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def priority(self) -> int:
        return self.request.priority

    @property
    def arrival_time(self) -> float:
        return self.request.arrival_time

    @property
    def finished(self) -> bool:
        return self.status.finished

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def prompt_logprob_positions(self, num_new: int) -> range:
        """Of the next ``num_new`` positions to compute, those whose logits score the
        prompt token after them (empty unless the request wants prompt logprobs)."""
        if self.params.prompt_logprobs is None:
            return range(0)
        end = min(self.num_computed_tokens + num_new, self.num_prompt_tokens - 1)
        # Tokens scored before a recompute preemption are not scored again.
        start = max(self.num_computed_tokens, len(self.request.prompt_logprobs) - 1)
        return range(start, max(start, end))

    def reset_for_recompute(self) -> None:
        """Forget the KV cache: the whole sequence (prompt and the tokens generated
        so far) is prefilled again when it is rescheduled, so outputs do not change."""
        self.recomputed_until = max(self.recomputed_until, self.num_computed_tokens)
        self.num_computed_tokens = 0
        self.spec_token_ids = []
        self.num_draft_computed = 0

    def first_time_tokens(self, num_new: int) -> int:
        """Of ``num_new`` tokens about to be computed, those never computed before
        (a recompute preemption's re-prefill is the engine's cost, not the tenant's)."""
        start = self.num_computed_tokens
        return max(0, start + num_new - max(start, self.recomputed_until))

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, req={self.request.request_id}, "
                f"status={self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={len(self.block_table)})")


@dataclass(frozen=True)
class Tenancy:
    """Whose request this is, for fair order in the waiting queue (set by the gateway)."""
    name: str
    weight: float = 1.0


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0
    cache_salt: bytes = b""  # isolates prefix-cache entries (e.g. per tenant)
    tenant: str = ""  # fair order among tenants of equal priority (scheduler)
    tenant_weight: float = 1.0
    lora: LoRARequest | None = None  # the adapter it runs under (None: the base model)
    sequences: list[Sequence] = field(default_factory=list)
    # With params.prompt_logprobs: one entry per prompt token computed so far; the first
    # token has none (nothing precedes it).
    prompt_logprobs: list[Logprob | None] | None = None
    beams: BeamSearch | None = None  # the search's state, with params.beam
    # P/D (engine/disagg.py). Prefill engine: hold the prompt's KV for a decode engine
    # when this request finishes, and say where (kv_transfer_params). Decode engine: the
    # imported prefix's blocks, held until the request is first scheduled.
    remote_decode: bool = False
    kv_transfer_params: dict | None = None
    kv_hold: list[int] = field(default_factory=list)
    emitted: bool = False  # the engine has produced an output for it
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    def __post_init__(self) -> None:
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]
        if not self.sequences:
            # Beam search starts from one beam and forks as beams are chosen.
            count = 1 if self.params.beam is not None else self.params.n
            self.sequences = [Sequence(self, i, self.prompt_token_ids) for i in range(count)]

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.sequences)

    @property
    def live_sequences(self) -> list[Sequence]:
        return [s for s in self.sequences if not s.finished]

    def fork_beam(self, parent: Sequence) -> Sequence:
        """A new beam with ``parent``'s tokens (its blocks are the caller's to share)."""
        child = Sequence(self, len(self.sequences), self.prompt_token_ids)
        child.token_ids = list(parent.token_ids)
        self.sequences.append(child)
        return child
