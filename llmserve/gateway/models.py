"""Which models each engine serves: its base model and its LoRA adapters.

An engine's ``GET /v1/models`` lists its base model first and then one entry per
loaded adapter, whose ``parent`` names the base (vLLM's shape, so real vLLM pods
work too). The gateway reads it with every scrape of the engine (endpoints.py) and
uses it three ways: a request for an adapter goes only to engines that hold it
(``EndpointPool.candidates``), the gateway's own ``/v1/models`` lists the union, and
the request metrics are labelled with base model and adapter (``labels_for``).

Everything here is pure: lists of model entries in, answers out.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from aiohttp import web

# A generation request's (base model, adapter), set when it arrives, read by every
# metric that counts it (server.py, admission.py).
MODEL_LABELS = web.RequestKey("model_labels", tuple)
# Label value for a model name no engine lists: request bodies come from clients, so
# their names must not become label values (each would be a new series forever).
UNKNOWN_MODEL = "unknown"


def parse_model_list(payload) -> dict[str, dict]:
    """An OpenAI model list (``{"data": [{"id": ...}, ...]}``) -> {id: entry}, in the
    engine's order; entries without a string id are skipped. ValueError if the payload
    is not a model list at all."""
    if not isinstance(payload, dict) or not isinstance(payload.get("data"), list):
        raise ValueError("not an OpenAI model list")
    models: dict[str, dict] = {}
    for entry in payload["data"]:
        if isinstance(entry, dict) and isinstance(entry.get("id"), str):
            models.setdefault(entry["id"], entry)
    return models


def parent_of(entry: Mapping) -> str | None:
    """The base model an adapter entry names; None for a base model."""
    parent = entry.get("parent")
    return parent if isinstance(parent, str) and parent else None


def is_adapter(model: str, catalogues: Iterable[Mapping[str, dict] | None]) -> bool:
    """Whether any engine lists ``model`` as an adapter (an entry with a parent)."""
    return any(c is not None and model in c and parent_of(c[model]) is not None
               for c in catalogues)


def labels_for(model, catalogues: Iterable[Mapping[str, dict] | None]) -> tuple[str, str]:
    """(base model, adapter) metric labels of a request for ``model``: an adapter is
    labelled with its parent and its own name, a base model with its name and "";
    no model is ("", ""), a name no engine lists (UNKNOWN_MODEL, "")."""
    if not isinstance(model, str) or not model:
        return "", ""
    known = False
    for catalogue in catalogues:
        entry = catalogue.get(model) if catalogue else None
        if entry is None:
            continue
        parent = parent_of(entry)
        if parent is not None:
            return parent, model
        known = True
    return (model, "") if known else (UNKNOWN_MODEL, "")


def merge_model_lists(catalogues: Iterable[Mapping[str, dict] | None]) -> list[dict]:
    """The union of the engines' lists, each id once (the first engine's entry):
    base models first, then adapters, each group in the order first seen."""
    merged: dict[str, dict] = {}
    for catalogue in catalogues:
        for model_id, entry in (catalogue or {}).items():
            merged.setdefault(model_id, entry)
    bases = [e for e in merged.values() if parent_of(e) is None]
    adapters = [e for e in merged.values() if parent_of(e) is not None]
    return bases + adapters
