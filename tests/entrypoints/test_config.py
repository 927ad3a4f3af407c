"""EngineConfig is the one place for the engine's settings: the CLI's flags are built
from its fields, its choices are checked whichever way a config arrives, and it imports
neither torch nor pydantic until a config is made (the gateway parses the same command
line; the GPU machine's image has no pydantic)."""

from __future__ import annotations

import argparse
import subprocess
import sys
from dataclasses import fields

import pytest

from llmserve.config import QUANTIZATION_MODES, EngineConfig
from llmserve.entrypoints.cli import ENGINE_KEYS, add_engine_args


def test_importing_the_config_and_the_cli_loads_neither_torch_nor_pydantic():
    code = ("import sys, llmserve.entrypoints.cli; "
            "print(sorted(m for m in ('torch', 'pydantic') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60)
    assert out.stdout.strip() == "[]"


def test_every_field_but_the_deliberate_ones_is_a_flag():
    """A new field is a flag unless it says otherwise (watermark: a tuning constant;
    seed: `generate`'s --seed is the sampling seed; dtype_from_cpu, use_cuda_graphs and
    cuda_graphs_off_because: how a default was decided, not settings)."""
    assert {f.name for f in fields(EngineConfig)} - set(ENGINE_KEYS) == {
        "watermark", "seed", "dtype_from_cpu", "use_cuda_graphs", "cuda_graphs_off_because"}


def test_flags_take_their_defaults_and_choices_from_the_fields():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    by_dest = {a.dest: a for a in parser._actions}
    assert by_dest["quantization"].choices == QUANTIZATION_MODES
    assert by_dest["swap_space"].default == 1 << 30 and by_dest["swap_space"].type is int
    assert by_dest["engine_max_queue_delay"].type is float
    args = parser.parse_args([])
    assert args.model == EngineConfig.model and args.enable_prefix_caching is True


@pytest.mark.parametrize("field,value,message", [
    ("quantization", "int2", "quantization must be 'auto', 'none', 'int8' or 'int4'"),
    ("preemption_mode", "drop", "preemption_mode must be 'recompute' or 'swap'"),
    ("attention_backend", "flash", "attention_backend must be 'auto', 'triton' or 'torch'"),
])
def test_choices_are_checked_without_the_cli(field, value, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(device="cpu", **{field: value})


# GatewayConfig is the gateway's EngineConfig: `llmserve gateway` and `up` build their
# gateway flags from its fields.

def test_every_gateway_field_but_the_deliberate_ones_is_a_flag():
    """eject_seconds, max_body_bytes: tuning constants; api_keys: `up`'s --api-key; the
    three timeouts: the server flags `gateway` shares with `serve`."""
    from llmserve.entrypoints.cli import GATEWAY_FIELDS
    from llmserve.gateway.config import GatewayConfig
    assert {f.name for f in fields(GatewayConfig)} - {f.name for f in GATEWAY_FIELDS} == {
        "eject_seconds", "max_body_bytes", "api_keys", "drain_timeout", "header_timeout",
        "body_timeout"}


@pytest.mark.parametrize("command", ["gateway", "up"])
def test_gateway_flags_take_their_defaults_from_the_config(command, monkeypatch):
    from llmserve.entrypoints.cli import build_parser, gateway_config
    from llmserve.gateway.config import GatewayConfig
    monkeypatch.delenv("LLMSERVE_UPSTREAM_API_KEY", raising=False)
    args = build_parser().parse_args([command])
    assert gateway_config(args, []) == GatewayConfig(backends=[])
    monkeypatch.setenv("LLMSERVE_UPSTREAM_API_KEY", "sk-up")  # that flag's default
    args = build_parser().parse_args([command])
    assert gateway_config(args, []).upstream_api_key == "sk-up"


def given_values(flags) -> tuple[list[str], dict]:
    """A command line that sets each of ``flags`` to a value other than its default,
    and the values the config should then hold."""
    import typing

    from llmserve.entrypoints.config_flags import flag_name, value_type
    from llmserve.gateway.config import GatewayConfig
    hints = typing.get_type_hints(GatewayConfig)
    argv, want = [], {}
    for f in flags:
        kind = value_type(hints[f.name])
        value = (f.metadata["choices"][-1] if f.metadata["choices"]
                 else {int: 7, float: 0.5, str: "ns/name"}[kind])
        if f.metadata.get("action") == "append":
            argv += [flag_name(f), f"{value}-1", flag_name(f), f"{value}-2"]
            want[f.name] = [f"{value}-1", f"{value}-2"]
        else:
            argv += [flag_name(f), str(value)]
            want[f.name] = value
    return argv, want


def test_each_gateway_flag_reaches_its_field():
    from llmserve.entrypoints.cli import GATEWAY_FIELDS, build_parser, gateway_config
    argv, want = given_values(GATEWAY_FIELDS)
    args = build_parser().parse_args(["gateway", *argv, "--header-timeout", "3"])
    config = gateway_config(args, args.backends)
    assert {name: getattr(config, name) for name in want} == want
    assert config.header_timeout == 3


def test_up_passes_its_gateway_flags_on_under_their_up_names():
    from llmserve.entrypoints.cli import GATEWAY_FIELDS, build_parser, gateway_config
    engines_own = ("backends", "k8s_service", "k8s_port_name", "prefill_backends",
                   "prefill_k8s_service", "otlp_traces_endpoint")
    argv, want = given_values([f for f in GATEWAY_FIELDS if f.name not in engines_own])
    argv[argv.index("--max-waiting")] = "--gateway-max-waiting"
    args = build_parser().parse_args(["up", *argv, "--otlp-traces-endpoint", "http://c:4318"])
    config = gateway_config(args, ["http://127.0.0.1:1"])
    assert {name: getattr(config, name) for name in want} == want
    assert config.backends == ["http://127.0.0.1:1"]
    assert config.otlp_traces_endpoint == "http://c:4318"  # the engines' flag
