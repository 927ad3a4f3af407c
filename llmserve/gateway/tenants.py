"""The tenants file: traffic classes, tenants, their API keys, weights and limits.

    classes:                      # lower priority number = more urgent (the engine's)
      - {name: interactive, priority: 0, queueTimeoutSeconds: 5, maxQueued: 500}
      - {name: batch, priority: 10, queueTimeoutSeconds: 600, maxQueued: 20000,
         minShare: 0.05}
    defaultClass: interactive
    tenants:
      - name: acme
        apiKeys: ["sk-acme-1"]          # or apiKeySha256: ["<hex>"]
        weight: 2
        classes: [interactive, batch]
        limits: {rpm: 600, tpm: 200000, maxConcurrency: 32}

A request's tenant is its API key's tenant (a client cannot name another), and its
class is the ``x-priority-class`` header if its tenant may use it, else the default.
``TenantsFile`` re-reads the file when it changes (a mounted Secret is updated in
place) and keeps the last good version when an edit is invalid.
"""

from __future__ import annotations

import hashlib
import logging
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from llmserve.errors import APIError

log = logging.getLogger(__name__)

CLASS_HEADER = "x-priority-class"


class TenantsError(ValueError):
    """A tenants file that cannot be used; the message says where and why."""


@dataclass(frozen=True)
class TrafficClass:
    name: str
    priority: int
    queue_timeout_s: float = 30.0
    max_queued: int = 1000
    min_share: float = 0.0


@dataclass(frozen=True)
class Limits:
    rpm: int | None = None
    tpm: int | None = None
    max_concurrency: int | None = None


@dataclass(frozen=True)
class Tenant:
    name: str
    weight: float = 1.0
    classes: tuple[str, ...] = ()
    limits: Limits = field(default_factory=Limits)


@dataclass(frozen=True)
class TenantsConfig:
    classes: dict[str, TrafficClass]
    default_class: str
    tenants: dict[str, Tenant]
    key_hashes: dict[str, str]  # sha256 hex of an API key -> tenant name

    def tenant_for_key(self, key: str) -> Tenant | None:
        name = self.key_hashes.get(hashlib.sha256(key.encode()).hexdigest())
        return None if name is None else self.tenants[name]

    def class_for(self, tenant: Tenant, requested: str | None) -> TrafficClass:
        """The class a request runs in: the one it asks for, if its tenant may use it;
        else the default class, or the tenant's first if it may not use the default."""
        if not requested:
            name = self.default_class if self.default_class in tenant.classes \
                else tenant.classes[0]
            return self.classes[name]
        name = requested.strip()
        if name not in self.classes:
            raise APIError(400, f"unknown priority class {name!r}; classes are "
                           f"{sorted(self.classes)}", param=CLASS_HEADER)
        if name not in tenant.classes:
            raise APIError(403, f"tenant {tenant.name!r} may not use priority class {name!r} "
                           f"(allowed: {list(tenant.classes)})", "permission_error",
                           param=CLASS_HEADER)
        return self.classes[name]

    @property
    def classes_by_urgency(self) -> list[TrafficClass]:
        return sorted(self.classes.values(), key=lambda c: c.priority)


# --- parsing ------------------------------------------------------------------------
def _number(where: str, value, *, integer: bool, low: float, high: float = math.inf,
            low_open: bool = False):
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind):
        raise TenantsError(f"{where} must be {'an integer' if integer else 'a number'}, "
                           f"not {value!r}")
    if value < low or (low_open and value == low) or value > high:
        bound = f"> {low}" if low_open else f">= {low}"
        raise TenantsError(f"{where} must be {bound}" +
                           (f" and <= {high}" if high != math.inf else "") + f", not {value}")
    return value


def _mapping(where: str, value, allowed: set[str], required: set[str] = frozenset()) -> dict:
    if not isinstance(value, dict):
        raise TenantsError(f"{where} must be a mapping, not {type(value).__name__}")
    unknown = set(value) - allowed
    if unknown:
        raise TenantsError(f"{where}: unknown field(s) {sorted(unknown)}; "
                           f"allowed: {sorted(allowed)}")
    missing = required - set(value)
    if missing:
        raise TenantsError(f"{where}: missing field(s) {sorted(missing)}")
    return value


NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")


def _name(where: str, value) -> str:
    """Names travel in headers and metric labels: letters, digits, '.', '_', '-'."""
    if not isinstance(value, str) or not NAME.fullmatch(value):
        raise TenantsError(f"{where} must be 1-63 letters, digits, '.', '_' or '-' "
                           f"(starting with a letter or digit), not {value!r}")
    return value


def _parse_class(i: int, raw) -> TrafficClass:
    where = f"classes[{i}]"
    raw = _mapping(where, raw, {"name", "priority", "queueTimeoutSeconds", "maxQueued",
                                "minShare"}, {"name", "priority"})
    return TrafficClass(
        name=_name(f"{where}.name", raw["name"]),
        priority=_number(f"{where}.priority", raw["priority"], integer=True, low=-1000,
                         high=1000),
        queue_timeout_s=float(_number(f"{where}.queueTimeoutSeconds",
                                      raw.get("queueTimeoutSeconds", 30), integer=False,
                                      low=0, low_open=True, high=86400)),
        max_queued=_number(f"{where}.maxQueued", raw.get("maxQueued", 1000), integer=True,
                           low=1, high=10_000_000),
        min_share=float(_number(f"{where}.minShare", raw.get("minShare", 0.0),
                                integer=False, low=0, high=0.5)))


def _parse_keys(where: str, raw: dict) -> list[str]:
    hashes = []
    keys = raw.get("apiKeys", [])
    if not isinstance(keys, list) or not all(isinstance(k, str) and k for k in keys):
        raise TenantsError(f"{where}.apiKeys must be a list of non-empty strings")
    hashes += [hashlib.sha256(k.encode()).hexdigest() for k in keys]
    for h in raw.get("apiKeySha256", []) if isinstance(raw.get("apiKeySha256", []), list) \
            else [None]:
        if not isinstance(h, str) or len(h) != 64 or any(c not in "0123456789abcdef"
                                                         for c in h.lower()):
            raise TenantsError(f"{where}.apiKeySha256 must be a list of 64-character "
                               f"hex SHA-256 digests")
        hashes.append(h.lower())
    if not hashes:
        raise TenantsError(f"{where} needs at least one key in apiKeys or apiKeySha256")
    return hashes


def _parse_tenant(i: int, raw, classes: dict[str, TrafficClass]) -> tuple[Tenant, list[str]]:
    where = f"tenants[{i}]"
    raw = _mapping(where, raw, {"name", "apiKeys", "apiKeySha256", "weight", "classes",
                                "limits"}, {"name"})
    name = _name(f"{where}.name", raw["name"])
    allowed = raw.get("classes", sorted(classes))
    if not isinstance(allowed, list) or not allowed:
        raise TenantsError(f"{where}.classes must be a non-empty list of class names")
    for c in allowed:
        if c not in classes:
            raise TenantsError(f"{where}.classes: unknown class {c!r}; classes are "
                               f"{sorted(classes)}")
    limits = _mapping(f"{where}.limits", raw.get("limits", {}),
                      {"rpm", "tpm", "maxConcurrency"})
    parsed = {k: _number(f"{where}.limits.{k}", v, integer=True, low=1)
              for k, v in limits.items() if v is not None}
    tenant = Tenant(name=name,
                    weight=float(_number(f"{where}.weight", raw.get("weight", 1),
                                         integer=False, low=0, low_open=True, high=1000)),
                    classes=tuple(allowed),
                    limits=Limits(parsed.get("rpm"), parsed.get("tpm"),
                                  parsed.get("maxConcurrency")))
    return tenant, _parse_keys(where, raw)


def parse_tenants_file(data: bytes, where: str) -> TenantsConfig:
    """``parse_tenants`` of a file's bytes; every error names ``where`` it came from."""
    try:
        return parse_tenants(data.decode())
    except UnicodeDecodeError as e:
        raise TenantsError(f"{where}: not UTF-8 text") from e
    except TenantsError as e:
        raise TenantsError(f"{where}: {e}") from e


def parse_tenants(text: str) -> TenantsConfig:
    """Parse and validate a tenants file; TenantsError says what is wrong."""
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise TenantsError(f"not valid YAML: {e}") from e
    raw = _mapping("the tenants file", raw, {"classes", "defaultClass", "tenants"},
                   {"classes", "tenants"})
    if not isinstance(raw["classes"], list) or not raw["classes"]:
        raise TenantsError("classes must be a non-empty list")
    classes: dict[str, TrafficClass] = {}
    for i, c in enumerate(raw["classes"]):
        parsed = _parse_class(i, c)
        if parsed.name in classes:
            raise TenantsError(f"classes[{i}]: duplicate class name {parsed.name!r}")
        classes[parsed.name] = parsed
    default = raw.get("defaultClass", next(iter(classes)))
    if default not in classes:
        raise TenantsError(f"defaultClass {default!r} is not a class; classes are "
                           f"{sorted(classes)}")
    if not isinstance(raw["tenants"], list) or not raw["tenants"]:
        raise TenantsError("tenants must be a non-empty list")
    tenants: dict[str, Tenant] = {}
    key_hashes: dict[str, str] = {}
    for i, t in enumerate(raw["tenants"]):
        tenant, hashes = _parse_tenant(i, t, classes)
        if tenant.name in tenants:
            raise TenantsError(f"tenants[{i}]: duplicate tenant name {tenant.name!r}")
        tenants[tenant.name] = tenant
        for h in hashes:
            if key_hashes.get(h, tenant.name) != tenant.name:
                raise TenantsError(f"tenants[{i}]: an API key of {tenant.name!r} is also "
                                   f"a key of {key_hashes[h]!r}")
            key_hashes[h] = tenant.name
    return TenantsConfig(classes, default, tenants, key_hashes)


class TenantsFile:
    """A tenants file on disk, re-read when its modification time changes. An invalid
    edit is logged and counted, and the last good configuration stays in force."""

    def __init__(self, path: str):
        self.path = Path(path)
        self.digest = ""
        self._mtime: int | None = None
        self.config = self._load()  # the first read must succeed
        self.reload_errors = 0

    def _load(self) -> TenantsConfig:
        try:
            data = self.path.read_bytes()
            self._mtime = self.path.stat().st_mtime_ns
        except OSError as e:
            raise TenantsError(f"cannot read the tenants file: {e}") from e
        config = parse_tenants_file(data, str(self.path))
        # Peers share the file, so its digest authenticates their counter exchange.
        self.digest = hashlib.sha256(b"llmserve-peers\0" + data).hexdigest()
        return config

    def current(self) -> TenantsConfig:
        try:
            mtime = self.path.stat().st_mtime_ns
        except OSError:
            return self.config  # a Secret's atomic swap: briefly absent
        if mtime != self._mtime:
            try:
                self.config = self._load()
                log.info("reloaded tenants file %s", self.path)
            except TenantsError as e:
                self.reload_errors += 1
                log.error("keeping the previous tenants: %s", e)
        return self.config
