"""The CPU engine's resident memory: what it imports and what it gives back.

TorchDynamo (and with it Triton) costs ~150 MB resident once imported; an eager CPU
engine never needs it. It used to be pulled in by building the model on the meta
device with initialisers on, and by calling the custom ops through the dispatcher.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from llmserve.kernels.cpu.gemm import packing_available
from llmserve.platforms.memory import release_freed_memory

ENGINE_RUN = textwrap.dedent("""
    import sys
    from llmserve import SamplingParams
    from llmserve.config import EngineConfig
    from llmserve.engine.llm_engine import LLMEngine
    engine = LLMEngine(EngineConfig(model=sys.argv[1], kv_cache_memory=1 << 22,
                                    quantization=sys.argv[2]))
    engine.add_request(list(range(5, 40)), SamplingParams(max_tokens=4, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    print(sorted(m for m in ("torch._dynamo", "torch._inductor", "triton")
                 if m in sys.modules))
""")


def _modules_after_a_request(model, quantization: str, dtype: str | None = None) -> str:
    env = dict(os.environ, **({"LLMSERVE_CPU_DTYPE": dtype} if dtype else {}))
    out = subprocess.run([sys.executable, "-c", ENGINE_RUN, str(model), quantization],
                         capture_output=True, text=True, timeout=300, check=True, env=env)
    return out.stdout.strip().splitlines()[-1]


def test_an_eager_cpu_engine_never_imports_the_compiler(tiny_llama):
    assert _modules_after_a_request(tiny_llama, "none") == "[]"


@pytest.mark.skipif(not packing_available(), reason="oneDNN has no bf16 kernels on this CPU")
def test_a_bf16_engine_with_packed_weights_never_imports_the_compiler(tiny_llama):
    """bf16 packs its dense linears through torch.ops.mkldnn (kernels/cpu_linear)."""
    assert _modules_after_a_request(tiny_llama, "none", "bfloat16") == "[]"


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_eager_engine_never_imports_the_compiler(tiny_llama, mode):
    assert _modules_after_a_request(tiny_llama, mode) == "[]"


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))


def test_release_freed_memory_returns_heap_pages_to_the_os():
    # Many small blocks live in the heap (large ones are mmapped and returned at
    # free), and freeing them leaves the pages resident until a trim.
    blocks = [bytearray(64 << 10) for _ in range(2000)]  # 128 MiB
    keep = blocks[-1]  # the heap's top stays in use: free() alone cannot shrink it
    del blocks
    before = _rss_kib()
    assert release_freed_memory()
    assert before - _rss_kib() > 64 << 10, (before, _rss_kib())
    del keep
