"""Small helpers shared by every layer; imports nothing of llmserve."""

from __future__ import annotations

import socket
from contextlib import closing


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative integers: how many ``b``-sized pieces hold ``a``."""
    return -(-a // b)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing listens on now (the OS's pick)."""
    with closing(socket.socket()) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
