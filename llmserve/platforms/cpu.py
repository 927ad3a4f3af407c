"""What the CPU can do fast, and the dtype the engine serves in.

bf16 pays on a CPU only where it has native bf16 arithmetic: AMX-BF16 (Intel Xeon
Sapphire Rapids and later) or AVX512-BF16 (AMD Zen 4, Intel Cooper Lake). Measured on
these machines, ``F.linear`` [M,576]x[576,1536]: AVX512-BF16 EPYC fp32 0.42 ms vs bf16
0.19 ms at M=32; AMX Xeon fp32 174 vs bf16 717 GFLOP/s at M=64; but on an AVX2-only
EPYC bf16 ran at 1.2 GFLOP/s, far below fp32. So ``--dtype auto`` is bf16 with native
bf16 support and fp32 elsewhere, with one exception the engine makes once it knows the
checkpoint: a 4-bit GGUF served int4 on an AVX-512 CPU without bf16 arithmetic is
stored in bf16 (its kernels compute in float32: ``quantization.bf16_storage_for_int4``).

The choice honours the knobs that restrict the kernels' instruction set:
``ATEN_CPU_CAPABILITY`` (ATen's own vector kernels) and ``ONEDNN_MAX_CPU_ISA`` (oneDNN's
GEMMs): a machine told to act as AVX2 gets the AVX2 choice, which is also how CI tests
both paths on one machine; an AMX Xeon told ``ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16``
acts as a CPU with AVX512-BF16 and no AMX (Zen 4, Cooper Lake), our kernels included.
``LLMSERVE_CPU_DTYPE`` overrides the automatic CPU
choice for a whole process tree (the test suite sets float32, so outputs compare
exactly with transformers on any machine; bf16 is tested where a test asks for it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmserve import envs

# oneDNN ISA names below AVX512_CORE_BF16 (see oneDNN's cpu_isa_t): no native bf16.
_ONEDNN_WITHOUT_BF16 = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE",
                        "AVX512_CORE_VNNI")


@dataclass(frozen=True)
class CpuFeatures:
    aten_isa: str  # what ATen's vector kernels use: DEFAULT, AVX2, AVX512 ...
    amx_bf16: bool
    avx512_bf16: bool
    onednn_max_isa: str | None

    @property
    def native_bf16(self) -> bool:
        if not (self.amx_bf16 or self.avx512_bf16) or self.aten_isa not in ("AVX512",):
            return False
        return (self.onednn_max_isa or "ALL").upper() not in _ONEDNN_WITHOUT_BF16

    def describe(self) -> str:
        extras = [name for name, on in (("amx_bf16", self.amx_bf16),
                                        ("avx512_bf16", self.avx512_bf16)) if on]
        return f"{self.aten_isa}{'+' + '+'.join(extras) if extras else ''}"


def onednn_allows_amx(onednn_max_isa: str | None) -> bool:
    """Whether ``ONEDNN_MAX_CPU_ISA`` leaves AMX in: unset, ALL/DEFAULT, or an AMX ISA
    name. Below it (AVX512_CORE_BF16: an AMX Xeon acting as a Zen 4) our kernels are
    built without AMX as well (``kernels/cpu/native.py``)."""
    isa = (onednn_max_isa or "ALL").upper()
    return isa in ("ALL", "DEFAULT") or "AMX" in isa


def cpu_features() -> CpuFeatures:
    caps = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
    return CpuFeatures(aten_isa=torch.backends.cpu.get_cpu_capability(),
                       amx_bf16=bool(caps.get("amx_bf16"))
                       and onednn_allows_amx(envs.ONEDNN_MAX_CPU_ISA),
                       avx512_bf16=bool(caps.get("avx512_bf16")),
                       onednn_max_isa=envs.ONEDNN_MAX_CPU_ISA)


def dtype_from_cpu_features(device: str) -> bool:
    """Whether ``auto_dtype(device)`` is decided by the CPU's features (not by CUDA,
    nor by ``LLMSERVE_CPU_DTYPE``)."""
    return not device.startswith("cuda") and not envs.LLMSERVE_CPU_DTYPE


def auto_dtype(device: str) -> str:
    """``--dtype auto``: bf16 on CUDA and on CPUs with native bf16, else float32."""
    if device.startswith("cuda"):
        return "bfloat16"
    if envs.LLMSERVE_CPU_DTYPE:
        return envs.LLMSERVE_CPU_DTYPE
    if cpu_features().native_bf16:
        return "bfloat16"
    return "float32"
