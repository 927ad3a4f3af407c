"""``kv_transfer_params``: the request-level contract of the two legs, in vLLM's shape.

Leg 1 asks a prefill engine ``{"do_remote_decode": true}``; its answer carries a
``RemotePrefill`` (who holds the blocks, where, until when). Leg 2 hands that object,
unchanged, to a decode engine. Parsing is strict: a peer (or a client that bypassed
the gateway) sending a malformed object gets a ValueError naming the bad field, which
the HTTP layer answers 400.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from array import array
from dataclasses import asdict, dataclass, replace

# Bounds that keep a forged object from asking for absurd work.
MAX_BLOCK_IDS = 1 << 20
# A host name or an IPv4/IPv6 address, nothing else (no spaces, no URL).
_HOST = re.compile(r"^[A-Za-z0-9._:-]{1,253}$")


@dataclass(frozen=True)
class RemoteDecode:
    """Leg 1: prefill only, hold the KV for a decode engine to read."""


@dataclass(frozen=True)
class RemotePrefill:
    """Leg 2: the prompt's KV is held by ``remote_engine_id`` at host:port."""
    remote_engine_id: str
    remote_host: str
    remote_port: int
    remote_lease_id: str
    remote_block_ids: list[int]
    num_tokens: int  # prompt tokens the blocks cover (whole blocks)
    expires_at: float  # unix seconds
    model: str
    do_remote_prefill: bool = True
    do_remote_decode: bool = False
    # HMAC of the other fields under the deployment's secret, by the prefill engine that
    # issued them: a decode engine uses only params a real prefill engine wrote, so a
    # client cannot point it at a listener of its own or reorder the blocks.
    signature: str = ""

    def to_json(self) -> dict:
        return asdict(self)

    def signed(self, secret: bytes | None) -> RemotePrefill:
        return replace(self, signature=self._mac(secret)) if secret else self

    def verify(self, secret: bytes | None) -> bool:
        return secret is None or hmac.compare_digest(self.signature, self._mac(secret))

    def _mac(self, secret: bytes) -> str:
        fields = {k: v for k, v in self.to_json().items() if k != "signature"}
        text = json.dumps(fields, sort_keys=True, separators=(",", ":"))
        return hmac.new(secret, text.encode(), hashlib.sha256).hexdigest()


_FIELDS = {"remote_engine_id": str, "remote_host": str, "remote_port": int,
           "remote_lease_id": str, "remote_block_ids": list, "num_tokens": int,
           "expires_at": (int, float), "model": str}


def parse_kv_transfer_params(obj) -> RemoteDecode | RemotePrefill | None:
    """The request's ``kv_transfer_params``: None (absent or asking nothing), a
    RemoteDecode (leg 1) or a RemotePrefill (leg 2). ValueError names the bad field."""
    if obj is None:
        return None
    if not isinstance(obj, dict):
        raise ValueError("kv_transfer_params must be an object")
    if obj.get("do_remote_prefill") is True:
        return _remote_prefill(obj)
    if obj.get("do_remote_decode") is True:
        return RemoteDecode()
    for key in ("do_remote_prefill", "do_remote_decode"):
        if key in obj and not isinstance(obj[key], bool):
            raise ValueError(f"kv_transfer_params.{key} must be a boolean")
    return None


def _remote_prefill(obj: dict) -> RemotePrefill:
    for name, kind in _FIELDS.items():
        value = obj.get(name)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise ValueError(f"kv_transfer_params.{name} is missing or not a "
                             f"{getattr(kind, '__name__', 'number')}")
    ids = obj["remote_block_ids"]
    if len(ids) > MAX_BLOCK_IDS or not all(
            isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in ids):
        raise ValueError("kv_transfer_params.remote_block_ids must be a list of block "
                         "ids (integers >= 0)")
    if not 0 < obj["remote_port"] < 65536:
        raise ValueError("kv_transfer_params.remote_port must be a TCP port")
    if obj["num_tokens"] < 0:
        raise ValueError("kv_transfer_params.num_tokens must be >= 0")
    if not _HOST.match(obj["remote_host"]):
        raise ValueError("kv_transfer_params.remote_host must be a host name or address")
    signature = obj.get("signature", "")
    if not isinstance(signature, str):
        raise ValueError("kv_transfer_params.signature must be a string")
    return RemotePrefill(**{name: obj[name] for name in _FIELDS}, signature=signature)


def prompt_digest(token_ids: list[int]) -> str:
    """What both sides compare before a read: the blocks must hold this prompt's KV."""
    return hashlib.blake2b(array("q", token_ids).tobytes(), digest_size=16).hexdigest()
