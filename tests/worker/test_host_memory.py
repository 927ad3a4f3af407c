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
from llmserve.platforms.memory import library_ranges, release_freed_memory

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


THREAD_ARENA = textwrap.dedent("""
    import threading
    from llmserve.platforms import memory

    def rss_mib():
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) for l in f if l.startswith("VmRSS")) / 1024

    found = {}

    def work():  # a thread of its own: its blocks come from a glibc arena of its own
        big = bytearray(24 << 20)  # mmapped; freeing it raises glibc's thresholds
        del big
        blocks = [bytearray(1 << 20) for _ in range(32)]  # now from the arena, touched
        del blocks  # free again, and merged into the arena's top
        found["held"] = rss_mib()
        memory._libc().malloc_trim(0)
        found["malloc_trim"] = rss_mib()
        memory.release_freed_memory()
        found["released"] = rss_mib()

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    print(found["held"], found["malloc_trim"], found["released"])
""")


def test_release_freed_memory_returns_a_thread_arenas_top():
    """The engine thread's memory lives in a glibc arena of its own, whose free top
    malloc_trim leaves resident (it trims only the main arena's): release_freed_memory
    hands it back too (the server's idle RSS read 572-621 MiB run to run before)."""
    from llmserve.platforms.memory import _libc
    if _libc() is None or not hasattr(_libc(), "mallopt"):
        pytest.skip("not glibc: no malloc_trim or mallopt")
    # glibc's own defaults: no allocator preloaded, no thresholds or arenas set
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("MALLOC_", "GLIBC_TUNABLES", "LD_PRELOAD"))}
    out = subprocess.run([sys.executable, "-c", THREAD_ARENA], capture_output=True,
                         text=True, timeout=120, check=True, env=env)
    held, after_malloc_trim, released = map(float, out.stdout.split())
    assert held - after_malloc_trim < 8, out.stdout  # why the extra step exists
    assert held - released > 24, out.stdout


def test_library_ranges_are_the_shared_libraries_mappings():
    """Libraries only (a weights file served from an mmap must stay resident), by the
    file's name: lib.so, lib.so.13, an extension module; not a name that only holds
    ".so", a deleted or anonymous mapping."""
    maps = textwrap.dedent("""\
        7f0000000000-7f0000100000 r-xp 00000000 08:01 11 /s/site-packages/nvidia/cu13/lib/libx.so.13
        7f0000100000-7f0000200000 rw-p 00000000 00:00 0
        7f0000200000-7f0000201000 r--p 00000000 08:01 12 /s/torch/lib/libtorch_cpu.so
        7f0000300000-7f0000400000 r--p 00000000 08:01 13 /models/m/model.safetensors
        7f0000400000-7f0000402000 r-xp 00000000 08:01 14 /s/_C.cpython-311-x86_64-linux-gnu.so
        7f0000500000-7f0000501000 rw-s 00000000 00:01 15 /dev/zero (deleted)
        7f0000600000-7f0000700000 r--p 00000000 08:01 16 /data/a.so.d/weights.gguf
        7f0000700000-7f0000701000 r-xp 00000000 08:01 17 /usr/lib/libpython3.11.so.1.0
        7f0000800000-7f0000801000 r-xp 00000000 00:00 0  [vdso]
        """)
    assert library_ranges(maps) == [(0x7F0000000000, 0x100000), (0x7F0000200000, 0x1000),
                                    (0x7F0000400000, 0x2000), (0x7F0000700000, 0x1000)]


PAGE_OUT_RUN = textwrap.dedent("""
    import mmap, os, sys
    from llmserve.platforms.memory import page_out_libraries

    def rss_kib(path):
        total, counting = 0, False
        with open(f"/proc/{os.getpid()}/smaps") as f:
            for line in f:
                head = line.split()
                if "-" in head[0] and ":" not in head[0]:  # a mapping's first line
                    counting = head[-1] == path
                elif counting and line.startswith("Rss:"):
                    total += int(line.split()[1])
        return total

    path = sys.argv[1]  # a library file, mapped by this process only
    with open(path, "rb") as f:
        lib = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    touched = sum(lib[i] for i in range(0, len(lib), 4096))  # every page resident
    before = rss_kib(path)
    accepted = page_out_libraries()
    print(before, rss_kib(path), accepted, sum(lib[i] for i in range(0, len(lib), 4096)) == touched)
""")


def test_a_cpu_process_hands_back_its_librarys_pages(tmp_path):
    """Importing torch and loading a model leave ~250 MB of library pages resident
    (PyPI's CUDA build's CUDA libraries, libtorch_cpu's initialisers) that a CPU
    process never touches again. page_out_libraries has Linux reclaim them: a library
    file (clean, mapped by this process only, as in a server's pod; pages that other
    processes map too, like this test runner's torch, are kept) is no longer
    resident, and reads the same afterwards."""
    lib = tmp_path / "site-packages" / "fake" / "lib" / "libfake.so.1"
    lib.parent.mkdir(parents=True)
    with open(lib, "wb") as f:
        f.write(os.urandom(8 << 20))
        f.flush()
        os.fsync(f.fileno())  # clean pages: reclaim drops them without writing
    out = subprocess.run([sys.executable, "-c", PAGE_OUT_RUN, str(lib)],
                         capture_output=True, text=True, timeout=300, check=True)
    before, after, accepted, same = out.stdout.split()
    if int(accepted) == 0:
        pytest.skip("this kernel has no MADV_PAGEOUT (Linux < 5.4), or refused it")
    assert int(before) >= 8 << 10
    assert int(after) < int(before) / 4, (before, after)
    assert same == "True"
