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
from llmserve.core.block_manager import prefix_hashes
from llmserve.core.request import Request, Sequence, SequenceStatus
from llmserve.distributed.kv_transfer.leases import LeaseTable
from llmserve.distributed.kv_transfer.params import RemotePrefill, prompt_digest
from llmserve.distributed.kv_transfer.transport import KVLayout
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


class KVTransferSide:
    def __init__(self, engine):
        config = engine.config
        self.engine = engine
        self.role = config.kv_role
        self.block_size = config.block_size
        self.engine_id = uuid.uuid4().hex
        hf = engine.hf_config
        self.layout = KVLayout(model=engine.model_name, dtype=config.dtype,
                               quantization=config.quantization,
                               num_layers=hf.num_hidden_layers, block_size=config.block_size,
                               num_kv_heads=engine.runner.shard.num_kv_heads,
                               head_dim=hf.head_dim)
        self.leases = LeaseTable(config.kv_lease_ttl) if self.role == "prefill" else None
        self.host = config.kv_transfer_host or default_host()
        self.port = config.kv_transfer_port  # the bound port once the side channel listens
        self.imported_tokens = 0  # decode: prompt tokens whose KV arrived from a peer
        self.secret = kv_transfer_secret()  # signs the leases' params (prefill role)
        # Leases may hold at most this many blocks: the rest of the pool keeps serving
        # leg 1 while decode engines are slow to read (a request over it gets no lease,
        # and its decode engine prefills itself).
        self.max_leased_blocks = engine.block_manager.num_blocks // 2

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
        self.engine.block_manager.hold(block_ids)
        lease = self.leases.create(block_ids, prompt_digest(seq.token_ids[:num_tokens]))
        req.kv_transfer_params = RemotePrefill(
            remote_engine_id=self.engine_id, remote_host=self.host, remote_port=self.port,
            remote_lease_id=lease.lease_id, remote_block_ids=block_ids,
            num_tokens=num_tokens, expires_at=lease.expires_at,
            model=self.engine.model_name).signed(self.secret).to_json()

    def collect_leases(self) -> int:
        """Free the blocks of leases that were read or expired; how many expired."""
        if self.leases is None:
            return 0
        expired_before = self.leases.expired_total
        for lease in self.leases.collect():
            self.engine.block_manager.unhold(lease.block_ids)
        return self.leases.expired_total - expired_before

    # --- decode role ----------------------------------------------------------------
    def plan_import(self, token_ids: list[int], cache_salt: bytes,
                    remote: RemotePrefill) -> ImportPlan:
        """Hold what the prefix cache has of the prompt's transferable prefix and take
        fresh blocks for the rest of what the remote lease covers."""
        n = min(transferable_blocks(len(token_ids), self.block_size),
                remote.num_tokens // self.block_size, len(remote.remote_block_ids))
        if not self.engine.block_manager.enable_prefix_caching:
            n = 0
        hashes = prefix_hashes(token_ids, max(n, 0), self.block_size, cache_salt)
        block_ids, first_new = self.engine.block_manager.reserve_import(hashes)
        return ImportPlan(hashes, block_ids, first_new)

    def commit_import(self, plan: ImportPlan, filled: bool) -> list[int]:
        """Register the filled blocks in the prefix cache; the blocks still held."""
        held = self.engine.block_manager.commit_import(plan.block_ids, plan.hashes,
                                                       plan.first_new, filled)
        if filled:
            self.imported_tokens += len(plan.fresh) * self.block_size
        return held

    def release_hold(self, req: Request) -> None:
        if req.kv_hold:
            self.engine.block_manager.unhold(req.kv_hold)
            req.kv_hold = []

    def drop_waiting_holds(self) -> bool:
        """Make the imported prefixes of requests not yet scheduled evictable. Called when
        a step schedules nothing: those holds may be what the queue's head waits for,
        and nothing else would ever free them. The blocks stay in the prefix cache, so
        the requests still find them unless they are evicted meanwhile."""
        dropped = False
        for req in self.engine.requests.values():
            if req.kv_hold and req.first_scheduled_time is None:
                self.release_hold(req)
                dropped = True
        return dropped


def default_host() -> str:
    """The address decode engines reach this engine at: the pod's IP on Kubernetes."""
    return envs.POD_IP or "127.0.0.1"
