"""The models an engine runs, as one: the target's executor (one process, or rank 0 with
its tensor-parallel workers: executor/executor.py) and a draft model's runner
(speculative decoding), which shares the target's KV blocks. The engine core moves
blocks, runs steps and warms kernels through this, never through a runner of its own
choosing."""

from __future__ import annotations

import weakref

from llmserve.config import EngineConfig
from llmserve.core.sched.output import ScheduledBatch
from llmserve.engine.model_config import ModelConfig
from llmserve.executor.executor import Executor
from llmserve.spec_decode.draft_model import DraftModel


class RunnerGroup:
    def __init__(self, executor: Executor, draft: DraftModel | None):
        self.runner, self.draft = executor, draft
        # Workers stop with the engine, or at exit if it is never shut down.
        self._stop_workers = weakref.finalize(self, executor.shutdown)

    @classmethod
    def build(cls, config: EngineConfig, model: ModelConfig) -> RunnerGroup:
        # A draft model's cache has the target's blocks: the budget sizes them for both.
        draft = (DraftModel(config, model.hf_config, model.max_model_len)
                 if config.speculative is not None and config.speculative.model else None)
        executor = Executor.start(
            config, model.hf_config, model.path, model.max_model_len,
            extra_bytes_per_block=draft.bytes_per_block() if draft else 0,
            reserved_bytes=draft.weight_bytes() if draft else 0)
        if draft is not None:
            draft.build(executor.num_blocks, executor.num_cpu_blocks)
        return cls(executor, draft)

    @property
    def tp_group(self):
        """The tensor-parallel workers (None on one rank)."""
        return self.runner.group

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
        self.runner.check_health()

    def shutdown(self) -> None:
        self._stop_workers()
