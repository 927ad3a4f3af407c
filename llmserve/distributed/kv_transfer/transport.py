"""How KV blocks move between two engines' caches, behind one small interface.

A transport knows memory and bytes, never requests: the side channel
(``side_channel.py``) authenticates the peer and checks the lease, then asks the
transport to move blocks ``src_ids`` of the prefill engine's cache into blocks
``dst_ids`` of the decode engine's. Two transports:

- ``TcpTransport``: the bytes travel inline on the side channel's socket. Works
  everywhere; the fallback.
- ``NixlTransport`` (``nixl.py``): the decode engine does a one-sided READ of the
  prefill engine's registered KV memory (UCX: CMA on one host, RDMA across hosts);
  the side channel only carries NIXL's agent metadata and the lease.

The KV storage is the engine's ``[layers, 2, blocks, block_size, kv_heads, head_dim]``
tensor (``worker/kv_cache.py``); both caches must have the same ``KVLayout``.
"""

from __future__ import annotations

import socket
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass

import torch

# Blocks per message: bounds the gather buffer (a block of the built-in model is
# ~370 KB over all layers) while keeping per-message overhead negligible.
CHUNK_BLOCKS = 32


class KVTransferError(Exception):
    """A transfer that did not happen; ``reason`` labels the failure metric
    (unreachable, timeout, auth, expired, mismatch, protocol)."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class KVLayout:
    """What must be equal for one engine's KV blocks to be valid in another's cache."""
    model: str
    dtype: str
    quantization: str
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int

    def to_json(self) -> dict:
        return asdict(self)

    def mismatch(self, other: dict) -> str | None:
        """None when ``other`` (a peer's layout) matches, else what differs."""
        mine = self.to_json()
        diff = [f"{k}: {other.get(k)!r} != {v!r}" for k, v in mine.items() if other.get(k) != v]
        return "; ".join(diff) or None


class KVTransport(ABC):
    name: str

    def register(self, storage: torch.Tensor) -> None:
        """Remember this engine's KV storage (both roles call it once at start)."""
        self.storage = storage

    def metadata(self) -> dict:
        """What a reader needs to reach this engine's memory (sent in the hello)."""
        return {}

    @abstractmethod
    def send(self, sock: socket.socket, src_ids: list[int]) -> int:
        """Serve side, inside a read the lease allows: put blocks ``src_ids`` on the
        wire, or (one-sided transports) nothing. Returns the bytes moved."""

    @abstractmethod
    def receive(self, sock: socket.socket, peer: dict, src_ids: list[int],
                dst_ids: list[int]) -> int:
        """Read side: fill blocks ``dst_ids`` of our storage with the peer's blocks
        ``src_ids`` (``peer``: the hello, with the peer's metadata). Returns bytes."""

    def for_reader(self, reader_transport: str | None) -> KVTransport:
        """Serve side: the transport that serves a reader speaking ``reader_transport``
        (the name in its read request; None from readers that do not say)."""
        return self


class TcpTransport(KVTransport):
    name = "tcp"

    def send(self, sock: socket.socket, src_ids: list[int]) -> int:
        sent = 0
        for start in range(0, len(src_ids), CHUNK_BLOCKS):
            idx = torch.tensor(src_ids[start:start + CHUNK_BLOCKS], dtype=torch.long)
            chunk = self.storage[:, :, idx.to(self.storage.device)].cpu().contiguous()
            data = chunk.view(torch.uint8).numpy()
            sock.sendall(memoryview(data).cast("B"))
            sent += data.nbytes
        return sent

    def receive(self, sock: socket.socket, peer: dict, src_ids: list[int],
                dst_ids: list[int]) -> int:
        st = self.storage
        block_shape = (st.shape[0], st.shape[1], st.shape[3], st.shape[4], st.shape[5])
        received = 0
        for start in range(0, len(dst_ids), CHUNK_BLOCKS):
            ids = dst_ids[start:start + CHUNK_BLOCKS]
            buf = torch.empty((block_shape[0], block_shape[1], len(ids), *block_shape[2:]),
                              dtype=st.dtype)
            view = buf.view(torch.uint8).numpy()
            recv_exactly(sock, memoryview(view).cast("B"))
            idx = torch.tensor(ids, dtype=torch.long, device=st.device)
            st[:, :, idx] = buf.to(st.device)
            received += view.nbytes
        return received


def recv_exactly(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise KVTransferError("protocol", "the peer closed the side channel mid-transfer")
        got += n
