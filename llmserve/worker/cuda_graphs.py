"""CUDA graphs for decode steps (``--cuda-graphs``: on by default on CUDA where they
apply, ``--no-cuda-graphs`` to run eagerly).

A decode step of a small model on a GPU is mostly kernel-launch time: ~10 launches a
layer, each a few microseconds of Python and driver work for a few microseconds of GPU
work. A CUDA graph records the launches of one forward once and replays them with one
call. A graph replays fixed addresses and shapes, so:

* **Buckets.** One graph per batch size in ``sizes`` (by default 1, 2, 4, then
  multiples of 8 up to ``max_num_seqs``); a step of ``n`` single-token queries runs in
  the smallest bucket >= n. Steps with a longer query (prefill chunks) or more
  sequences than the largest bucket run eagerly, as before.
* **Static, padded inputs.** The graphs read one set of buffers sized for the largest
  bucket (input ids, positions, slot mapping, sequence lengths, query starts, block
  tables); a step copies its inputs into their first ``n`` rows. Padding rows are
  one-token sequences of length 1 whose slot is -1 (the KV write skips it) and whose
  block table row is block 0 (read, never written): their outputs are finite and
  dropped, and logits are computed only for the step's real sampling rows, outside
  the graph.
* **A fixed split count per bucket.** The split-KV decode count is normally chosen
  from the step's longest context; a captured launch cannot change it, so each bucket
  uses the count chosen for ``max_model_len`` (splits past a short context are empty
  and ignored by the merge), which is valid for every context length.

With ``capture=False`` the same static, padded path runs eagerly ("replay without
graphs"): that is how CPU tests check it under the Triton interpreter.
"""

from __future__ import annotations

import bisect

import torch

from llmserve.model_executor.layers.attention import AttentionMetadata
from llmserve.utils import cdiv


def uncapturable(model: torch.nn.Module) -> str | None:
    """Why a graph cannot record ``model``'s forward, or None. A capture forbids host
    syncs: a mixture-of-experts layer that loops over its experts on the host (reading
    their token counts back each step) cannot be recorded; the grouped Triton kernel
    (``fused_moe``), which routes on the device, can."""
    from llmserve.model_executor.layers.fused_moe.layer import SparseMoeBlock
    for module in model.modules():
        if isinstance(module, SparseMoeBlock) and module.w13 is None:
            return (f"{type(module).__name__} computes its experts in a loop on the host "
                    f"(a host sync a layer, which a capture forbids)")
    return None


def default_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, 16, 24, ... (multiples of 8, as vLLM) up to and including
    ``max_num_seqs``."""
    sizes = {n for n in (1, 2, 4) if n <= max_num_seqs}
    sizes |= set(range(8, max_num_seqs + 1, 8))
    sizes.add(max_num_seqs)
    return sorted(sizes)


class DecodeGraphs:
    """Captures and replays ``runner.forward`` for decode-only steps of the bucket sizes."""

    def __init__(self, runner, sizes: list[int], max_model_len: int, capture: bool):
        self.runner = runner
        self.sizes = sorted(set(sizes))
        self.capture = capture
        dev, top = runner.device, self.sizes[-1]
        block_size = runner.block_size
        max_blocks = cdiv(max_model_len, block_size)
        self.input_ids = torch.zeros(top, dtype=torch.long, device=dev)
        self.positions = torch.zeros(top, dtype=torch.long, device=dev)
        self.slots = torch.full((top,), -1, dtype=torch.long, device=dev)
        self.seq_lens = torch.ones(top, dtype=torch.int32, device=dev)
        # One query per row, always: the query starts never change.
        self.query_start = torch.arange(top + 1, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros((top, max_blocks), dtype=torch.int32, device=dev)
        from llmserve.kernels.triton.attention import _choose_splits  # needs triton
        kv_heads = runner.shard.num_kv_heads
        self.splits = {b: _choose_splits(b, kv_heads, max_model_len, block_size)
                       for b in self.sizes}
        self.max_model_len = max_model_len
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # hidden states each graph writes
        self.pool = None

    def bucket(self, num_seqs: int, max_query_len: int) -> int | None:
        """The bucket of a step, or None when it runs eagerly."""
        if max_query_len != 1 or num_seqs > self.sizes[-1]:
            return None
        return self.sizes[bisect.bisect_left(self.sizes, num_seqs)]

    def metadata(self, b: int) -> AttentionMetadata:
        """The static buffers' first ``b`` rows as attention metadata."""
        return AttentionMetadata(
            slot_mapping=self.slots[:b], query_start_loc=self.query_start[:b + 1],
            seq_lens=self.seq_lens[:b], block_tables=self.block_tables[:b],
            max_query_len=1, max_seq_len=self.max_model_len, use_triton=True,
            num_splits=self.splits[b])

    def run(self, b: int, ids: torch.Tensor, pos: torch.Tensor,
            meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states of the step's ``n`` tokens (``ids``/``pos``/``meta`` as the
        eager path builds them, on the device), computed in bucket ``b``."""
        n = ids.shape[0]
        if self.capture and b not in self.graphs:
            self._capture(b)  # before the fill: a capture resets every row to padding
        self._fill(b, n, ids, pos, meta)
        if not self.capture:
            return self.runner.forward(self.input_ids[:b], self.positions[:b],
                                       self.metadata(b))[:n]
        self.graphs[b].replay()
        return self.outputs[b][:n]

    def _fill(self, b: int, n: int, ids, pos, meta) -> None:
        """Copy the step into the static rows and reset the padding rows ``n..b``
        (device-to-device copies: no host sync)."""
        self.input_ids[:n].copy_(ids)
        self.positions[:n].copy_(pos)
        self.slots[:n].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens)
        width = meta.block_tables.shape[1]
        self.block_tables[:n, :width].copy_(meta.block_tables)
        self._pad(n, b)

    def _pad(self, n: int, b: int) -> None:
        if b > n:
            self.input_ids[n:b].zero_()
            self.positions[n:b].zero_()
            self.slots[n:b].fill_(-1)  # padding writes no KV
            self.seq_lens[n:b].fill_(1)
            self.block_tables[n:b, 0].zero_()  # reads key 0 of block 0: finite, unused

    def capture_all(self) -> None:
        """Capture every bucket now (start-up), largest first so the smaller graphs
        reuse its memory pool."""
        if self.capture:
            for b in reversed(self.sizes):
                if b not in self.graphs:
                    self._capture(b)

    @torch.inference_mode()
    def _capture(self, b: int) -> None:
        # The padding state in every row: a capture must not write the KV cache.
        self._pad(0, b)
        meta = self.metadata(b)
        # Eager run first: Triton compiles its kernels outside the capture.
        self.runner.forward(self.input_ids[:b], self.positions[:b], meta)
        torch.cuda.synchronize(self.runner.device)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.outputs[b] = self.runner.forward(self.input_ids[:b], self.positions[:b],
                                                  meta)
        self.graphs[b] = graph
