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
