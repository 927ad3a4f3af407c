"""Stored responses for ``previous_response_id``: each one's whole conversation (its
input after the instructions, then its output, as chat messages), in memory, bounded.

An entry lives ``ttl_s`` seconds; past ``max_entries`` or ``max_chars`` (the JSON size
of the stored conversations together) the oldest go first. A conversation is stored
whole rather than as a link to its parent, so a follow-up never depends on an older
entry that may have been evicted; the character cap bounds what long chains cost.
An entry is visible only to the tenant that created it (the gateway vouches for
tenants), so an id that leaked cannot be continued by another tenant.

Bounds come from the environment: LLMSERVE_RESPONSES_STORE_MAX (entries, default
1024), LLMSERVE_RESPONSES_STORE_TTL_S (default 3600) and
LLMSERVE_RESPONSES_STORE_MAX_CHARS (default 64 Mi).
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from dataclasses import dataclass

from llmserve import envs


@dataclass
class _Entry:
    tenant: str | None
    messages: list[dict]
    expires: float
    chars: int


class ResponseStore:
    def __init__(self, max_entries: int = 1024, ttl_s: float = 3600.0,
                 max_chars: int = 64 << 20, clock=time.monotonic):
        self.max_entries, self.ttl_s, self.max_chars = max_entries, ttl_s, max_chars
        self.clock = clock
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # oldest first
        self.chars = 0

    @classmethod
    def from_env(cls) -> ResponseStore:
        return cls(envs.LLMSERVE_RESPONSES_STORE_MAX, envs.LLMSERVE_RESPONSES_STORE_TTL_S,
                   envs.LLMSERVE_RESPONSES_STORE_MAX_CHARS)

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, rid: str, tenant: str | None, messages: list[dict]) -> bool:
        """Keep ``messages`` under ``rid``; False when one conversation alone is over the
        character cap (it is then not kept)."""
        chars = len(json.dumps(messages, ensure_ascii=False))
        if chars > self.max_chars or self.max_entries <= 0:
            return False
        self._drop(rid)
        self._entries[rid] = _Entry(tenant, messages, self.clock() + self.ttl_s, chars)
        self.chars += chars
        self._evict()
        return True

    def get(self, rid: str, tenant: str | None) -> list[dict] | None:
        """The stored conversation (a copy's worth: callers only read it), or None when
        unknown, expired, evicted or another tenant's."""
        self._evict()
        entry = self._entries.get(rid)
        if entry is None or entry.tenant != tenant:
            return None
        return entry.messages

    def _evict(self) -> None:
        now = self.clock()
        while self._entries:
            rid, oldest = next(iter(self._entries.items()))
            if (oldest.expires > now and len(self._entries) <= self.max_entries
                    and self.chars <= self.max_chars):
                return
            self._drop(rid)

    def _drop(self, rid: str) -> None:
        entry = self._entries.pop(rid, None)
        if entry is not None:
            self.chars -= entry.chars
