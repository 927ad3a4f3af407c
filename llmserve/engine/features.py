"""Which optional features an engine runs, decided once from its configuration, each
plugged into the step as a hook (hooks.py). The engine core calls the hooks; only this
module names the features.

Features that live below the engine layer (speculative decoding, structured outputs,
the KV integrity check) get a small adapter here; the engine's own (P/D transfer,
LoRA) are hooks themselves.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from llmserve.config import EngineConfig
from llmserve.config.lora import parse_lora_modules
from llmserve.core.block_manager import BlockManager
from llmserve.core.request import Request, Sequence, SequenceStatus
from llmserve.engine.disagg import KVTransferSide
from llmserve.engine.hooks import Hooks, StepHook
from llmserve.engine.lora_registry import LoRARegistry
from llmserve.engine.model_config import ModelConfig
from llmserve.engine.runners import RunnerGroup
from llmserve.spec_decode.speculator import Speculator
from llmserve.structured_output.grammar import StructuredOutputs
from llmserve.worker.kv_integrity import SequenceKVCheck


@dataclass
class Features:
    kv_transfer: KVTransferSide | None  # P/D: leases (prefill role), imports (decode)
    loras: LoRARegistry | None  # multi-LoRA: the adapters by name
    speculation: SpeculationHook | None
    structured: StructuredOutputsHook  # always there: any request may ask for a grammar
    kv_check: KVCheckHook | None  # debug: KV contents hashed across moves
    hooks: Hooks

    @classmethod
    def build(cls, config: EngineConfig, model: ModelConfig, runners: RunnerGroup,
              block_manager: BlockManager, sampler, requests: dict[str, Request]) -> Features:
        runner = runners.runner
        kv_transfer = (KVTransferSide(config, model.name, model.hf_config,
                                      runner.shard.num_kv_heads, block_manager, requests)
                       if config.kv_role != "both" else None)
        loras = None
        if config.enable_lora:
            loras = LoRARegistry(model.hf_config, config.max_lora_rank, runner.lora,
                                 model.name, requests)
            for name, source in parse_lora_modules(config.lora_modules or []):
                loras.register(name, source, loras.parse(source))
        speculation = (SpeculationHook(Speculator(config.speculative, model.max_model_len,
                                                  runners.draft, sampler))
                       if config.speculative is not None else None)
        structured = StructuredOutputsHook(model, precompute=not config.async_scheduling)
        kv_check = (KVCheckHook(SequenceKVCheck(runner.kv_cache, config.block_size))
                    if config.check_kv_integrity else None)
        # Order: none of these reads what another did at the same point.
        hooks = [h for h in (kv_transfer, loras, speculation, structured, kv_check) if h]
        return cls(kv_transfer, loras, speculation, structured, kv_check, Hooks(hooks))

    def shutdown(self) -> None:
        self.structured.shutdown()


class SpeculationHook(StepHook):
    """Drafts are proposed before scheduling (so the scheduler fits them), a draft
    model's filled in once their slots are reserved, and verified by the core."""

    def __init__(self, speculator: Speculator):
        self.speculator = speculator

    def before_schedule(self, running):
        self.speculator.propose(running)

    def after_schedule(self, batch):
        if batch.seqs:  # a draft model's tokens, into the slots just reserved
            self.speculator.fill(batch)

    def verified(self, seq, num_draft, num_accepted, num_computed):
        self.speculator.record(seq, num_draft, num_accepted)
        if self.speculator.draft is not None:
            self.speculator.draft.verified(seq, num_computed)

    def after_step(self, batch, seconds):
        self.speculator.observe_step(seconds)

    def reset_counters(self):
        self.speculator.reset()


class StructuredOutputsHook(StepHook):
    """A constrained request's sequences each carry a matcher; their masks are computed
    on a worker thread while the model runs (``precompute``; not under async
    scheduling, where the matcher has not yet consumed the token in flight), and each
    sampled token is consumed."""

    def __init__(self, model: ModelConfig, precompute: bool):
        self.model = model
        self.precompute = precompute
        self._outputs: StructuredOutputs | None = None
        self._lock = threading.Lock()
        self._pending = None  # this step's masks, computing

    def outputs(self) -> StructuredOutputs:
        """The grammar compiler and mask worker, built on first use (wrapping the
        tokenizer for llguidance takes about a second); safe from any thread."""
        with self._lock:
            if self._outputs is None:
                self._outputs = StructuredOutputs(self.model.tokenizer, self.model.vocab_size,
                                                  self.model.eos_token_ids)
            return self._outputs

    def add_request(self, req: Request) -> None:
        spec = req.params.structured_outputs
        if spec is not None:  # GrammarError is a ValueError
            for seq in req.sequences:  # each parallel sample has its own parser state
                seq.matcher = self.outputs().matcher(spec)

    def after_schedule(self, batch):
        self._pending = None
        if not self.precompute:
            return
        due = [s for s, n in zip(batch.seqs, batch.num_new_tokens)
               if s.matcher is not None and s.num_computed_tokens + n >= s.num_tokens]
        if due:
            self._pending = self.outputs().start_masks(due)

    def token_masks(self, seqs):
        constrained = [s for s in seqs if s.matcher is not None]
        return self.outputs().masks(constrained, self._pending) if constrained else None

    def accept_token(self, seq: Sequence, token: int) -> SequenceStatus | None:
        # The mask only offered tokens the grammar allows; a refusal means the parser
        # hit a resource limit. Either way, nothing more may follow.
        if seq.matcher is not None and (not seq.matcher.consume_token(token)
                                        or seq.matcher.is_stopped()):
            return SequenceStatus.FINISHED_STOPPED
        return None

    def shutdown(self) -> None:
        if self._outputs is not None:
            self._outputs.shutdown()


class KVCheckHook(StepHook):
    def __init__(self, check: SequenceKVCheck):
        self.check = check

    def after_schedule(self, batch):
        self.check.before_forward(batch)

    def after_forward(self, batch):
        self.check.after_forward(batch)

    def forked(self, parent, child):
        self.check.forked(parent, child)
