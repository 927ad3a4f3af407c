"""One rank's adapter slots: the model's projections wrapped in ``LoRALinear``, which
adapter sits in which of the ``max_loras`` slots, and a host-memory cache of parsed
adapters (``max_cpu_loras``, least recently used dropped first).

Rank 0 decides each step's slots (``assign``): an adapter already in a slot stays
there; a new one takes a free slot, or the least recently used slot no sequence of the
step needs (the scheduler admits at most ``max_loras`` distinct adapters, so one always
exists). The loads it decides travel to the other ranks with the step, so every rank's
slots hold the same adapters.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from llmserve.core.lora_request import LoRARequest
from llmserve.distributed.shapes import RankShape
from llmserve.kernels.cpu.lora import CPULoRAPlan
from llmserve.model_executor.lora.adapter import (
    FUSED_SLICES,
    LoRAAdapter,
    module_shapes,
    shard_weights,
)
from llmserve.model_executor.lora.layers import LoRALinear, LoRAState, LoRAStep

# model_type -> why its projections cannot take LoRA yet.
UNSUPPORTED_MODELS = {
    "phi3": "Phi-3 checkpoints fuse qkv_proj/gate_up_proj and reorder the rotary dims",
}


class AdapterCache:
    """Parsed, checked adapters by ``lora_int_id``: at most ``capacity`` of them, least
    recently used dropped first, but never one a live request uses (``in_use``, set by
    the engine): a step never has to read an adapter from its source, so a source that
    vanished or a Hub that moved on cannot fail a step."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.in_use = set  # () -> the lora_int_ids live requests hold
        self._items: OrderedDict[int, LoRAAdapter] = OrderedDict()

    def get(self, int_id: int) -> LoRAAdapter | None:
        adapter = self._items.get(int_id)
        if adapter is not None:
            self._items.move_to_end(int_id)
        return adapter

    def put(self, int_id: int, adapter: LoRAAdapter) -> None:
        self._items[int_id] = adapter
        self._items.move_to_end(int_id)
        if len(self._items) > self.capacity:
            keep = self.in_use() | {int_id}
            for old in [i for i in self._items if i not in keep]:
                if len(self._items) <= self.capacity:
                    break
                del self._items[old]

    def drop(self, int_id: int) -> None:
        self._items.pop(int_id, None)

    def __len__(self) -> int:
        return len(self._items)


class LoRASlots:
    def __init__(self, model, hf_config, shard: RankShape, config, use_triton: bool):
        why = UNSUPPORTED_MODELS.get(hf_config.model_type)
        if why:
            raise ValueError(f"--enable-lora is not supported for {hf_config.model_type} "
                             f"models yet: {why}")
        self.hf_config, self.shard = hf_config, shard
        self.num_slots, self.max_rank = config.max_loras, config.max_lora_rank
        self.state = LoRAState(use_triton)
        self.cache = AdapterCache(config.max_cpu_loras)
        self.layers = wrap_model(model, shard, self.num_slots, self.max_rank, self.state)
        self.slot_of: dict[int, int] = {}  # lora_int_id -> slot
        self.lru: OrderedDict[int, None] = OrderedDict()  # slots, least recently used first
        self.rank_of_slot = [0] * self.num_slots
        self.device = next(iter(self.layers.values())).a.device

    # --- rank 0: this step's slots --------------------------------------------------------
    def assign(self, loras: list[LoRARequest | None]) -> tuple[list[int], list[tuple]]:
        """Each sequence's slot (-1: none), and the loads that needs: (slot, adapter id,
        parsed adapter), which travel to the other ranks with the step (so no rank reads
        an adapter from its source during a step)."""
        needed = {lora.lora_int_id for lora in loras if lora is not None}
        if len(needed) > self.num_slots:  # the scheduler's max_loras rule prevents it
            raise RuntimeError(f"{len(needed)} adapters in one step, {self.num_slots} slots")
        loads = []
        for lora in loras:
            if lora is None or lora.lora_int_id in self.slot_of:
                continue
            adapter = self.cache.get(lora.lora_int_id)
            if adapter is None:  # the engine keeps a live request's adapter cached
                raise RuntimeError(f"adapter {lora.lora_name!r} (id {lora.lora_int_id}) "
                                   f"is not in host memory")
            slot = self._free_slot(needed)
            self.slot_of = {i: s for i, s in self.slot_of.items() if s != slot}
            self.slot_of[lora.lora_int_id] = slot
            loads.append((slot, lora.lora_int_id, adapter))
        slots = [-1 if lora is None else self.slot_of[lora.lora_int_id] for lora in loras]
        for slot in slots:
            if slot >= 0:
                self.lru.pop(slot, None)
                self.lru[slot] = None
        return slots, loads

    def _free_slot(self, needed: set[int]) -> int:
        used = set(self.slot_of.values())
        free = [s for s in range(self.num_slots) if s not in used]
        if free:
            return free[0]
        busy = {self.slot_of[i] for i in needed if i in self.slot_of}
        return next(s for s in self.lru if s not in busy)

    # --- every rank -----------------------------------------------------------------------
    def prepare_step(self, slots: list[int], loads: list[tuple], query_start: list[int]
                     ) -> None:
        """Load this step's new adapters into their slots and set the step's rows."""
        for slot, _, adapter in loads:
            self.load_slot(slot, adapter)
        self.state.step = self._step(slots, query_start) if any(s >= 0 for s in slots) else None

    def finish_step(self) -> None:
        self.state.step = None

    def load_slot(self, slot: int, adapter: LoRAAdapter) -> None:
        c, shard = self.hf_config, self.shard
        for (layer, fused), linear in self.layers.items():
            parts = []
            for module in FUSED_SLICES[fused]:
                w = adapter.modules.get((layer, module))
                if w is not None:
                    w = shard_weights(w, module, shard, c.head_dim, c.intermediate_size)
                    w = (w.a, w.b)
                parts.append(w)
            linear.set_slot(slot, parts, adapter.rank)
        self.rank_of_slot[slot] = adapter.rank

    def _step(self, slots: list[int], query_start: list[int]) -> LoRAStep:
        if self.state.use_triton:
            dev = self.device
            lengths = [query_start[i + 1] - query_start[i] for i in range(len(slots))]
            return LoRAStep(seg_starts=torch.tensor(query_start, dtype=torch.int32, device=dev),
                            seg_slots=torch.tensor(slots, dtype=torch.int32, device=dev),
                            max_seg_len=max(lengths))
        rows: dict[int, list[int]] = {}
        for i, slot in enumerate(slots):
            if slot >= 0:
                rows.setdefault(slot, []).extend(range(query_start[i], query_start[i + 1]))
        return LoRAStep(cpu=CPULoRAPlan.build(rows, self.rank_of_slot))


def wrap_model(model, shard: RankShape, num_slots: int, max_rank: int,
               state: LoRAState) -> dict[tuple[int, str], LoRALinear]:
    """Wrap each layer's q/k/v, o, gate/up and down projections (the MLP's only in a
    dense model: a mixture-of-experts block's experts are not adapted). Returns the
    wrapped projections by (layer index, fused name)."""
    c = model.config
    dtype = next(p for p in model.parameters() if p.is_floating_point()).dtype
    device = next(model.parameters()).device
    shapes = module_shapes(c)
    hd = c.head_dim
    q, kv = shard.num_heads * hd, shard.num_kv_heads * hd
    plan = {"qkv_proj": ("self_attn", [q, kv, kv], c.hidden_size),
            "o_proj": ("self_attn", [c.hidden_size], q)}
    if "gate_proj" in shapes:
        i = shard.intermediate
        plan.update(gate_up_proj=("mlp", [i, i], c.hidden_size),
                    down_proj=("mlp", [c.hidden_size], i))
    wrapped = {}
    for index, layer in enumerate(model.model.layers):
        for name, (owner, out_sizes, in_features) in plan.items():
            parent = getattr(layer, owner)
            base = getattr(parent, name, None)
            if base is None:
                continue
            linear = LoRALinear(base, in_features, out_sizes, num_slots, max_rank, dtype,
                                device, state)
            setattr(parent, name, linear)
            wrapped[(index, name)] = linear
    return wrapped
