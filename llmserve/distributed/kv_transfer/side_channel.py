"""The side channel: a TCP service on a prefill engine through which decode engines
authenticate, read the blocks a lease holds, and release the lease.

Messages are a 4-byte big-endian length and a JSON object; block bytes follow a
read's answer raw (``transport.py``). A connection:

    server -> {"nonce", "engine_id", "layout", "transport": {metadata}}
    client -> {"auth": HMAC-SHA256(secret, nonce)}         server -> {"ok": true}
    client -> {"op": "read", "lease", "prompt_digest", "block_ids", "release"}
    server -> {"ok": true, "nbytes"} + the blocks          (or {"ok": false, "reason"})
    client -> {"op": "release", "lease"}                   server -> {"ok": true}

Only peers holding the deployment's shared secret get past the hello, so no client can
read another tenant's KV; with no secret configured any peer may, but it still needs
the lease id (128 random bits) that only the gateway saw.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import secrets
import socket
import socketserver
import struct
import threading
import time
from collections.abc import Callable

from llmserve.distributed.kv_transfer.leases import LeaseError, LeaseTable
from llmserve.distributed.kv_transfer.params import RemotePrefill
from llmserve.distributed.kv_transfer.transport import (
    KVLayout,
    KVTransferError,
    KVTransport,
    recv_exactly,
)

log = logging.getLogger(__name__)

MAX_MESSAGE = 16 << 20  # a JSON header; block ids of a 1M-token prompt fit easily
_LEN = struct.Struct(">I")


def send_message(sock: socket.socket, msg: dict) -> None:
    data = json.dumps(msg).encode()
    sock.sendall(_LEN.pack(len(data)) + data)


def recv_message(sock: socket.socket) -> dict:
    head = bytearray(_LEN.size)
    recv_exactly(sock, memoryview(head))
    (n,) = _LEN.unpack(head)
    if n > MAX_MESSAGE:
        raise KVTransferError("protocol", f"side-channel message of {n} bytes")
    body = bytearray(n)
    recv_exactly(sock, memoryview(body))
    try:
        msg = json.loads(body)
    except ValueError as e:
        raise KVTransferError("protocol", f"side-channel message is not JSON: {e}") from e
    if not isinstance(msg, dict):
        raise KVTransferError("protocol", "side-channel message is not an object")
    return msg


def _proof(secret: bytes, nonce: str) -> str:
    return hmac.new(secret, nonce.encode(), hashlib.sha256).hexdigest()


# --- the prefill engine's side ----------------------------------------------------------
class SideChannelServer:
    def __init__(self, transport: KVTransport, leases: LeaseTable, layout: KVLayout,
                 engine_id: str, secret: bytes | None,
                 on_sent: Callable[[int], None] = lambda blocks: None):
        self.transport, self.leases, self.layout = transport, leases, layout
        self.engine_id, self.secret, self.on_sent = engine_id, secret, on_sent
        self._server: socketserver.ThreadingTCPServer | None = None

    def start(self, host: str, port: int) -> int:
        """Listen on host:port (0: any free port) in a daemon thread; the bound port."""
        outer = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                outer._serve(self.request)

        socketserver.ThreadingTCPServer.allow_reuse_address = True
        self._server = socketserver.ThreadingTCPServer((host, port), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, name="kv-side-channel",
                         daemon=True).start()
        return self._server.server_address[1]

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    def _serve(self, sock: socket.socket) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        nonce = secrets.token_hex(16)
        try:
            send_message(sock, {"nonce": nonce, "engine_id": self.engine_id,
                                "layout": self.layout.to_json(),
                                "transport": {"name": self.transport.name,
                                              **self.transport.metadata()}})
            if not self._authentic(recv_message(sock).get("auth"), nonce):
                send_message(sock, {"ok": False, "reason": "auth"})
                return
            send_message(sock, {"ok": True})
            while True:
                try:
                    msg = recv_message(sock)
                except KVTransferError:
                    return  # the peer is done (or gone)
                self._answer(sock, msg)
        except (OSError, KVTransferError) as e:
            log.info("side channel: peer dropped: %s", e)

    def _authentic(self, auth, nonce: str) -> bool:
        if self.secret is None:
            return True
        return isinstance(auth, str) and hmac.compare_digest(auth, _proof(self.secret, nonce))

    def _answer(self, sock: socket.socket, msg: dict) -> None:
        op, lease_id = msg.get("op"), msg.get("lease")
        if not isinstance(lease_id, str):
            send_message(sock, {"ok": False, "reason": "protocol"})
        elif op == "release":
            self.leases.release(lease_id)
            send_message(sock, {"ok": True})
        elif op == "read":
            self._read(sock, lease_id, msg)
        else:
            send_message(sock, {"ok": False, "reason": "protocol"})

    def _read(self, sock: socket.socket, lease_id: str, msg: dict) -> None:
        ids = msg.get("block_ids")
        if not isinstance(ids, list) or not all(isinstance(b, int) for b in ids):
            send_message(sock, {"ok": False, "reason": "protocol"})
            return
        try:
            self.leases.begin_read(lease_id, str(msg.get("prompt_digest")), ids)
        except LeaseError as e:
            send_message(sock, {"ok": False, "reason": e.reason, "message": str(e)})
            return
        try:
            send_message(sock, {"ok": True})
            self.transport.for_reader(msg.get("transport")).send(sock, ids)
            self.on_sent(len(ids))
        finally:
            self.leases.end_read(lease_id, release=bool(msg.get("release", True)))


# --- the decode engine's side -----------------------------------------------------------
def read_remote_blocks(transport: KVTransport, layout: KVLayout, remote: RemotePrefill,
                       src_ids: list[int], dst_ids: list[int], prompt_digest: str,
                       secret: bytes | None, timeout: float = 30.0) -> int:
    """Copy the remote lease's blocks ``src_ids`` into our blocks ``dst_ids`` and release
    the lease (also when nothing is to be read). Returns the bytes moved; raises
    KVTransferError (the caller prefills locally)."""
    if remote.expires_at < time.time():
        raise KVTransferError("expired", "the lease expired before the decode engine read it")
    try:
        sock = socket.create_connection((remote.remote_host, remote.remote_port),
                                        timeout=min(timeout, 5.0))
    except OSError as e:
        raise KVTransferError("unreachable", f"cannot reach the prefill engine at "
                              f"{remote.remote_host}:{remote.remote_port}: {e}") from e
    try:
        sock.settimeout(timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        hello = _handshake(sock, layout, remote, secret)
        if not src_ids:
            _ask(sock, {"op": "release", "lease": remote.remote_lease_id})
            return 0
        _ask(sock, {"op": "read", "lease": remote.remote_lease_id, "block_ids": src_ids,
                    "prompt_digest": prompt_digest, "release": True,
                    "transport": transport.name})
        return transport.receive(sock, hello, src_ids, dst_ids)
    except TimeoutError as e:
        raise KVTransferError("timeout", f"the side channel timed out after {timeout} s") from e
    except OSError as e:
        raise KVTransferError("unreachable", f"the side channel broke: {e}") from e
    finally:
        sock.close()


def _handshake(sock: socket.socket, layout: KVLayout, remote: RemotePrefill,
               secret: bytes | None) -> dict:
    hello = recv_message(sock)
    nonce = hello.get("nonce")
    if not isinstance(nonce, str):
        raise KVTransferError("protocol", "the side channel sent no nonce")
    send_message(sock, {"auth": _proof(secret, nonce) if secret is not None else ""})
    if not recv_message(sock).get("ok"):
        raise KVTransferError("auth", "the prefill engine refused our shared secret")
    if hello.get("engine_id") != remote.remote_engine_id:
        raise KVTransferError("mismatch", "another engine answers at that address (it "
                              "restarted?)")
    diff = layout.mismatch(hello.get("layout") or {})
    if diff:
        _ask(sock, {"op": "release", "lease": remote.remote_lease_id})
        raise KVTransferError("mismatch", f"the engines' KV layouts differ: {diff}")
    return hello


def _ask(sock: socket.socket, msg: dict) -> dict:
    send_message(sock, msg)
    answer = recv_message(sock)
    if not answer.get("ok"):
        reason = str(answer.get("reason") or "protocol")
        raise KVTransferError(reason, answer.get("message") or f"refused: {reason}")
    return answer
