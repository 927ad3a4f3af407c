"""Leases: KV blocks a prefill engine keeps for a decode engine to read.

Invariants:
- A lease's blocks stay referenced in the block manager (the engine thread holds
  them when it creates the lease and releases them when it collects the lease), so
  nothing overwrites them while the lease lives.
- A lease is collected once it is done (its reader released it) or expired, and never
  while a read is in progress: a read that began before the deadline finishes on
  intact blocks.
- Lease ids are unguessable (128 random bits): knowing one is the capability to read
  its blocks, on top of the deployment's shared secret.

Thread use: the engine thread creates and collects; side-channel threads read and
release. Every method takes the table's lock.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


class LeaseError(Exception):
    """A read the lease table refuses; ``reason`` is the failure metric's label."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclass
class Lease:
    lease_id: str
    block_ids: list[int]
    prompt_digest: str
    deadline: float  # monotonic seconds
    expires_at: float  # the same instant in unix seconds, for the peer
    readers: int = 0
    done: bool = False


class LeaseTable:
    def __init__(self, ttl: float, on_release: Callable[[], None] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.ttl = ttl
        self.on_release = on_release or (lambda: None)  # wakes the engine thread
        self._clock = clock
        self._lock = threading.Lock()
        self._leases: dict[str, Lease] = {}
        self.expired_total = 0

    def create(self, block_ids: list[int], prompt_digest: str) -> Lease:
        now = self._clock()
        lease = Lease(secrets.token_hex(16), list(block_ids), prompt_digest,
                      now + self.ttl, time.time() + self.ttl)
        with self._lock:
            self._leases[lease.lease_id] = lease
        return lease

    def begin_read(self, lease_id: str, prompt_digest: str, first: int,
                   count: int) -> list[int]:
        """Mark a read of the lease's blocks at positions ``first .. first+count`` in
        progress (the lease is not collected meanwhile); their block ids. Raises
        LeaseError: reason "expired" (unknown, released or past its deadline) or
        "mismatch" (another prompt, or positions the lease does not cover)."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None or lease.done or self._clock() > lease.deadline:
                raise LeaseError("expired", "no such lease: it expired, was released, "
                                 "or never existed")
            if prompt_digest != lease.prompt_digest:
                raise LeaseError("mismatch", "the lease holds another prompt's KV")
            if first < 0 or count < 1 or first + count > len(lease.block_ids):
                raise LeaseError("mismatch", f"the lease covers block positions 0.."
                                 f"{len(lease.block_ids) - 1}, not {first}..{first + count - 1}")
            lease.readers += 1
            return lease.block_ids[first:first + count]

    def end_read(self, lease_id: str, release: bool) -> None:
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None:
                return
            lease.readers -= 1
            lease.done = lease.done or release
        if release:
            self.on_release()

    def release(self, lease_id: str) -> bool:
        """The reader is finished with it (or never needed it)."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None:
                return False
            lease.done = True
        self.on_release()
        return True

    def collect(self) -> list[Lease]:
        """Remove and return the leases whose blocks may be freed now (engine thread)."""
        now = self._clock()
        gone = []
        with self._lock:
            for lease in list(self._leases.values()):
                if lease.readers:
                    continue
                if lease.done or now > lease.deadline:
                    if not lease.done:
                        self.expired_total += 1
                    gone.append(self._leases.pop(lease.lease_id))
        return gone

    @property
    def blocks_held(self) -> int:
        with self._lock:
            return sum(len(lease.block_ids) for lease in self._leases.values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._leases)
