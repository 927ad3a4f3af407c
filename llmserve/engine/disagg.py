"""The engine's half of prefill/decode disaggregation (engine thread only).

A *prefill* engine runs a leg-1 request (``kv_transfer_params: {"do_remote_decode":
true}``, max_tokens 1) like any other; when it finishes, the prompt's full blocks are
held under a lease instead of being freed, and the answer says where to read them.
Leases are collected when their reader releases them or they expire.

A *decode* engine, before queueing a leg-2 request, imports the prompt's prefix:
``reserve`` holds the blocks its prefix cache already has and takes fresh blocks for the
rest; the transport fills those (off the engine thread, async_llm.py); ``commit``
registers them in the prefix cache. The request's prefix-cache lookup then finds the
whole prefix, so only the last partial block is computed here, and every output token
(the first included) is sampled here: outputs equal a colocated engine's. The blocks
stay held until the request is first scheduled, so nothing evicts them meanwhile.

Whole blocks only, and at least one prompt token left to compute: the same rule as a
prefix-cache hit (``BlockManager.match_prefix``).
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass

from llmserve import envs
from llmserve.config import EngineConfig
from llmserve.core.block_manager import BlockManager, prefix_hashes
from llmserve.core.request import Request, Sequence, SequenceStatus
from llmserve.distributed.kv_transfer.leases import LeaseTable
from llmserve.distributed.kv_transfer.params import RemotePrefill, prompt_digest
from llmserve.distributed.kv_transfer.transport import KVLayout
from llmserve.engine.hooks import StepHook
from llmserve.envs import kv_transfer_secret

log = logging.getLogger(__name__)


def transferable_blocks(num_prompt_tokens: int, block_size: int) -> int:
    """Full prompt blocks a decode engine can take without computing them."""
    return (num_prompt_tokens - 1) // block_size


@dataclass
class ImportPlan:
    """A decode engine's reservation for one request's prefix."""
    hashes: list[bytes]
    block_ids: list[int]  # held: the cached prefix, then fresh blocks to fill
    first_new: int

    @property
    def fresh(self) -> list[int]:
        return self.block_ids[self.first_new:]


class KVTransferSide(StepHook):
    """P/D as a step hook: a leg-1 request's blocks are leased as it finishes
    (``finishing``); a leg-2 request's imported prefix is held until it is scheduled
    (``after_forward``), or dropped when it blocks the queue (``schedule_again``)."""

    def __init__(self, config: EngineConfig, model_name: str, hf_config, num_kv_heads: int,
                 block_manager: BlockManager, requests: dict[str, Request]):
        self.role = config.kv_role
        self.block_size = config.block_size
        self.block_manager = block_manager
        self.requests = requests  # the engine's, by id
        self.model_name = model_name
        self.engine_id = uuid.uuid4().hex
        self.layout = KVLayout(model=model_name, dtype=config.dtype,
                               quantization=config.quantization,
                               num_layers=hf_config.num_hidden_layers,
                               block_size=config.block_size, num_kv_heads=num_kv_heads,
                               head_dim=hf_config.head_dim)
        self.leases = LeaseTable(config.kv_lease_ttl) if self.role == "prefill" else None
        self.host = config.kv_transfer_host or default_host()
        self.port = config.kv_transfer_port  # the bound port once the side channel listens
        self.imported_tokens = 0  # decode: prompt tokens whose KV arrived from a peer
        self.secret = kv_transfer_secret()  # signs the leases' params (prefill role)
        # Leases may hold at most this many blocks: the rest of the pool keeps serving
        # leg 1 while decode engines are slow to read (a request over it gets no lease,
        # and its decode engine prefills itself).
        self.max_leased_blocks = block_manager.num_blocks // 2

    # --- the step hook ------------------------------------------------------------------
    def finishing(self, seq: Sequence, status: SequenceStatus) -> None:
        if seq.request.remote_decode:  # leg 1: keep the prompt's KV for the decode engine
            self.hold_for_decode(seq, status)

    def after_forward(self, batch) -> None:
        for seq in batch.seqs:
            if seq.request.kv_hold:  # its prefix is in its block table now
                self.release_hold(seq.request)

    def aborted(self, req: Request) -> None:
        self.release_hold(req)

    def schedule_again(self) -> bool:
        return self.drop_waiting_holds()

    # --- prefill role ---------------------------------------------------------------
    def hold_for_decode(self, seq: Sequence, status: SequenceStatus) -> None:
        """Before a leg-1 request's blocks are freed: lease its full prompt blocks and
        put the lease in the request's answer."""
        req = seq.request
        n = min(transferable_blocks(seq.num_prompt_tokens, self.block_size),
                seq.num_computed_tokens // self.block_size, len(seq.block_table))
        if (self.leases is None or status == SequenceStatus.FINISHED_ABORTED or n <= 0
                or req.kv_transfer_params is not None  # one lease per request (n = 1)
                or self.leases.blocks_held + n > self.max_leased_blocks):
            return
        block_ids = seq.block_table[:n]
        num_tokens = n * self.block_size
        self.block_manager.hold(block_ids)
        lease = self.leases.create(block_ids, prompt_digest(seq.token_ids[:num_tokens]))
        req.kv_transfer_params = RemotePrefill(
            remote_engine_id=self.engine_id, remote_host=self.host, remote_port=self.port,
            remote_lease_id=lease.lease_id, remote_block_ids=block_ids,
            num_tokens=num_tokens, expires_at=lease.expires_at,
            model=self.model_name).signed(self.secret).to_json()

    def collect_leases(self) -> int:
        """Free the blocks of leases that were read or expired; how many expired."""
        if self.leases is None:
            return 0
        expired_before = self.leases.expired_total
        for lease in self.leases.collect():
            self.block_manager.unhold(lease.block_ids)
        return self.leases.expired_total - expired_before

    # --- decode role ----------------------------------------------------------------
    def plan_import(self, token_ids: list[int], cache_salt: bytes,
                    remote: RemotePrefill) -> ImportPlan:
        """Hold what the prefix cache has of the prompt's transferable prefix and take
        fresh blocks for the rest of what the remote lease covers."""
        n = min(transferable_blocks(len(token_ids), self.block_size),
                remote.num_tokens // self.block_size, len(remote.remote_block_ids))
        if not self.block_manager.enable_prefix_caching:
            n = 0
        hashes = prefix_hashes(token_ids, max(n, 0), self.block_size, cache_salt)
        block_ids, first_new = self.block_manager.reserve_import(hashes)
        return ImportPlan(hashes, block_ids, first_new)

    def commit_import(self, plan: ImportPlan, filled: bool) -> list[int]:
        """Register the filled blocks in the prefix cache; the blocks still held."""
        held = self.block_manager.commit_import(plan.block_ids, plan.hashes,
                                                       plan.first_new, filled)
        if filled:
            self.imported_tokens += len(plan.fresh) * self.block_size
        return held

    def release_hold(self, req: Request) -> None:
        if req.kv_hold:
            self.block_manager.unhold(req.kv_hold)
            req.kv_hold = []

    def drop_waiting_holds(self) -> bool:
        """Make the imported prefixes of requests not yet scheduled evictable. Called when
        a step schedules nothing: those holds may be what the queue's head waits for,
        and nothing else would ever free them. The blocks stay in the prefix cache, so
        the requests still find them unless they are evicted meanwhile."""
        dropped = False
        for req in self.requests.values():
            if req.kv_hold and req.first_scheduled_time is None:
                self.release_hold(req)
                dropped = True
        return dropped


def default_host() -> str:
    """The address decode engines reach this engine at: the pod's IP on Kubernetes."""
    return envs.POD_IP or "127.0.0.1"
