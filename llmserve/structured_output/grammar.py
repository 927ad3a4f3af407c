"""Structured outputs: grammar-constrained decoding with llguidance.

A request may ask that its output match a JSON schema, any JSON object, a regex, one
of a list of strings, or a Lark / GBNF grammar. Each such sequence carries its own
matcher (parser state over the tokens it has produced). Before sampling, the matcher
fills one row of a token bitmask; the sampler sets every disallowed logit to -inf,
so constrained and free requests share one batch. After sampling, the matcher
consumes the token; when the grammar is complete the sequence stops.

A speculative draft (spec_decode/) is verified at 1 + k positions at once, so a
drafted sequence gets one mask row per position: the matcher steps through the
draft's tokens the grammar accepts, filling the row after each, and rolls back. Rows
past a token the grammar refuses stay all-allowed: verification rejects the draft at
that token at the latest, so what they say is never used.

Why llguidance (measured in benchmarks/structured_backends.py, docs/benchmarks.md):
its masks are computed by a lexer/parser split in Rust with no Python in the loop,
compiling a schema takes milliseconds, it refuses JSON-schema keywords it does not
implement instead of ignoring them, and the wheel has no dependencies.

Grammars are compiled (validated against this tokenizer) once per distinct spec and
cached; masks for the sequences that will sample are computed on a worker thread
while the model runs (llguidance releases the GIL).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from llmserve.core.sampling_params import GrammarError, StructuredOutputsParams

# JSON as models are taught to write it: "," and ": " separators, no free whitespace
# (which a small model at high temperature can emit forever).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class StructuredOutputs:
    """Per engine: the llguidance tokenizer, the grammar cache and the mask worker."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: set[int],
                 cache_size: int = 512):
        import llguidance.hf

        self.vocab_size = vocab_size
        self.ll_tokenizer = llguidance.hf.from_tokenizer(
            tokenizer, n_vocab=vocab_size, eos_token=sorted(eos_token_ids) or None)
        self._cache: OrderedDict[tuple[str, str], object] = OrderedDict()  # -> LLMatcher
        self._cache_size = cache_size
        self._lock = threading.Lock()  # compiles run on server threads
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        self.compiles = self.cache_hits = 0

    # --- compiling ---------------------------------------------------------------
    def compile(self, spec: StructuredOutputsParams):
        """A prototype matcher for ``spec`` (built once, then cached): each sequence
        gets a deep copy, so the parser is never rebuilt on the engine thread.
        GrammarError, with llguidance's message, if the spec is invalid."""
        from llguidance import LLMatcher

        key = spec.key()
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                self.cache_hits += 1
                return self._cache[key]
        grammar = _to_llguidance(*key)
        is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, self.ll_tokenizer)
        if is_error:
            raise GrammarError(f"invalid {spec.kind} constraint: {messages[0]}")
        prototype = LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if prototype.is_error():
            raise GrammarError(f"invalid {spec.kind} constraint: {prototype.get_error()}")
        with self._lock:
            self.compiles += 1
            self._cache[key] = prototype
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return prototype

    def matcher(self, spec: StructuredOutputsParams):
        return self.compile(spec).deep_copy()

    # --- masks -----------------------------------------------------------------
    def start_masks(self, seqs) -> Future:
        """Fill the masks of ``seqs`` on the worker thread (overlaps the forward)."""
        return self._worker.submit(self._fill, list(seqs))

    def _fill(self, seqs) -> dict[int, torch.Tensor]:
        """Per sequence, its mask rows: one, or 1 + k for a k-token draft."""
        sizes = [1 + len(s.spec_token_ids) for s in seqs]
        bitmask = new_bitmask(sum(sizes), self.vocab_size)
        rows, start = {}, 0
        for seq, size in zip(seqs, sizes):
            fill_draft_masks(seq.matcher, seq.spec_token_ids, bitmask, start)
            rows[seq.seq_id] = bitmask[start:start + size]
            start += size
        return rows

    def masks(self, seqs, pending: Future | None) -> torch.Tensor:
        """Bitmask rows for ``seqs`` (all with a matcher; 1 + k rows for a drafted
        one), reusing the rows computed while the model ran; sequences forked after it
        (n > 1) are filled now."""
        ready = pending.result() if pending is not None else {}
        missing = [s for s in seqs if s.seq_id not in ready]
        if missing:
            ready = {**ready, **self._fill(missing)}
        return torch.cat([ready[s.seq_id] for s in seqs])

    def shutdown(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)


def new_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """``rows`` token bitmasks (llguidance's layout: 32 tokens per int32), all allowed."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


class GrammarWalk:
    """A matcher stepped through tokens it takes, and returned to where it began: how a
    draft is checked against a grammar (here, and as a draft model proposes it)."""

    def __init__(self, matcher):
        self.matcher = matcher
        self.steps = 0  # tokens consumed since the start

    def advance(self, token: int) -> bool:
        """Consume ``token`` if the grammar takes it; False if it refuses it, or is
        stopped (complete: it takes EOS without counting it, and rollback counts
        tokens, so a walk ends there). Validated first, so consuming never puts the
        matcher into its error state."""
        if self.matcher.is_stopped() or self.matcher.validate_tokens([token]) != 1:
            return False
        self.matcher.consume_token(token)
        self.steps += 1
        return True

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Row ``row`` of ``bitmask``: what the grammar allows next."""
        from llguidance.torch import fill_next_token_bitmask

        fill_next_token_bitmask(self.matcher, bitmask, row)

    def rewind(self) -> None:
        if self.steps:
            self.matcher.rollback(self.steps)
            self.steps = 0


def fill_draft_masks(matcher, draft: list[int], bitmask: torch.Tensor, row: int) -> None:
    """Rows ``row`` .. ``row + len(draft)`` of ``bitmask``: what the grammar allows
    after each prefix of ``draft`` it accepts (the rows after a refused token are left
    as they are). The matcher ends where it began."""
    walk = GrammarWalk(matcher)
    walk.fill(bitmask, row)
    for token in draft:
        if not walk.advance(token):
            break
        walk.fill(bitmask, row + walk.steps)
    walk.rewind()


def _to_llguidance(kind: str, text: str) -> str:
    from llguidance import LLMatcher, grammar_from

    if kind == "json":
        return LLMatcher.grammar_from_json_schema(text, defaults=JSON_OPTIONS)
    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_OPTIONS)
    if kind == "regex":
        return LLMatcher.grammar_from_regex(text)
    if kind == "choice":
        return grammar_from("choice", text)
    try:
        return grammar_from("grammar", text)  # Lark, or GBNF converted to Lark
    except ValueError as e:
        raise GrammarError(f"invalid grammar constraint: {e}") from e
