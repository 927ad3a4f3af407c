"""NIXL transport: the decode engine READs the prefill engine's KV blocks one-sidedly.

Each engine registers its whole KV storage with a NIXL agent once (``register``). The
prefill engine's side-channel hello carries what a reader needs (``metadata``): the
agent's name and metadata (base64), the storage's base address, shape, dtype and
memory type. Inside a read the lease allows, the decode engine (``receive``) loads the
remote agent (cached per agent name), builds one descriptor per contiguous region --
storage is ``[layers, 2, blocks, block_size, kv_heads, head_dim]``, so each (layer,
K/V, run of consecutive blocks) is one region on both sides -- posts a READ into its
own registered storage and polls it to completion, then tells the prefill engine
``{"done": true}`` on the side channel. The prefill engine (``send``) only waits for
that message, so the lease stays open (its blocks referenced) while the peer reads.

UCX does the moving: CMA (``process_vm_readv``) between processes of one host, RDMA or
TCP across hosts, CUDA IPC / GPUDirect for GPU memory where available. The agent runs
without NIXL's progress thread (it busy-spins a core per agent); the reader drives
progress by polling. A peer that speaks another transport (``tcp``) is served and read
inline over the side channel, so mixed deployments still move KV.
"""

from __future__ import annotations

import base64
import importlib
import logging
import os
import select
import socket
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from llmserve import envs
from llmserve.distributed.kv_transfer.side_channel import recv_message, send_message
from llmserve.distributed.kv_transfer.transport import (
    KVTransferError,
    KVTransport,
    TcpTransport,
)

log = logging.getLogger(__name__)

# Python modules NIXL ships as: nixl-cu12 (what we depend on), the `nixl` meta
# package's dispatcher, nixl-cu13.
_MODULES = ("nixl_cu12._api", "nixl._api", "nixl_cu13._api")
REMOTE_AGENTS = 64  # remote agents kept loaded (one per prefill engine process)
DEFAULT_TIMEOUT = 30.0
PROGRESS_INTERVAL = 0.0002  # seconds between the prefill side's UCX progress calls


def load_nixl():
    """NIXL's Python API module; ImportError naming every module tried."""
    errors = []
    for name in _MODULES:
        try:
            return importlib.import_module(name)
        except (ImportError, OSError) as e:  # OSError: a shared library that won't load
            errors.append(f"{name}: {e}")
    raise ImportError("NIXL is not installed or does not load (pip install nixl-cu12): "
                      + "; ".join(errors))


class NixlTransport(KVTransport):
    name = "nixl"

    def __init__(self, agent_name: str | None = None):
        api = load_nixl()
        self.agent_name = agent_name or f"llmserve-kv-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        config = api.nixl_agent_config(
            enable_prog_thread=False, backends=[],
            # Receives run on several threads (one per import) against one agent.
            sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
        self.agent = api.nixl_agent(self.agent_name, config)
        if "UCX" not in self.agent.get_plugin_list():
            raise ImportError("NIXL loads but has no UCX plugin")
        params = {}
        if _shared_memory_only(envs.UCX_TLS):
            # UCX's shared-memory transports cannot do peer error handling: the backend
            # fails to start ("no peer failure handler") unless it is off.
            params["ucx_error_handling_mode"] = "none"
        self.agent.create_backend("UCX", params)
        # Fail here, not at the first transfer, where UCX cannot register memory (so
        # make_transport("auto") falls back to TCP).
        probe = torch.zeros(4096, dtype=torch.uint8)
        self.agent.deregister_memory(self.agent.register_memory(probe))
        self._remote: OrderedDict[str, str] = OrderedDict()  # agent name -> loaded name
        self._lock = threading.Lock()
        self._meta: dict | None = None
        self._tcp: TcpTransport | None = None
        self.storage: torch.Tensor | None = None

    # --- both roles -------------------------------------------------------------------
    def register(self, storage: torch.Tensor) -> None:
        if not storage.is_contiguous():
            raise ValueError("NIXL registers the KV storage as one region: it must be "
                             "contiguous")
        super().register(storage)
        self.agent.register_memory(storage)
        self._tcp = TcpTransport()
        self._tcp.register(storage)
        self._meta = {
            "agent": self.agent_name,
            "agent_metadata": base64.b64encode(self.agent.get_agent_metadata()).decode(),
            "base": storage.data_ptr(),
            "nbytes": storage.numel() * storage.element_size(),
            "shape": list(storage.shape),
            "strides": list(storage.stride()),
            "dtype": str(storage.dtype).removeprefix("torch."),
            "region_bytes": _region_bytes(storage),
            "mem_type": _mem_type(storage),
            "device_id": max(storage.get_device(), 0),
        }

    def metadata(self) -> dict:
        if self._meta is None:
            raise RuntimeError("NixlTransport.register was not called")
        return dict(self._meta)

    # --- the prefill engine's side -----------------------------------------------------
    def send(self, sock: socket.socket, src_ids: list[int]) -> int:
        """Hold the read open until the reader says its READ finished (or failed)."""
        deadline = time.monotonic() + (sock.gettimeout() or DEFAULT_TIMEOUT)
        while not select.select([sock], [], [], PROGRESS_INTERVAL)[0]:
            # No progress thread: drive our UCX worker while the peer reads (its
            # endpoint's wireup, and transports that emulate a READ by messages).
            self.agent.get_new_notifs()
            if time.monotonic() > deadline:
                raise KVTransferError("timeout", "the reader did not finish its NIXL READ")
        msg = recv_message(sock)
        if msg.get("done") is not True:
            raise KVTransferError(str(msg.get("reason") or "protocol"),
                                  f"the reader's NIXL READ failed: {msg.get('message')}")
        return len(src_ids) * self._block_bytes()

    def for_reader(self, reader_transport: str | None) -> KVTransport:
        """A reader that does not speak NIXL gets the blocks inline."""
        if reader_transport == self.name or self._tcp is None:
            return self
        return self._tcp

    # --- the decode engine's side ------------------------------------------------------
    def receive(self, sock: socket.socket, peer: dict, src_ids: list[int],
                dst_ids: list[int]) -> int:
        remote = peer.get("transport") or {}
        if remote.get("name") != self.name:  # the peer serves the blocks inline
            assert self._tcp is not None
            return self._tcp.receive(sock, peer, src_ids, dst_ids)
        timeout = sock.gettimeout() or DEFAULT_TIMEOUT
        try:
            try:
                moved = self._read(remote, src_ids, dst_ids, timeout)
            except KVTransferError:
                raise
            except Exception as e:  # NIXL's own errors (nixlBackendError...): never a 5xx
                self._forget(str(remote.get("agent")))
                raise KVTransferError("unreachable", f"NIXL could not read the peer's "
                                      f"blocks: {type(e).__name__}: {e}") from e
        except KVTransferError as e:
            _tell(sock, {"done": False, "reason": e.reason, "message": str(e)})
            raise
        send_message(sock, {"done": True})
        return moved

    def _read(self, remote: dict, src_ids: list[int], dst_ids: list[int],
              timeout: float) -> int:
        """READ the peer's blocks ``src_ids`` into ours ``dst_ids``; the bytes moved."""
        st = self.storage
        if st is None:
            raise RuntimeError("NixlTransport.register was not called")
        if len(src_ids) != len(dst_ids):
            raise KVTransferError("protocol", "src_ids and dst_ids differ in length")
        peer = PeerStorage.parse(remote, st)
        if not src_ids:
            return 0
        src, dst = _in_peer_order(src_ids, dst_ids, peer.shape[2], st.shape[2])
        region = _region_bytes(st)  # the peer's as well (PeerStorage.parse)
        remote_descs = _descs(peer.base, peer.shape[0] * peer.shape[1], peer.shape[2],
                              region, src, dst, peer.device_id, source=True)
        local_descs = _descs(st.data_ptr(), st.shape[0] * st.shape[1], st.shape[2], region,
                             src, dst, max(st.get_device(), 0), source=False)
        remote_name = self._remote_agent(peer.agent, peer.agent_metadata)
        local = self.agent.get_xfer_descs(local_descs, _mem_type(st))
        remote_list = self.agent.get_xfer_descs(remote_descs, peer.mem_type)
        self._transfer(local, remote_list, remote_name, peer.agent, timeout)
        if st.is_cuda:
            torch.cuda.synchronize(st.device)
        return len(src_ids) * peer.shape[0] * peer.shape[1] * region

    def _transfer(self, local, remote_list, remote_name: str, agent: str,
                  timeout: float) -> None:
        """Post the READ and drive it to completion; the handle is released either way."""
        ag = self.agent
        handle = ag.initialize_xfer("READ", local, remote_list, remote_name)
        try:
            state = ag.transfer(handle)
            state = _poll(ag, handle, state, time.monotonic() + timeout)
            if state == "PROC":
                raise KVTransferError("timeout", f"the NIXL READ did not finish in "
                                      f"{timeout} s")
            if state != "DONE":
                self._forget(agent)
                raise KVTransferError("unreachable", "the NIXL READ failed (is the peer's "
                                      "memory reachable over UCX?)")
        finally:
            try:
                ag.release_xfer_handle(handle)
            except Exception as e:  # an in-flight READ that cannot be cancelled
                log.warning("NIXL: could not release a transfer handle: %s", e)

    def _remote_agent(self, agent: str, agent_metadata: bytes) -> str:
        with self._lock:
            if agent in self._remote:
                self._remote.move_to_end(agent)
                return self._remote[agent]
            try:
                name = self.agent.add_remote_agent(agent_metadata)
            except Exception as e:
                raise KVTransferError("protocol", f"NIXL refused the peer's agent "
                                      f"metadata: {e}") from e
            name = name.decode() if isinstance(name, bytes) else name
            self._remote[agent] = name
            while len(self._remote) > REMOTE_AGENTS:
                _, old = self._remote.popitem(last=False)
                self._unload(old)
            return name

    def _forget(self, agent: str) -> None:
        with self._lock:
            name = self._remote.pop(agent, None)
        if name is not None:
            self._unload(name)

    def _unload(self, name: str) -> None:
        try:
            self.agent.remove_remote_agent(name)
        except Exception as e:
            log.debug("NIXL: removing remote agent %s: %s", name, e)

    def _block_bytes(self) -> int:
        st = self.storage
        return st.shape[0] * st.shape[1] * _region_bytes(st) if st is not None else 0


_NETWORK_TLS = ("all", "tcp", "rc", "ud", "dc", "ib", "srd")


def _shared_memory_only(ucx_tls: str) -> bool:
    """UCX_TLS names only on-host transports (``sm``, ``cma``, ``self``...)."""
    names = [t.strip() for t in ucx_tls.split(",") if t.strip()]
    if not names or names[0].startswith("^"):
        return False
    return not any(t.startswith(_NETWORK_TLS) for t in names)


@dataclass(frozen=True)
class PeerStorage:
    """The prefill engine's KV storage, as its hello's ``metadata()`` describes it."""
    shape: list[int]
    base: int
    agent: str
    region_bytes: int
    mem_type: str
    device_id: int
    agent_metadata: bytes

    @classmethod
    def parse(cls, remote: dict, ours: torch.Tensor) -> PeerStorage:
        """The peer's metadata, refused unless its blocks are laid out as ``ours``."""
        try:
            peer = cls(shape=[int(x) for x in remote["shape"]], base=int(remote["base"]),
                       agent=str(remote["agent"]),
                       region_bytes=int(remote["region_bytes"]),
                       mem_type=str(remote["mem_type"]),
                       device_id=int(remote.get("device_id", 0)),
                       agent_metadata=base64.b64decode(remote["agent_metadata"]))
        except (KeyError, TypeError, ValueError) as e:
            raise KVTransferError("protocol", f"bad NIXL metadata from the peer: {e}") from e
        region = _region_bytes(ours)
        if (len(peer.shape) != 6 or peer.shape[:2] != list(ours.shape[:2])
                or peer.region_bytes != region or peer.mem_type not in ("DRAM", "VRAM")):
            raise KVTransferError("mismatch", f"the peer's KV storage {peer.shape} "
                                  f"({peer.region_bytes} B regions) does not fit ours "
                                  f"{list(ours.shape)} ({region} B regions)")
        return peer


def _in_peer_order(src_ids: list[int], dst_ids: list[int], peer_blocks: int,
                   our_blocks: int) -> tuple[np.ndarray, np.ndarray]:
    """(src, dst) sorted by the peer's block ids, so a block run listed out of order
    still merges into one region; refused when an id is out of either storage."""
    order = np.argsort(np.asarray(src_ids, dtype=np.int64), kind="stable")
    src = np.asarray(src_ids, dtype=np.int64)[order]
    dst = np.asarray(dst_ids, dtype=np.int64)[order]
    if src.min() < 0 or src.max() >= peer_blocks or dst.min() < 0 or dst.max() >= our_blocks:
        raise KVTransferError("protocol", "block ids out of range")
    return src, dst


def _region_bytes(storage: torch.Tensor) -> int:
    """One (layer, K/V, block) region: block_size * kv_heads * head_dim elements."""
    return storage[0, 0, 0].numel() * storage.element_size()


def _mem_type(storage: torch.Tensor) -> str:
    return "VRAM" if storage.is_cuda else "DRAM"


def _descs(base: int, planes: int, num_blocks: int, region: int, src: np.ndarray,
           dst: np.ndarray, device_id: int, source: bool) -> np.ndarray:
    """Nx3 (address, length, device) descriptors of one side, one per (plane = layer x
    K/V, run of blocks consecutive on both sides); both sides get the same runs."""
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    lengths = np.diff(np.concatenate((starts, [len(src)])))
    first = (src if source else dst)[starts]
    plane = np.arange(planes, dtype=np.int64)[:, None]
    addr = base + (plane * num_blocks + first[None, :]) * region
    out = np.empty((addr.size, 3), dtype=np.uint64)
    out[:, 0] = addr.reshape(-1)
    out[:, 1] = np.broadcast_to(lengths[None, :] * region, addr.shape).reshape(-1)
    out[:, 2] = device_id
    return out


def _poll(agent, handle, state: str, deadline: float) -> str:
    """Drive the READ (no progress thread) until it leaves PROC or the deadline passes.
    Spins briefly (a CMA copy finishes within a few calls), then yields the core."""
    spins = 0
    while state == "PROC":
        if time.monotonic() > deadline:
            return state
        state = agent.check_xfer_state(handle)
        spins += 1
        if spins > 1000:
            time.sleep(0.0005)
        elif spins > 100:
            time.sleep(0)
    return state


def _tell(sock: socket.socket, msg: dict) -> None:
    try:
        send_message(sock, msg)
    except OSError:
        pass
