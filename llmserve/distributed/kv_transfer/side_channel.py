"""The side channel: a TCP service on a prefill engine through which decode engines
authenticate, read the blocks a lease holds, and release the lease.

Messages are a 4-byte big-endian length and a JSON object; block bytes follow a
read's answer raw (``transport.py``). A connection:

    server -> {"nonce": Ns, "engine_id", "layout", "transport": {metadata}}
    client -> {"nonce": Nc}
    server -> {"proof": HMAC(secret, "server|Nc|Ns")}    the server holds the secret
    client -> {"auth": HMAC(secret, "client|Ns|Nc")}     server -> {"ok": true}
    client -> {"op": "read", "lease", "prompt_digest", "first", "count", "release"}
    server -> {"ok": true, "block_ids"} + the blocks       (or {"ok": false, "reason"})
    client -> {"op": "release", "lease"}                   server -> {"ok": true}

Authentication is mutual: only peers holding the deployment's shared secret get past
the hello, so no client can read another tenant's KV, and a decode engine sends its
proof only to a server that proved itself first, so a listener a client names in forged
``kv_transfer_params`` can neither feed it bytes nor use it to sign. A read names
*positions* in the lease (the prompt's blocks ``first .. first+count``), never block ids:
the server maps them to its blocks, so a reordered ``remote_block_ids`` cannot file one
position's KV under another's key. With no secret configured any peer may read, but it
still needs the lease id (128 random bits) that only the gateway saw.
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

# The server's per-operation socket timeout: longer than a reader's whole transfer
# (read_remote_blocks' timeout), so the server never gives up on a read still running.
SERVER_TIMEOUT = 60.0
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


def _proof(secret: bytes | None, *parts: str) -> str:
    if secret is None:
        return ""
    return hmac.new(secret, "|".join(parts).encode(), hashlib.sha256).hexdigest()


def _matches(secret: bytes | None, proof, *parts: str) -> bool:
    if secret is None:
        return True
    return isinstance(proof, str) and hmac.compare_digest(proof, _proof(secret, *parts))


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
        sock.settimeout(SERVER_TIMEOUT)  # a stalled reader does not pin its lease forever
        nonce = secrets.token_hex(16)
        try:
            send_message(sock, {"nonce": nonce, "engine_id": self.engine_id,
                                "layout": self.layout.to_json(),
                                "transport": {"name": self.transport.name,
                                              **self.transport.metadata()}})
            theirs = str(recv_message(sock).get("nonce"))
            send_message(sock, {"proof": _proof(self.secret, "server", theirs, nonce)})
            if not _matches(self.secret, recv_message(sock).get("auth"), "client", nonce,
                            theirs):
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
        first, count = msg.get("first"), msg.get("count")
        if not (isinstance(first, int) and isinstance(count, int) and first >= 0
                and count > 0):
            send_message(sock, {"ok": False, "reason": "protocol"})
            return
        try:
            ids = self.leases.begin_read(lease_id, str(msg.get("prompt_digest")), first, count)
        except LeaseError as e:
            send_message(sock, {"ok": False, "reason": e.reason, "message": str(e)})
            return
        try:
            send_message(sock, {"ok": True, "block_ids": ids})
            self.transport.for_reader(msg.get("transport")).send(sock, ids)
            self.on_sent(len(ids))
        finally:
            self.leases.end_read(lease_id, release=bool(msg.get("release", True)))


# --- the decode engine's side -----------------------------------------------------------
def read_remote_blocks(transport: KVTransport, layout: KVLayout, remote: RemotePrefill,
                       first: int, dst_ids: list[int], prompt_digest: str,
                       secret: bytes | None, timeout: float = 30.0) -> int:
    """Copy the remote lease's blocks at positions ``first .. first+len(dst_ids)`` into
    our blocks ``dst_ids`` and release the lease (also when nothing is to be read), all
    within ``timeout`` seconds. Returns the bytes moved; raises KVTransferError (the
    caller prefills locally)."""
    if remote.expires_at < time.time():
        raise KVTransferError("expired", "the lease expired before the decode engine read it")
    try:
        sock = socket.create_connection((remote.remote_host, remote.remote_port),
                                        timeout=min(timeout, 5.0))
    except (OSError, UnicodeError) as e:
        raise KVTransferError("unreachable", f"cannot reach the prefill engine at "
                              f"{remote.remote_host}:{remote.remote_port}: {e}") from e
    # One deadline for the whole transfer: a peer trickling bytes cannot hold our blocks
    # (and a worker thread) past it.
    deadline = threading.Timer(timeout, _cut, (sock,))
    deadline.start()
    try:
        sock.settimeout(timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        hello = _handshake(sock, layout, remote, secret)
        if not dst_ids:
            _ask(sock, {"op": "release", "lease": remote.remote_lease_id})
            return 0
        answer = _ask(sock, {"op": "read", "lease": remote.remote_lease_id, "first": first,
                             "count": len(dst_ids), "prompt_digest": prompt_digest,
                             "release": True, "transport": transport.name})
        src_ids = answer.get("block_ids")
        if not (isinstance(src_ids, list) and len(src_ids) == len(dst_ids)
                and all(isinstance(b, int) and b >= 0 for b in src_ids)):
            raise KVTransferError("protocol", "the read's answer names no valid blocks")
        return transport.receive(sock, hello, src_ids, dst_ids)
    except TimeoutError as e:
        raise KVTransferError("timeout", f"the side channel timed out after {timeout} s") from e
    except OSError as e:
        if not deadline.is_alive():
            raise KVTransferError("timeout", f"the transfer took over {timeout} s") from e
        raise KVTransferError("unreachable", f"the side channel broke: {e}") from e
    except KVTransferError as e:
        if not deadline.is_alive() and e.reason == "protocol":
            raise KVTransferError("timeout", f"the transfer took over {timeout} s") from e
        raise
    finally:
        deadline.cancel()
        sock.close()


def _cut(sock: socket.socket) -> None:
    """The transfer's deadline passed: unblock whatever waits on the socket."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _handshake(sock: socket.socket, layout: KVLayout, remote: RemotePrefill,
               secret: bytes | None) -> dict:
    hello = recv_message(sock)
    nonce = hello.get("nonce")
    if not isinstance(nonce, str):
        raise KVTransferError("protocol", "the side channel sent no nonce")
    ours = secrets.token_hex(16)
    send_message(sock, {"nonce": ours})
    if not _matches(secret, recv_message(sock).get("proof"), "server", ours, nonce):
        raise KVTransferError("auth", "the peer does not hold the shared secret")
    send_message(sock, {"auth": _proof(secret, "client", nonce, ours)})
    if not recv_message(sock).get("ok"):
        raise KVTransferError("auth", "the prefill engine refused our shared secret")
    if hello.get("engine_id") != remote.remote_engine_id:
        raise KVTransferError("mismatch", "another engine answers at that address (it "
                              "restarted?)")
    peer_layout = hello.get("layout")
    diff = layout.mismatch(peer_layout if isinstance(peer_layout, dict) else {})
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
