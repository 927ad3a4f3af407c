"""Draft-model proposals: a smaller model that shares the target's tokenizer guesses the
next k tokens, one decode at a time; the target verifies them all in one step.

The draft's KV cache has the target's blocks: the same block ids, tables and slots,
in a cache of its own shape. So the block manager, the scheduler's allocations, swap
preemption and copy-on-write copies serve both models at once. The draft computes
only when it drafts, so a sequence the policy does not draft costs nothing here. Each
sequence counts the leading positions whose draft KV is valid
(``Sequence.num_draft_computed``: 0 when it starts, after a fork and after a
recompute preemption), and a draft starts by catching up: one chunk from there to
the sequence's last token, whose last row gives the first draft token; k - 1 one-row
decodes give the rest. All of it lands in slots the step already reserved or the
target already computed (the scheduler allocates the 1 + k slots before the draft
runs). After verification only the positions whose inputs were accepted stay counted
(``verified``). Blocks reused from the prefix cache were filled by the target, maybe
not by the draft, so a new sequence's count starts at 0 and its catch-up rewrites
them (the same values: the same tokens at the same positions). A step's catch-ups are
bounded (``speculator.CATCH_UP_TOKENS``): a sequence further behind is not drafted
but caught up over the next steps (``catch_up``), so no step stalls on a long
prompt's draft prefill.

A draft token is drawn by the engine's own sampler from the draft model's logits, as
the target's token at that position would be drawn from the target's: the same
temperature, filters, penalties, token controls and grammar mask (the matcher steps
through the draft and rolls back), and the same race key. So the two draws share
their randomness (a Gumbel-max coupling): a greedy draft is the draft's argmax, and a
sampled draft token equals the target's whenever the exponential race over the
draft's probabilities and over the target's, run on the same exponentials, pick the
same token, which the closer the two models are the likelier it is (an identical
draft is always accepted). Verification (``rejection_sampler.py``) outputs the
target's own draws and accepts the draft while it equals them, so the output is the
target's exactly, seeded outputs included. An unseeded sampled sequence gets a random
seed (``Sequence.coupling_seed``) at its first draft so that its draws have keys to
share.
"""

from __future__ import annotations

import dataclasses
import random

import torch

from llmserve.config import EngineConfig
from llmserve.core.request import Sequence
from llmserve.core.sched.output import ScheduledBatch
from llmserve.model_executor.model_loader.sources import load_config, resolve_model
from llmserve.model_executor.models.registry import check_architecture
from llmserve.model_executor.models.supported import layer_sliding_window
from llmserve.spec_decode.rejection_sampler import DraftPosition
from llmserve.structured_output.grammar import GrammarWalk, new_bitmask
from llmserve.worker.kv_sizing import kv_block_bytes, model_weight_bytes
from llmserve.worker.model_runner import ModelRunner
from llmserve.worker.step_inputs import StepInputs

# The engine settings a draft model's runner turns off: the GPU fast path captures
# and keys its buffers by the target's batches, adapters and compilation are the
# target's alone.
_DRAFT_OFF = dict(speculative_config=None, enable_lora=False, lora_modules=None,
                  compile=False, cuda_graphs=False, cuda_graph_sizes=None,
                  pinned_staging=False, device_block_tables=False, profile_kv_cache=False)


class DraftModel:
    def __init__(self, config: EngineConfig, target_hf_config, max_model_len: int):
        source = config.speculative.model
        self.path = resolve_model(source)
        self.hf_config = load_config(self.path)
        check_architecture(self.hf_config)
        check_draft(source, target_hf_config, self.hf_config, max_model_len)
        self.config = dataclasses.replace(config, model=source, **_DRAFT_OFF)
        self.max_model_len = max_model_len
        self.runner: ModelRunner | None = None  # built once the target's blocks are sized

    def bytes_per_block(self) -> int:
        """What one block of the draft's cache costs (the target's budget holds both)."""
        elem = torch.tensor([], dtype=self.config.torch_dtype).element_size()
        return kv_block_bytes(self.hf_config, self.config.block_size, elem)

    def weight_bytes(self) -> int:
        """Device memory the draft's weights will take. It loads after the target's KV
        pool is sized (its cache takes the target's block count), so on a GPU that
        budget, taken from the memory then free, must leave this much."""
        return model_weight_bytes(self.hf_config, self.max_model_len, self.config.torch_dtype)

    def build(self, num_blocks: int, num_cpu_blocks: int) -> None:
        self.runner = ModelRunner(self.config, self.hf_config, self.path, self.max_model_len,
                                  blocks=(num_blocks, num_cpu_blocks))

    def apply_block_ops(self, batch: ScheduledBatch) -> None:
        """The step's swaps and copy-on-write copies, on the draft's cache too."""
        self.runner.apply_block_ops(batch)

    def propose(self, seqs: list[Sequence], sampler) -> None:
        """Replace each sequence's reserved draft (``spec_token_ids``, placeholders of
        the length the scheduler granted) by tokens ``sampler`` (the engine's) draws
        from the draft model's logits, coupled to the target's draws."""
        for seq in seqs:
            if (not seq.params.greedy and seq.coupling_seed is None
                    and seq.params.sample_seed(seq.index) is None):
                seq.coupling_seed = random.getrandbits(63)
        drafts = {s.seq_id: [] for s in seqs}
        grammars = DraftGrammars(seqs, self.hf_config.vocab_size)
        for j in range(max(len(s.spec_token_ids) for s in seqs)):
            active = [s for s in seqs if len(s.spec_token_ids) > j]
            inputs = (self._catch_up_inputs(active) if j == 0 else
                      self._decode_inputs(active, [drafts[s.seq_id][-1] for s in active], j))
            logits, _ = self.runner.execute(inputs)
            positions = [DraftPosition(s, drafts[s.seq_id]) for s in active]
            rows, bitmask = grammars.masks(active)
            for seq, token in zip(active, sampler(logits, positions, rows, bitmask).token_ids):
                drafts[seq.seq_id].append(token)
                grammars.consume(seq, token)
        grammars.rewind()
        for seq in seqs:
            seq.spec_token_ids = drafts[seq.seq_id]
            # Computed: up to the last token, then the inputs d_1 .. d_{k-1}.
            seq.num_draft_computed = seq.num_tokens + len(seq.spec_token_ids) - 1

    @staticmethod
    def gap(seq: Sequence) -> int:
        """Tokens before ``seq``'s last one without draft KV: its catch-up."""
        return max(0, seq.num_tokens - 1 - seq.num_draft_computed)

    def catch_up(self, seqs: list[Sequence], budget: int) -> None:
        """Draft KV for up to ``budget`` tokens of these decoding sequences' gaps, in
        order (no logits): a long gap is closed over several steps, never in one."""
        chunks = []
        for seq in seqs:
            n = min(self.gap(seq), budget)
            if n > 0:
                chunks.append((seq, seq.num_draft_computed, n))
                budget -= n
        if not chunks:
            return
        ids, positions, query_start = [], [], [0]
        for seq, start, n in chunks:
            ids += seq.token_ids[start:start + n]
            positions += range(start, start + n)
            query_start.append(len(ids))
        self.runner.execute(self._inputs([c[0] for c in chunks], ids, positions,
                                         query_start, []))
        for seq, start, n in chunks:
            seq.num_draft_computed = start + n

    @staticmethod
    def verified(seq: Sequence, num_computed: int) -> None:
        """``seq``'s draft was verified: its first ``num_computed`` positions hold
        accepted tokens; the draft's KV past them was computed from rejected ones."""
        seq.num_draft_computed = min(seq.num_draft_computed, num_computed)

    def _catch_up_inputs(self, seqs: list[Sequence]) -> StepInputs:
        """Per sequence, the positions from its first without draft KV to its last
        token; the logits of each chunk's last row."""
        ids, positions, query_start, rows = [], [], [0], []
        for seq in seqs:
            start = min(seq.num_draft_computed, seq.num_tokens - 1)
            ids += seq.token_ids[start:]
            positions += range(start, seq.num_tokens)
            query_start.append(len(ids))
            rows.append(len(ids) - 1)
        return self._inputs(seqs, ids, positions, query_start, rows)

    def _decode_inputs(self, seqs: list[Sequence], tokens: list[int], j: int) -> StepInputs:
        """One decode row per sequence: ``tokens[i]`` at position num_tokens - 1 + j."""
        positions = [s.num_tokens - 1 + j for s in seqs]
        rows = list(range(len(seqs)))
        return self._inputs(seqs, tokens, positions, rows + [len(seqs)], rows)

    def _inputs(self, seqs, ids, positions, query_start, rows) -> StepInputs:
        bs = self.config.block_size
        tables = [s.block_table for s in seqs]
        slots, seq_lens = [], []
        for i, table in enumerate(tables):
            chunk = positions[query_start[i]:query_start[i + 1]]
            slots += [table[p // bs] * bs + p % bs for p in chunk]
            seq_lens.append(chunk[-1] + 1)
        max_query = max(b - a for a, b in zip(query_start, query_start[1:]))
        return StepInputs(ids, positions, slots, query_start, seq_lens, tables, rows,
                          max_query)


class DraftGrammars:
    """The grammars of the constrained sequences being drafted, stepped through their
    drafts: ``masks`` gives each row's mask of what its grammar allows next (the
    sampler applies it), ``consume`` takes the token drafted, ``rewind`` returns every
    matcher to where the sequence is (the target's verification steps through the
    draft again)."""

    def __init__(self, seqs: list[Sequence], vocab_size: int):
        self.vocab_size = vocab_size
        self.walks = {s.seq_id: GrammarWalk(s.matcher) for s in seqs if s.matcher is not None}
        self.constraining = set(self.walks)  # seq ids whose grammar still takes the draft

    def masks(self, seqs: list[Sequence]) -> tuple[list[int] | None, torch.Tensor | None]:
        """(the rows of ``seqs`` still under a grammar, their masks), or (None, None)."""
        rows = [i for i, s in enumerate(seqs) if s.seq_id in self.constraining]
        if not rows:
            return None, None
        bitmask = new_bitmask(len(rows), self.vocab_size)
        for r, i in enumerate(rows):
            self.walks[seqs[i].seq_id].fill(bitmask, r)
        return rows, bitmask

    def consume(self, seq: Sequence, token: int) -> None:
        """A grammar that cannot take ``token`` (it is stopped: only EOS is left) stops
        constraining this draft: verification rejects what follows."""
        if seq.seq_id in self.constraining and not self.walks[seq.seq_id].advance(token):
            self.constraining.discard(seq.seq_id)

    def rewind(self) -> None:
        for walk in self.walks.values():
            walk.rewind()


def check_draft(source: str, target, draft, max_model_len: int) -> None:
    """ValueError unless ``draft`` can propose for ``target``: the same vocabulary (the
    tokenizer is shared), positions up to max_model_len, and full attention in both
    (a sliding window frees blocks the other model would still read)."""
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"speculative_config: the draft model {source!r} has a vocabulary "
                         f"of {draft.vocab_size} tokens, the target {target.vocab_size}: a "
                         f"draft must share the target's tokenizer")
    limit = getattr(draft, "max_position_embeddings", None)
    if limit is not None and limit < max_model_len:
        raise ValueError(f"speculative_config: the draft model {source!r} takes "
                         f"{limit} positions, fewer than max_model_len {max_model_len}: "
                         f"serve with --max-model-len {limit} or less")
    if _any_window(target) or _any_window(draft):
        raise ValueError("speculative_config: draft models with sliding-window attention "
                         "(in the draft or the target) are not supported yet; use "
                         '{"method": "ngram"} speculation')


def _any_window(hf_config) -> bool:
    return any(layer_sliding_window(hf_config, i) for i in range(hf_config.num_hidden_layers))
