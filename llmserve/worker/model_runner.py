"""The model runner: serves one rank's model and KV cache (built by ``model_builder.py``),
turning each scheduled batch into device tensors (with step_buffers.py) and running one
forward per step. The scheduler and block manager above it never touch tensors; the
executor above it (``executor/executor.py``) sends the steps to tensor-parallel workers."""

from __future__ import annotations

import logging

import torch

from llmserve.config import EngineConfig
from llmserve.core.block_manager import DROPPED
from llmserve.core.sched.output import ScheduledBatch
from llmserve.kernels.cpu.attention import make_cpu_plan
from llmserve.model_executor.layers.attention import AttentionMetadata, forward_context
from llmserve.model_executor.layers.prompt_logprobs import (
    ROWS_PER_SLICE,
    PromptScores,
    score_rows,
)
from llmserve.model_executor.models.llama import Attention
from llmserve.worker import model_builder
from llmserve.worker.cuda_graphs import DecodeGraphs
from llmserve.worker.kv_sizing import kv_block_bytes
from llmserve.worker.step_buffers import StepBuilder, enable_fast_path_from_config
from llmserve.worker.step_inputs import StepInputs

log = logging.getLogger(__name__)


class ModelRunner:
    """One rank's model and KV cache; every rank runs ``execute`` on the same inputs."""

    def __init__(self, config: EngineConfig, hf_config, model_path, max_model_len: int,
                 rank: int = 0, extra_bytes_per_block: int = 0, reserved_bytes: int = 0,
                 blocks: tuple[int, int] | None = None):
        """``extra_bytes_per_block``: what each KV block also costs elsewhere (a draft
        model's cache of the same blocks), so the budget holds both. ``reserved_bytes``:
        device memory a budget sized from free GPU memory leaves for what loads after
        it (a draft model's weights). ``blocks``: (device, CPU swap) block counts to use
        instead of sizing them (the draft model's runner takes the target's: its cache
        has the same blocks)."""
        load = model_builder.build(model_builder.start(
            config, hf_config, model_path, max_model_len, rank,
            extra_bytes_per_block=extra_bytes_per_block, reserved_bytes=reserved_bytes,
            blocks=blocks))
        self.config, self.hf_config, self.rank = config, hf_config, rank
        self.device, self.dtype, self.shard = load.device, load.dtype, load.shard
        self.block_size, self.reserved_bytes = config.block_size, reserved_bytes
        self.model, self.lora, self.kv_cache = load.model, load.lora, load.kv_cache
        self.use_triton, self.c_attention = load.use_triton, load.c_attention
        self.num_blocks, self.num_cpu_blocks = load.num_blocks, load.kv_cache.num_cpu_blocks
        # The GPU fast path (each piece behind its flag; CUDA graphs on by default on CUDA).
        self.step_builder: StepBuilder | None = None
        self.graphs: DecodeGraphs | None = None
        enable_fast_path_from_config(self, max_model_len)

    def kv_bytes_per_block(self) -> int:
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return kv_block_bytes(self.hf_config, self.block_size, elem, self.shard.num_kv_heads)

    def apply_block_ops(self, batch: ScheduledBatch) -> None:
        """Swap-outs, swap-ins and copy-on-write copies, in the order they were decided."""
        self.kv_cache.apply(batch.block_ops)

    def warm_up_kernels(self, max_model_len: int, max_num_seqs: int) -> None:
        """Compile every Triton attention variant this engine can launch (the split
        counts of split-KV decode depend on batch size and context length, which a
        warm-up request alone cannot cover). Nothing to do on the torch path."""
        if not self.use_triton:
            return
        from llmserve.kernels.triton.attention import warm_up
        c = self.hf_config
        attention = [m for m in self.model.modules() if isinstance(m, Attention)]
        warm_up(num_heads=self.shard.num_heads, num_kv_heads=self.shard.num_kv_heads,
                head_dim=c.head_dim, block_size=self.block_size, dtype=self.dtype,
                device=self.device, max_seq_len=max_model_len, max_num_seqs=max_num_seqs,
                sinks=any(getattr(a, "sinks", None) is not None for a in attention),
                softcap=any(getattr(a, "softcap", None) for a in attention))
        if self.graphs is not None:
            self.graphs.capture_all()

    # --- one step ---------------------------------------------------------------------
    def flatten(self, batch: ScheduledBatch, pending_row_of: dict[int, int] | None = None
                ) -> tuple[StepInputs, list[int]]:
        """The batch as plain lists (what the workers receive), and the indices into
        ``batch.seqs`` of the sequences due a new token (a sequence with a draft of k
        tokens has k + 1 sample rows, in order; the others one). ``pending_row_of`` (async
        scheduling): seq_id -> row of the previous step's tokens, for the sequences
        whose last token is a placeholder."""
        bs = self.block_size
        input_ids, positions, slots = [], [], []
        query_start, seq_lens, sample_rows, due = [0], [], [], []
        tables, prompt_rows, prompt_targets, pending_rows, pending_src = [], [], [], [], []
        prompt_top = 0
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            first_row = query_start[-1] - start
            scored = seq.prompt_logprob_positions(n)
            if scored:
                prompt_rows += [first_row + p for p in scored]
                prompt_targets += [seq.token_ids[p + 1] for p in scored]
                prompt_top = max(prompt_top, seq.params.prompt_logprobs)
            src = pending_row_of.get(seq.seq_id) if pending_row_of else None
            if src is not None and start <= seq.num_tokens - 1 < end:
                pending_rows.append(first_row + seq.num_tokens - 1)
                pending_src.append(src)
            input_ids += seq.token_ids[start:end]
            # A draft (speculative decoding) is computed after the sequence's own tokens.
            draft = seq.spec_token_ids
            input_ids += draft[:max(0, end - seq.num_tokens)]
            positions += range(start, end)
            table = seq.block_table
            if table[0] == DROPPED:  # out of the sliding window: never attended
                table = [0 if b == DROPPED else b for b in table]
            slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
            query_start.append(query_start[-1] + n)
            seq_lens.append(end)
            tables.append(table)
            if end == seq.num_tokens + len(draft):  # all known tokens computed: due a new one
                # (a drafted sequence: one row per draft token too, to verify it)
                sample_rows += range(query_start[-1] - 1 - len(draft), query_start[-1])
                due.append(i)
        inputs = StepInputs(input_ids, positions, slots, query_start, seq_lens, tables,
                            sample_rows, max(batch.num_new_tokens), prompt_rows=prompt_rows,
                            prompt_targets=prompt_targets, prompt_top=prompt_top,
                            pending_rows=pending_rows, pending_src=pending_src)
        if self.lora is not None:
            inputs.lora_slots, inputs.lora_loads = self.lora.assign(
                [seq.request.lora for seq in batch.seqs])
        return inputs, due

    def build(self, inputs: StepInputs):
        """The tensors the model reads, from the flat lists."""
        dev = self.device
        tables = inputs.block_tables
        max_blocks = max(len(t) for t in tables)
        table_tensor = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables],
                                    dtype=torch.int32, device=dev)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(inputs.slots, dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor(inputs.query_start, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(inputs.seq_lens, dtype=torch.int32, device=dev),
            block_tables=table_tensor,
            max_query_len=inputs.max_query_len,
            max_seq_len=max(inputs.seq_lens),
            use_triton=self.use_triton,
        )
        if not self.use_triton:
            meta.plan = make_cpu_plan(inputs.query_start, inputs.seq_lens, tables,
                                      self.block_size, self.num_blocks, self.c_attention,
                                      device=dev)
        ids = torch.tensor(inputs.input_ids, dtype=torch.long, device=dev)
        pos = torch.tensor(inputs.positions, dtype=torch.long, device=dev)
        return ids, pos, meta

    def prepare(self, batch: ScheduledBatch):
        """Flatten the batch into the tensors the model reads (one rank)."""
        inputs, due = self.flatten(batch)
        return (*self.build(inputs), inputs.sample_rows, due)

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata):
        """Hidden states of the batch's tokens (the model, under the step's metadata)."""
        with forward_context(meta):
            return self.model(ids, pos)

    @torch.inference_mode()
    def execute(self, inputs: StepInputs, seq_ids: list[int] | None = None,
                prev_tokens: torch.Tensor | None = None
                ) -> tuple[torch.Tensor | None, PromptScores | None]:
        """This rank's forward of the step: the logits of the rows that sample and the
        scores of the prompt rows (on rank 0; None elsewhere, or when there are no
        such rows). ``seq_ids``: the batch's sequence ids, which the device block
        tables key their rows by. ``prev_tokens``: the previous step's sampled tokens,
        still on the device (async scheduling)."""
        if self.lora is not None:
            self.lora.prepare_step(inputs.lora_slots, inputs.lora_loads, inputs.query_start)
        try:
            return self._execute(inputs, seq_ids, prev_tokens)
        finally:
            if self.lora is not None:
                self.lora.finish_step()

    def _execute(self, inputs: StepInputs, seq_ids: list[int] | None,
                 prev_tokens: torch.Tensor | None
                 ) -> tuple[torch.Tensor | None, PromptScores | None]:
        rows = None
        if self.step_builder is not None:
            ids, pos, meta, rows = self.step_builder.build(inputs, seq_ids, prev_tokens)
        else:
            ids, pos, meta = self.build(inputs)
            if inputs.pending_rows:  # device to device: the host never waits for them
                dev = self.device
                ids[torch.tensor(inputs.pending_rows, device=dev)] = prev_tokens[
                    torch.tensor(inputs.pending_src, device=dev)]
        if inputs.sample_rows and rows is None:
            # Uploaded before the launch: a pageable copy waits for the device's queue,
            # which after the forward would make this call wait for the whole step.
            rows = torch.tensor(inputs.sample_rows, device=self.device)
        # A step with an adapter runs eagerly: the graphs were captured without one.
        adapters = self.lora is not None and self.lora.state.step is not None
        bucket = (self.graphs.bucket(len(inputs.seq_lens), inputs.max_query_len)
                  if self.graphs is not None and not adapters else None)
        if bucket is not None:
            hidden = self.graphs.run(bucket, ids, pos, meta)
        else:
            hidden = self.forward(ids, pos, meta)
        logits = self.model.compute_logits(hidden[rows]) if inputs.sample_rows else None
        return logits, self._score_prompt_rows(hidden, inputs)

    def _score_prompt_rows(self, hidden: torch.Tensor, inputs: StepInputs
                           ) -> PromptScores | None:
        """The prompt rows' scores, a slice of rows at a time (every rank runs the same
        slices: the logits are gathered onto rank 0 by a collective)."""
        parts = []
        for start in range(0, len(inputs.prompt_rows), ROWS_PER_SLICE):
            end = start + ROWS_PER_SLICE
            rows = torch.tensor(inputs.prompt_rows[start:end], device=self.device)
            logits = self.model.compute_logits(hidden[rows])
            if logits is not None:  # rank 0
                targets = torch.tensor(inputs.prompt_targets[start:end], device=self.device)
                parts.append(score_rows(logits, targets, inputs.prompt_top,
                                        self.hf_config.vocab_size))
        return PromptScores.cat(parts) if parts else None

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch,
            pending: tuple[dict[int, int], torch.Tensor] | None = None
            ) -> tuple[torch.Tensor | None, PromptScores | None, list[int]]:
        """Forward the batch once; logits only for rows that sample, and the scores of
        the rows that score prompt tokens (``prompt_rows``). ``pending`` (async
        scheduling): seq_id -> row of the previous step's token tensor, and that tensor.

        Returns (logits ``[num_sampling, vocab]`` or None, the prompt rows' scores or
        None, indices into ``batch.seqs`` of the sequences the sampling rows belong
        to)."""
        row_of, prev_tokens = pending if pending is not None else (None, None)
        inputs, due = self.flatten(batch, row_of)
        seq_ids = [s.seq_id for s in batch.seqs] if self.step_builder is not None else None
        return *self.execute(inputs, seq_ids, prev_tokens), due
