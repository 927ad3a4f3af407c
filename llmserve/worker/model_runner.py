"""The model runner: builds the model and its KV cache on the device, turns each
scheduled batch into device tensors (with step_buffers.py) and runs one forward per step.
The scheduler and block manager above it never touch tensors."""

from __future__ import annotations

import logging

import torch

from llmserve.config import EngineConfig
from llmserve.core.block_manager import DROPPED
from llmserve.core.sched.output import ScheduledBatch
from llmserve.distributed.shapes import rank_shape
from llmserve.kernels.cpu.attention import make_cpu_plan
from llmserve.kernels.cpu.gemm import packing_applies
from llmserve.kernels.cpu.native import DTYPE_CODES, cpu_library
from llmserve.model_executor.layers.attention import AttentionMetadata, forward_context
from llmserve.model_executor.layers.backends import backends_for, bind_backends
from llmserve.model_executor.layers.cpu_linear import pack_linears
from llmserve.model_executor.layers.fused_moe.layer import SparseMoeBlock
from llmserve.model_executor.layers.prompt_logprobs import (
    ROWS_PER_SLICE,
    PromptScores,
    score_rows,
)
from llmserve.model_executor.layers.q8_embedding import compact_embedding
from llmserve.model_executor.layers.quantization import quantize_model
from llmserve.model_executor.lora.slots import LoRASlots
from llmserve.model_executor.model_loader.weights import (
    checkpoint_slice,
    empty_model_init,
    load_weights,
)
from llmserve.model_executor.models.llama import Attention, RotaryEmbedding
from llmserve.model_executor.models.native_decoder import NativeDecoder
from llmserve.model_executor.models.registry import SUPPORTED_ARCHITECTURES
from llmserve.platforms.memory import huge_pages_wanted
from llmserve.worker.cuda_graphs import DecodeGraphs
from llmserve.worker.kv_cache import KVCache
from llmserve.worker.kv_sizing import kv_block_bytes, profile_kv_budget
from llmserve.worker.step_buffers import StepBuilder, enable_fast_path_from_config
from llmserve.worker.step_inputs import StepInputs
from llmserve.worker.weight_arena import pack_weights

log = logging.getLogger(__name__)

DEFAULT_CPU_KV_BYTES = 1 << 30


class ModelRunner:
    """One rank's model and KV cache. With tensor parallelism (``group`` on rank 0,
    ``rank`` > 0 in a worker) rank 0 sends each step's block moves and flat batch to the
    workers (``executor.tensor_parallel.TensorParallelGroup``) and every rank runs ``execute``."""

    def __init__(self, config: EngineConfig, hf_config, model_path, max_model_len: int,
                 rank: int = 0, group=None, extra_bytes_per_block: int = 0,
                 reserved_bytes: int = 0, blocks: tuple[int, int] | None = None):
        """``extra_bytes_per_block``: what each KV block also costs elsewhere (a draft
        model's cache of the same blocks), so the budget holds both. ``reserved_bytes``:
        device memory a budget sized from free GPU memory leaves for what loads after
        it (a draft model's weights). ``blocks``: (device, CPU swap) block counts to use
        instead of sizing them (the draft model's runner takes the target's: its cache
        has the same blocks)."""
        self.config = config
        self.extra_bytes_per_block = extra_bytes_per_block
        self.reserved_bytes = reserved_bytes
        self.rank, self.group = rank, group
        tp = config.tensor_parallel_size
        self.device = torch.device(f"cuda:{rank}" if config.device == "cuda" and tp > 1
                                   else config.device)
        self.dtype = config.torch_dtype
        if self.device.type == "cpu":
            # The engine's threads, shared among its ranks.
            torch.set_num_threads(max(1, config.num_threads // tp))
        if getattr(hf_config, "head_dim", None) is None:
            hf_config.head_dim = hf_config.hidden_size // hf_config.num_attention_heads
        self.shard = rank_shape(hf_config, rank, tp)
        self._pending_ops = []  # rank 0: block moves the workers have not been sent yet
        arch = next(a for a in hf_config.architectures if a in SUPPORTED_ARCHITECTURES)
        with empty_model_init():
            model = SUPPORTED_ARCHITECTURES[arch](hf_config, max_model_len,
                                                  self.shard).to(self.dtype)
        # Built on the meta device (no random init of 100M+ parameters), then
        # materialised empty in the serving dtype (never an fp32 copy first: that would
        # double the peak memory of a bf16 model on a GPU) and filled from the checkpoint.
        model.to_empty(device=self.device)
        model.tie_weights()
        load_weights(model, model_path, self.dtype, str(self.device))
        # cos/sin tables were on meta too; they stay fp32 whatever the weights are.
        model.model.rotary = RotaryEmbedding(hf_config, max_model_len).to(self.device)
        model.fuse()
        quantize_model(model, config.quantization)
        if packing_applies(self.device, self.dtype) and not config.compile:
            pack_linears(model)  # the dense ones: oneDNN's layout once, not every call
        if self.device.type == "cpu" and self.shard.size == 1:
            # A Q8_0 embedding (GGUF) kept as its int8 blocks: the same rows, half the memory.
            compact_embedding(model, checkpoint_slice(model, model_path,
                                                      "model.embed_tokens.weight"))
        self.model = model.eval()
        if self.device.type == "cpu" and huge_pages_wanted():
            # The weights onto 2 MB pages: before anything keeps pointers into them (the
            # LoRA slots, the native decoder).
            pack_weights(self.model)
        self.hf_config = hf_config
        self.block_size = config.block_size
        self.use_triton = self._want_triton()
        # Each norm, attention and MLP takes its implementation, once.
        bind_backends(self.model, backends_for(self.device, self.dtype, config.fused_kernels,
                                               self.use_triton))
        if self.use_triton:  # a MoE layer's experts in one grouped launch, as attention
            for module in self.model.modules():
                if isinstance(module, SparseMoeBlock):
                    module.use_triton_kernel()
        self.c_attention = self._want_c_attention()
        # Multi-LoRA: the packed or quantised projections wrapped, their adapter slots
        # allocated before the KV cache takes what memory is left (the native decoder
        # computes the wrapped projections and steps aside when an adapter runs).
        self.lora = (LoRASlots(self.model, hf_config, self.shard, config, self.use_triton)
                     if config.enable_lora else None)
        self.num_blocks, num_swap_blocks = blocks or (self._num_kv_blocks(),
                                                      self._num_swap_blocks())
        c = hf_config
        self.kv_cache = KVCache(c.num_hidden_layers, self.num_blocks, self.block_size,
                                self.shard.num_kv_heads, c.head_dim, self.dtype, self.device,
                                num_swap_blocks, config.check_kv_integrity)
        self.num_cpu_blocks = self.kv_cache.num_cpu_blocks
        self.model.bind_kv_cache(self.kv_cache.storage)
        if config.compile:
            self.model.model.compile_layers()
        elif self.c_attention:  # after the cache is bound: it keeps pointers into it
            self.model.model.native_decoder = NativeDecoder.try_build(self.model)
        if self.lora is not None and self.model.model.native_decoder is not None:
            self.model.model.native_decoder.lora_state = self.lora.state
        # The GPU fast path (each piece behind its flag; CUDA graphs on by default on CUDA).
        self.step_builder: StepBuilder | None = None
        self.graphs: DecodeGraphs | None = None
        enable_fast_path_from_config(self, max_model_len)

    # --- KV cache -----------------------------------------------------------------
    def kv_bytes_per_block(self) -> int:
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return kv_block_bytes(self.hf_config, self.block_size, elem, self.shard.num_kv_heads)

    def _num_kv_blocks(self) -> int:
        budget = self.config.kv_cache_memory
        if budget is None:
            if self.device.type == "cuda" and self.config.profile_kv_cache:
                budget = profile_kv_budget(self, self.config.max_num_batched_tokens,
                                           self.config.max_num_seqs) - self.reserved_bytes
            elif self.device.type == "cuda":
                free, total = torch.cuda.mem_get_info(self.device)
                budget = int(free - total * (1 - self.config.gpu_memory_utilization)
                             - self.reserved_bytes)
            else:
                budget = DEFAULT_CPU_KV_BYTES
        num = budget // (self.kv_bytes_per_block() + self.extra_bytes_per_block)
        if self.shard.size > 1:  # every rank's cache has the same blocks: the smallest
            t = torch.tensor([num], dtype=torch.int64,
                             device=self.device if self.device.type == "cuda" else "cpu")
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN)
            num = int(t.item())
        if num < 1:
            left = (f", after {self.reserved_bytes} bytes left for a draft model's weights"
                    if self.reserved_bytes and self.config.kv_cache_memory is None
                    and self.device.type == "cuda" else "")
            raise ValueError(f"kv_cache_memory={budget} bytes holds no KV block "
                             f"(one block takes {self.kv_bytes_per_block()} bytes{left})")
        return int(num)

    def _num_swap_blocks(self) -> int:
        if self.config.preemption_mode != "swap":
            return 0
        return int(self.config.swap_space
                   // (self.kv_bytes_per_block() + self.extra_bytes_per_block))

    def apply_block_ops(self, batch: ScheduledBatch) -> None:
        """Swap-outs, swap-ins and copy-on-write copies, in the order they were decided.
        The workers get them with the step's batch (``run``) or ``flush_block_ops``."""
        self.kv_cache.apply(batch.block_ops)
        if self.group is not None:
            self._pending_ops += batch.block_ops

    def flush_block_ops(self) -> None:
        """A step with block moves and nothing to run: the workers apply the moves now."""
        if self.group is not None and self._pending_ops:
            self.group.send(("step", self._pending_ops, None))
            self._pending_ops = []

    def warm_up_kernels(self, max_model_len: int, max_num_seqs: int) -> None:
        """Compile every Triton attention variant this engine can launch (the split
        counts of split-KV decode depend on batch size and context length, which a
        warm-up request alone cannot cover). Nothing to do on the torch path."""
        if not self.use_triton:
            return
        if self.group is not None:
            self.group.send(("warm_up", max_model_len, max_num_seqs))
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

    def _want_triton(self) -> bool:
        if not self.config.uses_triton:
            return False
        from llmserve.kernels.triton.attention import check_supported
        c = self.hf_config
        check_supported(block_size=self.block_size, head_dim=c.head_dim,
                        num_heads=self.shard.num_heads, num_kv_heads=self.shard.num_kv_heads,
                        dtype=self.dtype)
        return True

    def _want_c_attention(self) -> bool:
        """Decodes and short prefills attend in the C kernel: on CPUs, for the dtypes it
        knows, when it builds (at start-up, so no request waits for the compiler)."""
        if self.device.type != "cpu" or self.use_triton or self.dtype not in DTYPE_CODES:
            return False
        return cpu_library() is not None

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
        """Forward the batch once (on every rank); logits only for rows that sample,
        and the scores of the rows that score prompt tokens (``prompt_rows``).
        ``pending`` (async scheduling, one rank): seq_id -> row of the previous step's
        token tensor, and that tensor.

        Returns (logits ``[num_sampling, vocab]`` or None, the prompt rows' scores or
        None, indices into ``batch.seqs`` of the sequences the sampling rows belong
        to)."""
        row_of, prev_tokens = pending if pending is not None else (None, None)
        inputs, due = self.flatten(batch, row_of)
        if self.group is None:
            seq_ids = [s.seq_id for s in batch.seqs] if self.step_builder is not None else None
            return *self.execute(inputs, seq_ids, prev_tokens), due
        assert pending is None, "async scheduling runs on one rank"
        self.group.send(("step", self._pending_ops, inputs))
        self._pending_ops = []
        try:
            return *self.execute(inputs), due
        except RuntimeError as e:  # a collective failed: a dead worker is the likely cause
            blamed = self.group.blame(e)
            if blamed is e:
                raise
            raise blamed from e
