"""argparse flags made from a config dataclass's ``flag()`` fields (llmserve/flags.py):
EngineConfig's for ``serve``, ``generate`` and ``up``, GatewayConfig's for ``gateway``
and ``up``. A flag's name, default, type, choices and help are its field's, so none is
spelled twice; a flag's dest is its field's name unless the caller renames it (under
``up`` the engine and the gateway each have a ``max_waiting``)."""

from __future__ import annotations

import argparse
import typing
from dataclasses import Field, fields

from llmserve import envs


def flag_fields(config_class: type) -> tuple[Field, ...]:
    """The fields of ``config_class`` that are flags, in their order."""
    return tuple(f for f in fields(config_class) if "help" in f.metadata)


def flag_name(f: Field) -> str:
    """--max-num-seqs; the field's own ``option`` where it names one (--tenants for
    tenants_file); a switch that is on by default is turned off: --no-prefix-caching for
    enable_prefix_caching."""
    if "option" in f.metadata:
        return f.metadata["option"]
    if f.default is True:
        return "--no-" + f.name.removeprefix("enable_").replace("_", "-")
    return "--" + f.name.replace("_", "-")


def value_type(hint) -> type:
    """What argparse converts a value to: int | None -> int; str | list[int] | None ->
    str (EngineConfig parses the list); list[str] | None (nargs="+", "append") -> str."""
    args = typing.get_args(hint)
    direct = [t for t in (int, float, str) if t is hint or t in args]
    if direct:
        return direct[0]
    inner = [a for arg in args for a in typing.get_args(arg)]
    return next(t for t in (int, float, str) if t in inner)


def add_flag(group, f: Field, hint, dest: str, name: str) -> None:
    meta = f.metadata
    default = getattr(envs, meta["env"]) if "env" in meta else f.default
    kwargs = {"dest": dest, "default": default, "help": meta["help"] or None}
    if isinstance(f.default, bool):
        kwargs["action"] = "store_false" if f.default else "store_true"
    elif hint == bool | None:  # default None (decided by the config): --x and --no-x
        kwargs["action"] = argparse.BooleanOptionalAction
    else:
        kwargs.update(type=value_type(hint), choices=meta["choices"],
                      metavar=meta.get("metavar"), nargs=meta.get("nargs"),
                      action=meta.get("action", "store"))
    group.add_argument(name, *meta.get("aliases", ()), **kwargs)


def add_flags(parser: argparse.ArgumentParser, config_class: type,
              flags: typing.Iterable[Field], section: str, *,
              dests: dict[str, str] | None = None,
              names: dict[str, str] | None = None) -> None:
    """``flags`` (fields of ``config_class``) in their order, each in the help section
    its ``group`` names (``section`` if none; None: the command's own options).
    ``dests`` / ``names``: field name -> argparse dest / flag name, where not the
    field's own."""
    hints = typing.get_type_hints(config_class)
    groups: dict[str | None, typing.Any] = {None: parser}
    for f in flags:
        title = f.metadata.get("group", section)
        if title not in groups:
            groups[title] = parser.add_argument_group(title)
        add_flag(groups[title], f, hints[f.name], (dests or {}).get(f.name, f.name),
                 (names or {}).get(f.name) or flag_name(f))


def config_kwargs(args: argparse.Namespace, flags: typing.Iterable[Field],
                  dests: dict[str, str] | None = None) -> dict:
    """The config's keyword arguments from the parsed ``flags``."""
    return {f.name: getattr(args, (dests or {}).get(f.name, f.name)) for f in flags}
