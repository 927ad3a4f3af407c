"""The event-loop half of P/D: the prefill engine's side channel, the decode engine's
imports, and their metrics (the engine-thread half is ``disagg.py``).

An import never fails a request: a peer that is unreachable, expired, refuses our
secret or holds another model's KV is logged and counted
(``llmserve:kv_transfer_failures_total{reason}``), and the decode engine prefills the
prompt itself.
"""

from __future__ import annotations

import asyncio
import logging
import time

from llmserve.distributed.kv_transfer.backends import make_transport
from llmserve.distributed.kv_transfer.params import RemotePrefill, prompt_digest
from llmserve.distributed.kv_transfer.side_channel import SideChannelServer, read_remote_blocks
from llmserve.distributed.kv_transfer.transport import KVTransferError
from llmserve.engine.disagg import KVTransferSide
from llmserve.envs import kv_transfer_secret

log = logging.getLogger(__name__)


class KVTransferService:
    def __init__(self, llm, side: KVTransferSide):
        self.llm, self.side = llm, side  # llm: the AsyncLLMEngine
        self.metrics = llm.metrics
        self.transport = self._transport(llm.config.kv_transfer_backend,
                                         llm.engine.runner.kv_cache.storage)
        self.secret = kv_transfer_secret()
        self.server: SideChannelServer | None = None

    @staticmethod
    def _transport(backend: str, storage):
        """The transport, with our KV storage registered. ``auto`` falls back to TCP when
        NIXL loads but cannot register the real storage (as when it does not load)."""
        transport = make_transport(backend)
        try:
            transport.register(storage)
        except Exception as e:  # noqa: BLE001 - NIXL/UCX errors have no common base
            if backend != "auto" or transport.name == "tcp":
                raise
            log.warning("KV transfer: NIXL cannot register the KV cache (%s: %s); using "
                        "the TCP transport", type(e).__name__, e)
            transport = make_transport("tcp")
            transport.register(storage)
        return transport

    def start(self, wake) -> None:
        """Prefill role: serve the side channel (``wake`` tells the engine thread a lease
        was released)."""
        if self.secret is None:
            log.warning("LLMSERVE_KV_TRANSFER_SECRET is not set: the KV side channel does "
                        "not authenticate peers (lease ids are still unguessable)")
        log.info("KV transfer: role %s, transport %s", self.side.role, self.transport.name)
        if self.side.leases is None:
            return
        self.side.leases.on_release = wake
        # Read at scrape time: the engine thread's loop may sleep right after the step
        # that created a lease, and a gauge it sets would miss that lease until later.
        leases = self.side.leases
        self.metrics.kv_blocks_held.set_function(lambda: leases.blocks_held)
        bs = self.side.block_size
        self.server = SideChannelServer(
            self.transport, self.side.leases, self.side.layout, self.side.engine_id,
            self.secret, on_sent=lambda blocks: self.metrics.kv_sent(blocks * bs))
        self.side.port = self.server.start("0.0.0.0", self.side.port)
        log.info("KV side channel on port %d, advertised as %s", self.side.port,
                 self.side.host)

    def close(self) -> None:
        if self.server is not None:
            self.server.close()

    def collect_leases(self) -> None:
        """Engine thread, every loop: free read or expired leases."""
        if self.side.leases is None:
            return
        expired = self.side.collect_leases()
        if expired:
            self.metrics.kv_failure("expired", expired)

    # --- decode role ----------------------------------------------------------------
    async def import_prefix(self, token_ids: list[int], cache_salt: bytes,
                            remote: RemotePrefill) -> list[int]:
        """Bring the prompt's KV from the peer into our prefix cache; the blocks held for
        the request (give them to ``add_request``). A cancelled caller's blocks are given
        back once the transfer settles (the transport may still be writing them)."""
        task = asyncio.ensure_future(self._import(token_ids, cache_salt, remote))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(self._give_back)
            raise

    def _give_back(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is None:
            self.llm.release_hold(task.result())

    async def _import(self, token_ids: list[int], cache_salt: bytes,
                      remote: RemotePrefill) -> list[int]:
        refusal = self._refusal(remote)
        if refusal is not None:
            self.metrics.kv_failure(refusal[0])
            log.warning("kv_transfer_params refused (%s): prefilling locally", refusal[1])
            return []
        plan = await self.llm.on_engine(
            lambda engine: self.side.plan_import(token_ids, cache_salt, remote))
        filled = False
        try:
            filled = await self._read(plan, token_ids, remote)
        finally:  # whatever went wrong, the fresh blocks are committed or given back
            held = await self.llm.on_engine(
                lambda engine: self.side.commit_import(plan, filled))
        return held

    def _refusal(self, remote: RemotePrefill) -> tuple[str, str] | None:
        if not remote.verify(self.secret):
            return "auth", "not signed by a prefill engine holding our shared secret"
        if remote.model != self.side.layout.model:
            return "mismatch", f"they name model {remote.model!r}, this engine serves " \
                               f"{self.side.layout.model!r}"
        return None

    async def _read(self, plan, token_ids: list[int], remote: RemotePrefill) -> bool:
        """Fill the plan's fresh blocks from the peer; False (counted, logged) on any
        failure: the request then prefills what is missing."""
        digest = prompt_digest(token_ids[:remote.num_tokens])
        t0 = time.perf_counter()
        try:
            await asyncio.to_thread(read_remote_blocks, self.transport, self.side.layout,
                                    remote, plan.first_new, plan.fresh, digest, self.secret)
        except Exception as e:  # noqa: BLE001 - a transfer never fails the request
            reason = e.reason if isinstance(e, KVTransferError) else "protocol"
            self.metrics.kv_failure(reason)
            log.warning("KV transfer from %s:%d failed (%s): %s; prefilling locally",
                        remote.remote_host, remote.remote_port, reason, e)
            return False
        if plan.fresh:
            self.metrics.kv_received(len(plan.fresh) * self.side.block_size,
                                     time.perf_counter() - t0)
        return True
