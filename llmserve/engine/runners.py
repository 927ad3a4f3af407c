"""The models an engine runs, as one: the target's runner (with its tensor-parallel
workers, if any) and a draft model's runner (speculative decoding), which shares the
target's KV blocks. The engine core moves blocks, runs steps and warms kernels through
this, never through a runner of its own choosing."""

from __future__ import annotations

import weakref

from llmserve.config import EngineConfig
from llmserve.core.sched.output import ScheduledBatch
from llmserve.engine.model_config import ModelConfig
from llmserve.executor.tensor_parallel import TensorParallelGroup, WorkerDiedError
from llmserve.spec_decode.draft_model import DraftModel
from llmserve.worker.model_runner import ModelRunner


class RunnerGroup:
    def __init__(self, runner: ModelRunner, tp_group: TensorParallelGroup | None,
                 draft: DraftModel | None):
        self.runner, self.tp_group, self.draft = runner, tp_group, draft
        # Workers stop with the engine, or at exit if it is never shut down.
        self._stop_workers = (weakref.finalize(self, tp_group.shutdown)
                              if tp_group is not None else None)

    @classmethod
    def build(cls, config: EngineConfig, model: ModelConfig) -> RunnerGroup:
        tp_group = None
        if config.tensor_parallel_size > 1:
            tp_group = TensorParallelGroup(config, model.hf_config, model.path,
                                           model.max_model_len)
        # A draft model's cache has the target's blocks: the budget sizes them for both.
        draft = (DraftModel(config, model.hf_config, model.max_model_len)
                 if config.speculative is not None and config.speculative.model else None)
        runner = _target_runner(config, model, tp_group, draft)
        if draft is not None:
            draft.build(runner.num_blocks, runner.num_cpu_blocks)
        return cls(runner, tp_group, draft)

    @property
    def num_blocks(self) -> int:
        return self.runner.num_blocks

    @property
    def num_cpu_blocks(self) -> int:
        return self.runner.num_cpu_blocks

    def run(self, batch: ScheduledBatch, pending=None):
        return self.runner.run(batch, pending)

    def apply_block_ops(self, batch: ScheduledBatch) -> None:
        self.runner.apply_block_ops(batch)
        if self.draft is not None:
            self.draft.apply_block_ops(batch)

    def flush_block_ops(self) -> None:
        self.runner.flush_block_ops()

    def warm_up_kernels(self, max_model_len: int, max_num_seqs: int) -> None:
        self.runner.warm_up_kernels(max_model_len, max_num_seqs)
        if self.draft is not None:
            self.draft.runner.warm_up_kernels(max_model_len, max_num_seqs)

    def check_health(self) -> None:
        """Raises WorkerDiedError once a tensor-parallel worker has died."""
        if self.tp_group is not None:
            self.tp_group.check()

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (nothing to do on one rank)."""
        if self.tp_group is not None:
            self._stop_workers()
            self.tp_group = None


def _target_runner(config: EngineConfig, model: ModelConfig, tp_group, draft) -> ModelRunner:
    """Rank 0's model runner; with tensor parallelism, once every worker built its."""
    if tp_group is None:
        return ModelRunner(config, model.hf_config, model.path, model.max_model_len,
                           extra_bytes_per_block=draft.bytes_per_block() if draft else 0,
                           reserved_bytes=draft.weight_bytes() if draft else 0)
    try:
        runner = ModelRunner(config, model.hf_config, model.path, model.max_model_len,
                             group=tp_group)
        tp_group.wait_ready()
        return runner
    except BaseException as e:
        # A worker that failed to load makes rank 0's collectives fail: its own
        # message says why.
        worker_error = tp_group.worker_errors()
        tp_group.shutdown()
        if worker_error:
            raise WorkerDiedError(worker_error) from e
        raise
