"""--dtype auto on CPUs: bf16 with native bf16 arithmetic, float32 elsewhere, and the
knobs that restrict the instruction set are honoured (how CI tests both paths)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from llmserve.platforms.cpu import CpuFeatures, cpu_features, onednn_allows_amx


@pytest.mark.parametrize("features, native", [
    (CpuFeatures("AVX512", amx_bf16=True, avx512_bf16=True, onednn_max_isa=None), True),
    (CpuFeatures("AVX512", amx_bf16=False, avx512_bf16=True, onednn_max_isa=None), True),
    (CpuFeatures("AVX512", amx_bf16=False, avx512_bf16=False, onednn_max_isa=None), False),
    (CpuFeatures("AVX2", amx_bf16=False, avx512_bf16=False, onednn_max_isa=None), False),
    (CpuFeatures("AVX2", amx_bf16=True, avx512_bf16=True, onednn_max_isa=None), False),
    (CpuFeatures("AVX512", amx_bf16=True, avx512_bf16=True, onednn_max_isa="AVX2"), False),
    (CpuFeatures("AVX512", amx_bf16=True, avx512_bf16=True,
                 onednn_max_isa="AVX512_CORE_AMX"), True),
])
def test_native_bf16_decision(features, native):
    assert features.native_bf16 is native


@pytest.mark.parametrize("isa, allows", [
    (None, True), ("ALL", True), ("default", True), ("AVX512_CORE_AMX", True),
    ("AVX512_CORE_AMX_FP16", True), ("AVX512_CORE_BF16", False), ("AVX2", False),
    ("AVX512_CORE_VNNI", False)])
def test_onednn_max_isa_below_amx_leaves_amx_out(isa, allows):
    """An AMX Xeon told AVX512_CORE_BF16 acts as Zen 4 (no AMX in the features, and our
    kernels built without it: test_cpu_int8_panels checks the routing)."""
    assert onednn_allows_amx(isa) is allows


def auto_dtype_in_a_fresh_process(env_extra: dict) -> str:
    env = {k: v for k, v in os.environ.items() if k != "LLMSERVE_CPU_DTYPE"}
    env.update(env_extra)
    code = ("from llmserve.config import EngineConfig; "
            "print(EngineConfig(model='none', device='cpu').dtype)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, check=True)
    return out.stdout.strip()


def test_auto_dtype_follows_this_cpu_and_the_avx2_restriction():
    native = cpu_features().native_bf16
    assert auto_dtype_in_a_fresh_process({}) == ("bfloat16" if native else "float32")
    forced = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    assert auto_dtype_in_a_fresh_process(forced) == "float32"
    assert auto_dtype_in_a_fresh_process({"LLMSERVE_CPU_DTYPE": "float32"}) == "float32"


def test_device_cuda_without_cuda_refuses_instead_of_serving_on_the_cpu():
    """The operator's GPU pods pass --device cuda: a node whose runtime hides the GPU
    must fail the pod, not serve on its CPU (no GPU visible, here or anywhere)."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run([sys.executable, "-m", "llmserve", "serve", "--device", "cuda",
                          "--port", "1"], capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode != 0
    assert "--device cuda, but CUDA is not available" in run.stderr, run.stderr
    assert "Traceback" not in run.stderr
