"""``--lora-modules`` entries: ``NAME=SOURCE``, or vLLM's JSON form
``{"name": NAME, "path": SOURCE}``. No torch here: the config parses them."""

from __future__ import annotations

import json
import re

# What a client may put in "model" and the operator in spec.adapters[].name.
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")


def check_lora_name(name: str) -> str:
    if not isinstance(name, str) or not NAME_PATTERN.match(name):
        raise ValueError(f"adapter name {name!r} must be 1-128 letters, digits and ._:/- "
                         f"starting with a letter or digit")
    return name


def parse_lora_modules(entries: list[str]) -> list[tuple[str, str]]:
    """(name, source) of each entry, in order; ValueError naming a bad or repeated one."""
    modules, seen = [], set()
    for entry in entries:
        if entry.lstrip().startswith("{"):
            try:
                spec = json.loads(entry)
                name, source = spec["name"], spec["path"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"--lora-modules {entry!r}: the JSON form needs "
                                 f'{{"name": ..., "path": ...}} ({e})') from e
        else:
            name, sep, source = entry.partition("=")
            if not sep or not source:
                raise ValueError(f"--lora-modules {entry!r}: expected NAME=SOURCE")
        check_lora_name(name)
        if name in seen:
            raise ValueError(f"--lora-modules names {name!r} twice")
        seen.add(name)
        modules.append((name, source))
    return modules
