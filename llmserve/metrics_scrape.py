"""Numbers out of Prometheus text (a /metrics page), for the operator, the gateway and
the launcher's callers; imports nothing of llmserve. Parsing is prometheus_client's;
fetching stays with each caller (sync or async, its own timeouts)."""

from __future__ import annotations

from collections.abc import Collection

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample


def samples(text: str) -> list[Sample]:
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def sum_by_name(text: str, names: Collection[str] | None = None) -> dict[str, float]:
    """Each sample name's value summed over its label sets (a pod may export several
    engines); only ``names`` when given."""
    out: dict[str, float] = {}
    for s in samples(text):
        if names is None or s.name in names:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def by_series(text: str) -> dict[str, float]:
    """Each sample under ``name{k="v",...}`` (labels sorted; the bare name when it has
    none), plus each labelled name summed over its label sets under the bare name."""
    out: dict[str, float] = {}
    for s in samples(text):
        labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
        out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        if labels:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out
