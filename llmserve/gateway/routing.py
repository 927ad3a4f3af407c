"""Routing policies: which engine endpoint serves a request.

``prefix-hash`` is consistent hashing with bounded loads (CHWBL): each endpoint
owns many virtual nodes on a hash ring; a request's prefix key hashes to a point
and walks clockwise to the first endpoint whose in-flight load is within
``load_factor`` of the mean. Requests that share a prefix therefore land on the
engine that already holds that prefix in its KV cache, but a hot prefix spills to
the next endpoints on the ring instead of piling onto one. The ring is a pure
function of the endpoint set, so gateway replicas agree without sharing state.

Every policy first drops endpoints that are *saturated* (scraped queue depth or
KV usage over threshold), unless all are.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

VIRTUAL_NODES = 256
RING_CACHE_SIZE = 32


def hash64(text: str | bytes) -> int:
    return xxhash.xxh64_intdigest(text.encode() if isinstance(text, str) else text)


@dataclass
class Candidate:
    """What a policy needs to know of one endpoint."""
    url: str
    in_flight: int = 0
    saturated: bool = False


@dataclass
class Decision:
    url: str
    reason: str  # "hash" (ring owner), "bounded" (walked past loaded ones), "least-load", ...


class HashRing:
    def __init__(self, urls: Sequence[str], virtual_nodes: int = VIRTUAL_NODES):
        points = sorted((hash64(f"{url}#{i}"), url) for url in set(urls)
                        for i in range(virtual_nodes))
        self._hashes = [h for h, _ in points]
        self._urls = [u for _, u in points]

    def walk(self, key: str):
        """Endpoints in ring order from the key's point, each once."""
        if not self._hashes:
            return
        start = bisect.bisect(self._hashes, hash64(key)) % len(self._hashes)
        seen = set()
        for i in range(len(self._hashes)):
            url = self._urls[(start + i) % len(self._urls)]
            if url not in seen:
                seen.add(url)
                yield url

    def owner(self, key: str) -> str | None:
        return next(self.walk(key), None)


def unsaturated(candidates: Sequence[Candidate]) -> list[Candidate]:
    ok = [c for c in candidates if not c.saturated]
    return ok or list(candidates)


class PrefixHashPolicy:
    name = "prefix-hash"

    def __init__(self, load_factor: float = 1.25, virtual_nodes: int = VIRTUAL_NODES):
        if load_factor < 1.0:
            raise ValueError("load_factor must be >= 1")
        self.load_factor = load_factor
        self.virtual_nodes = virtual_nodes
        # Rings by endpoint set: requests for different adapters see different sets
        # (the engines holding each), and building a ring per request would cost more
        # than routing it.
        self._rings: dict[frozenset[str], HashRing] = {}

    def ring(self, urls) -> HashRing:
        urls = frozenset(urls)
        ring = self._rings.pop(urls, None)
        if ring is None:
            ring = HashRing(sorted(urls), self.virtual_nodes)
            if len(self._rings) >= RING_CACHE_SIZE:
                del self._rings[next(iter(self._rings))]  # the least recently used
        self._rings[urls] = ring  # (re)inserted last: most recently used
        return ring

    def bound(self, candidates: Sequence[Candidate]) -> float:
        """Most in-flight requests an endpoint may hold to take one more (KubeAI's
        bound: (total + 1) / n x load factor)."""
        total = sum(c.in_flight for c in candidates)
        return math.ceil((total + 1) / len(candidates) * self.load_factor)

    def choose(self, candidates: Sequence[Candidate], key: str) -> Decision:
        pool = unsaturated(candidates)
        by_url = {c.url: c for c in pool}
        # The ring is built over every endpoint, saturated or not, so keys do not
        # move while an endpoint is briefly busy.
        ring = self.ring(c.url for c in candidates)
        bound = self.bound(pool)
        for i, url in enumerate(ring.walk(key)):
            c = by_url.get(url)
            if c is not None and c.in_flight + 1 <= bound:
                return Decision(url, "hash" if i == 0 else "bounded")
        return LeastLoadPolicy().choose(pool, key)


class LeastLoadPolicy:
    name = "least-load"

    def choose(self, candidates: Sequence[Candidate], key: str = "") -> Decision:
        pool = unsaturated(candidates)
        best = min(pool, key=lambda c: (c.in_flight, hash64(f"{key}|{c.url}")))
        return Decision(best.url, "least-load")


class RoundRobinPolicy:
    name = "round-robin"

    def __init__(self):
        self._counter = itertools.count()

    def choose(self, candidates: Sequence[Candidate], key: str = "") -> Decision:
        pool = sorted(unsaturated(candidates), key=lambda c: c.url)
        return Decision(pool[next(self._counter) % len(pool)].url, "round-robin")


POLICIES = {"prefix-hash": PrefixHashPolicy, "least-load": LeastLoadPolicy,
            "round-robin": RoundRobinPolicy}


def make_policy(name: str, load_factor: float = 1.25):
    if name not in POLICIES:
        raise ValueError(f"unknown routing policy {name!r}; choose from {sorted(POLICIES)}")
    return PrefixHashPolicy(load_factor) if name == "prefix-hash" else POLICIES[name]()
