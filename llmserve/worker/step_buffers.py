"""Per-step inputs on a GPU without per-field host-to-device copies.

Two pieces, each behind its own engine flag (off until a GPU run makes them pay):

* ``StagingBuffer`` (``--pinned-staging``): all of a step's integer metadata is packed
  into one host buffer (pinned on CUDA) and moved with one non-blocking copy; the
  fields are views of the device copy. The default path builds each field with its own
  ``torch.tensor(..., device=cuda)``: six synchronous copies of pageable memory a step.
* ``DeviceBlockTables`` (``--device-block-tables``): a persistent
  ``[max_num_seqs, max_blocks_per_seq]`` int32 table on the device, one row per running
  sequence. A step writes only the entries that changed since that row was last
  written (usually one new block of a few sequences, often nothing), and gathers the
  batch's rows, instead of uploading every sequence's whole table every step.

``StepBuilder`` combines them into the model's inputs. Both are plain tensor code with
no CUDA calls except the pinning and the copy event, so they are tested on CPU.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from llmserve.kernels.cpu.attention import make_cpu_plan
from llmserve.model_executor.layers.attention import AttentionMetadata
from llmserve.utils import cdiv
from llmserve.worker.cuda_graphs import DecodeGraphs, default_sizes, uncapturable
from llmserve.worker.step_inputs import StepInputs

log = logging.getLogger(__name__)

_NUMPY = {torch.int64: np.int64, torch.int32: np.int32}
_ALIGN = 8  # every field starts 8-byte aligned, so any int view of the bytes is legal


def _aligned(n: int) -> int:
    return cdiv(n, _ALIGN) * _ALIGN


class StagingBuffer:
    """One host byte buffer and its device twin. ``stage`` packs int lists into the
    host buffer, copies the used prefix once (non-blocking when pinned) and returns
    device views, one per field, in their dtypes."""

    def __init__(self, device: torch.device, capacity: int = 1 << 16):
        self.device = device
        self.pin = device.type == "cuda"  # pinning needs CUDA; a CPU "device" copies plainly
        # Set after each copy on CUDA: the host buffer is rewritten only once the GPU has
        # read it (the step's sampled tokens already sync, so this normally never waits).
        self._copied = torch.cuda.Event() if self.pin else None
        self._allocate(capacity)

    def _allocate(self, capacity: int) -> None:
        self.host = torch.empty(capacity, dtype=torch.uint8, pin_memory=self.pin)
        self._host_np = self.host.numpy()
        self.dev = torch.empty(capacity, dtype=torch.uint8, device=self.device)

    def stage(self, fields: list[tuple[list[int], torch.dtype]]) -> list[torch.Tensor]:
        offsets, end = [], 0
        for values, dtype in fields:
            offsets.append(end)
            end = _aligned(end + len(values) * dtype.itemsize)
        if self._copied is not None:
            self._copied.synchronize()
        if end > self.host.numel():  # a bigger step than any before: grow, rarely
            self._allocate(max(end, 2 * self.host.numel()))
        for (values, dtype), start in zip(fields, offsets):
            n = len(values)
            self._host_np[start:start + n * dtype.itemsize].view(_NUMPY[dtype])[:] = values
        self.dev[:end].copy_(self.host[:end], non_blocking=self.pin)
        if self._copied is not None:
            self._copied.record()
        return [self.dev[start:start + len(values) * dtype.itemsize].view(dtype)
                for (values, dtype), start in zip(fields, offsets)]


class DeviceBlockTables:
    """The block tables of the running sequences, kept on the device.

    A sequence gets a row when it first appears in a step and keeps it while it is in
    every step; a sequence absent from a step (finished, preempted, swapped out, or
    left out by the scheduler) loses its row, and is written afresh if it returns. For
    each row the host remembers what it wrote, so a step sends only the entries from the
    first one that differs (appended blocks, a copy-on-write replacement, a new table).
    Entries past a table's length are stale and never read (the kernels stop at
    ``seq_len``)."""

    def __init__(self, max_rows: int, max_blocks: int, device: torch.device):
        self.max_blocks = max_blocks
        self.table = torch.zeros((max_rows, max_blocks), dtype=torch.int32, device=device)
        self.row_of: dict[int, int] = {}
        self.written: list[list[int]] = [[] for _ in range(max_rows)]
        self.free = list(range(max_rows - 1, -1, -1))

    def plan(self, seq_ids: list[int], tables: list[list[int]]
             ) -> tuple[list[int], list[int], list[int], list[int]]:
        """Rows of this step's sequences and the entries to write: (rows, update rows,
        update columns, update values). Updates the host's record of the rows."""
        live = set(seq_ids)
        for sid in [s for s in self.row_of if s not in live]:
            self.free.append(self.row_of.pop(sid))
        rows, up_rows, up_cols, up_vals = [], [], [], []
        for sid, table in zip(seq_ids, tables):
            if len(table) > self.max_blocks:
                raise ValueError(f"a block table of {len(table)} blocks exceeds the device "
                                 f"table's {self.max_blocks} (max_model_len / block_size)")
            row = self.row_of.get(sid)
            if row is None:
                if not self.free:
                    self._grow()
                row = self.row_of[sid] = self.free.pop()
                self.written[row] = []
            old = self.written[row]
            start = _first_difference(old, table)
            if start < len(table) or len(table) != len(old):
                up_rows += [row] * (len(table) - start)
                up_cols += range(start, len(table))
                up_vals += table[start:]
                self.written[row] = list(table)
            rows.append(row)
        return rows, up_rows, up_cols, up_vals

    def _grow(self) -> None:
        """Twice the rows. Rare: a batch exceeds max_num_seqs only when one request's
        parallel samples do, which the scheduler allows when nothing else runs."""
        old = self.table
        n = old.shape[0]
        self.table = torch.zeros((2 * n, self.max_blocks), dtype=old.dtype, device=old.device)
        self.table[:n] = old
        self.written += [[] for _ in range(n)]
        self.free += range(2 * n - 1, n - 1, -1)

    def apply(self, rows: torch.Tensor, up_rows: torch.Tensor, up_cols: torch.Tensor,
              up_vals: torch.Tensor) -> torch.Tensor:
        """Write the planned entries (device tensors) and return the batch's tables,
        ``[num_seqs, max_blocks]``."""
        if up_rows.numel():
            self.table.index_put_((up_rows, up_cols), up_vals)
        return self.table.index_select(0, rows)


def _first_difference(old: list[int], new: list[int]) -> int:
    """Index of the first entry where ``new`` differs from ``old`` (``len(new)`` if it
    is a prefix of, or equal to, ``old``'s start)."""
    n = len(old)
    if n <= len(new) and new[:n] == old:  # the common cases: unchanged or appended to
        return n
    return next((i for i, (a, b) in enumerate(zip(old, new)) if a != b), min(n, len(new)))


class StepBuilder:
    """The model's inputs for a step, through one staged copy and/or the device block
    tables. Returns what ``ModelRunner.build`` does, plus the sample rows on the
    device."""

    def __init__(self, device: torch.device, block_size: int, num_blocks: int,
                 use_triton: bool, staging: bool, block_tables: DeviceBlockTables | None):
        self.device = device
        self.block_size, self.num_blocks = block_size, num_blocks
        self.use_triton = use_triton
        self.staging = StagingBuffer(device) if staging else None
        self.block_tables = block_tables

    def build(self, inputs: StepInputs, seq_ids: list[int],
              prev_tokens: torch.Tensor | None = None):
        """``prev_tokens``: the previous step's sampled tokens on the device, which
        fill ``inputs.pending_rows`` (async scheduling); their indices travel in the
        same staged copy."""
        fields = [(inputs.input_ids, torch.int64), (inputs.positions, torch.int64),
                  (inputs.slots, torch.int64), (inputs.query_start, torch.int32),
                  (inputs.seq_lens, torch.int32), (inputs.sample_rows, torch.int64),
                  (inputs.pending_rows, torch.int64), (inputs.pending_src, torch.int64)]
        if self.block_tables is not None:
            plan = self.block_tables.plan(seq_ids, inputs.block_tables)
            fields += [(plan[0], torch.int64), (plan[1], torch.int64), (plan[2], torch.int64),
                       (plan[3], torch.int32)]
        else:
            width = max(len(t) for t in inputs.block_tables)
            flat = [b for t in inputs.block_tables for b in t + [0] * (width - len(t))]
            fields.append((flat, torch.int32))
        ids, pos, slots, starts, lens, rows, pending_rows, pending_src, *tables = \
            self._upload(fields)
        if inputs.pending_rows:
            ids[pending_rows] = prev_tokens[pending_src]
        if self.block_tables is not None:
            table_tensor = self.block_tables.apply(*tables)
        else:
            table_tensor = tables[0].view(len(inputs.block_tables), -1)
        meta = AttentionMetadata(slot_mapping=slots, query_start_loc=starts, seq_lens=lens,
                                 block_tables=table_tensor,
                                 max_query_len=inputs.max_query_len,
                                 max_seq_len=max(inputs.seq_lens), use_triton=self.use_triton)
        if not self.use_triton:  # the torch attention path plans on the host, as build() does
            meta.plan = make_cpu_plan(inputs.query_start, inputs.seq_lens, inputs.block_tables,
                                      self.block_size, self.num_blocks,  # never native: CUDA
                                      device=self.device)
        return ids, pos, meta, rows

    def _upload(self, fields):
        if self.staging is not None:
            return self.staging.stage(fields)
        return [torch.tensor(values, dtype=dtype, device=self.device) for values, dtype in fields]


def enable_fast_path(runner, max_model_len: int, *, pinned_staging: bool = False,
                     device_block_tables: bool = False, graph_sizes: list[int] | None = None,
                     capture: bool = True) -> None:
    """Give ``runner`` the GPU fast-path pieces asked for (``runner.step_builder``,
    ``runner.graphs``). The engine calls this with its flags (CUDA only); CPU tests call
    it directly, with ``capture=False`` for the graphs."""
    if pinned_staging or device_block_tables:
        tables = (DeviceBlockTables(runner.config.max_num_seqs,
                                    cdiv(max_model_len, runner.block_size), runner.device)
                  if device_block_tables else None)
        runner.step_builder = StepBuilder(runner.device, runner.block_size, runner.num_blocks,
                                          runner.use_triton, pinned_staging, tables)
    if graph_sizes:
        runner.graphs = DecodeGraphs(runner, graph_sizes, max_model_len, capture)


def enable_fast_path_from_config(runner, max_model_len: int) -> None:
    """``enable_fast_path`` with the engine flags of ``runner.config``. CUDA graphs,
    on by default where the config allows them, stay off for a model whose forward a
    graph cannot record: an error if ``--cuda-graphs`` was asked for, else a log line."""
    c = runner.config
    sizes = None
    if c.use_cuda_graphs:
        reason = uncapturable(runner.model)
        if reason is None:
            sizes = c.cuda_graph_sizes or default_sizes(c.max_num_seqs)
        elif c.cuda_graphs:  # asked for: --cuda-graphs
            raise ValueError(f"--cuda-graphs: {reason}; serve this model with "
                             f"--no-cuda-graphs")
        else:
            log.info("CUDA graphs off: %s", reason)
    enable_fast_path(runner, max_model_len, pinned_staging=c.pinned_staging,
                     device_block_tables=c.device_block_tables, graph_sizes=sizes,
                     capture=runner.device.type == "cuda")
