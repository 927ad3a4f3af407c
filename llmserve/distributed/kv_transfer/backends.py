"""Which transport moves KV between engines: TCP inline on the side channel, or NIXL's
one-sided reads where the library loads."""

from __future__ import annotations

import logging

from llmserve.distributed.kv_transfer.transport import KVTransport, TcpTransport

log = logging.getLogger(__name__)


def make_transport(name: str) -> KVTransport:
    """``tcp``, ``nixl``, or ``auto`` (NIXL where it loads, else TCP, logging why)."""
    if name == "tcp":
        return TcpTransport()
    if name not in ("nixl", "auto"):
        raise ValueError(f"unknown KV transfer backend {name!r} (tcp, nixl or auto)")
    try:
        from llmserve.distributed.kv_transfer.nixl import NixlTransport
        return NixlTransport()
    except Exception as e:  # ImportError, a library that does not load, UCX failing
        if name == "nixl":
            raise
        log.warning("KV transfer: NIXL does not load here (%s: %s); using the TCP "
                    "transport", type(e).__name__, e)
        return TcpTransport()
