"""The engine's model runner: rank 0's ``ModelRunner``, which with tensor parallelism
also drives the worker ranks (``tensor_parallel.py``), each a plain ``ModelRunner``.

On one rank a step is the runner's own. With several, rank 0 sends each worker every
step's block moves (in decision order, so every rank's cache holds the same blocks)
with the step's flat batch, once, pickled, then every rank runs its shard's forward and
the collectives inside the layers meet. A step with block moves and nothing to run
sends the moves alone (``flush_block_ops``).
"""

from __future__ import annotations

import torch

from llmserve.core.sched.output import ScheduledBatch
from llmserve.executor.tensor_parallel import TensorParallelGroup, WorkerDiedError
from llmserve.model_executor.layers.prompt_logprobs import PromptScores
from llmserve.worker.model_runner import ModelRunner


class Executor(ModelRunner):
    """Rank 0's runner, and the workers' group where there are several ranks (``group``:
    None on one)."""

    def __init__(self, config, hf_config, model_path, max_model_len: int,
                 group: TensorParallelGroup | None = None, **sizing):
        super().__init__(config, hf_config, model_path, max_model_len, **sizing)
        self.group = group
        self._pending_ops = []  # block moves the workers have not been sent yet

    @classmethod
    def start(cls, config, hf_config, model_path, max_model_len: int,
              extra_bytes_per_block: int = 0, reserved_bytes: int = 0) -> Executor:
        """One process, or rank 0 with its workers started first (they load their shards
        while rank 0 loads its own) and ready when this returns. A worker that failed to
        load makes rank 0's collectives fail: its own message is raised then."""
        sizing = dict(extra_bytes_per_block=extra_bytes_per_block,
                      reserved_bytes=reserved_bytes)
        if config.tensor_parallel_size == 1:
            return cls(config, hf_config, model_path, max_model_len, **sizing)
        group = TensorParallelGroup(config, hf_config, model_path, max_model_len)
        try:
            executor = cls(config, hf_config, model_path, max_model_len, group=group, **sizing)
            group.wait_ready()
            return executor
        except BaseException as e:
            worker_error = group.worker_errors()
            group.shutdown()
            if worker_error:
                raise WorkerDiedError(worker_error) from e
            raise

    def apply_block_ops(self, batch: ScheduledBatch) -> None:
        """The step's block moves here; the workers get them with the step (``run``) or
        ``flush_block_ops``."""
        super().apply_block_ops(batch)
        if self.group is not None:
            self._pending_ops += batch.block_ops

    def flush_block_ops(self) -> None:
        """A step with block moves and nothing to run: the workers apply the moves now."""
        if self.group is not None and self._pending_ops:
            self.group.send(("step", self._pending_ops, None))
            self._pending_ops = []

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch,
            pending: tuple[dict[int, int], torch.Tensor] | None = None
            ) -> tuple[torch.Tensor | None, PromptScores | None, list[int]]:
        """``ModelRunner.run`` on every rank: the workers get the step's block moves and
        flat batch first."""
        if self.group is None:
            return super().run(batch, pending)
        assert pending is None, "async scheduling runs on one rank"
        inputs, due = self.flatten(batch)
        self.group.send(("step", self._pending_ops, inputs))
        self._pending_ops = []
        try:
            return *self.execute(inputs), due
        except RuntimeError as e:  # a collective failed: a dead worker is the likely cause
            blamed = self.group.blame(e)
            if blamed is e:
                raise
            raise blamed from e

    def warm_up_kernels(self, max_model_len: int, max_num_seqs: int) -> None:
        if self.use_triton and self.group is not None:
            self.group.send(("warm_up", max_model_len, max_num_seqs))
        super().warm_up_kernels(max_model_len, max_num_seqs)

    def check_health(self) -> None:
        """Raises WorkerDiedError once a tensor-parallel worker has died."""
        if self.group is not None:
            self.group.check()

    def shutdown(self) -> None:
        """Stop the workers (nothing to do on one rank)."""
        if self.group is not None:
            self.group.shutdown()
            self.group = None
