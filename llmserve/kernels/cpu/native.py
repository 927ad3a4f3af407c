"""The CPU kernels (``decode.c``: decode attention, rotary + K/V store, RMSNorm;
``decoder.c``: the decoder stack built on them, with ``panel.h``'s float32 and
``panel_int8.h``'s int8 panel GEMMs; ``dequant.c``: int4 weights in
float32 for CPUs without bf16 arithmetic; ``gemm.c``: bf16 linears
on AVX512-BF16; ``q8_rows.c``: int8 weight-only products (the LM head); ``lora.c``: a
projection's multi-LoRA), compiled for this machine into one library (``cpu_library``).

Compiled once with the system C compiler (``$CC`` or ``cc``, a few seconds) for the CPU
it runs on (``-march=native``; AVX2 + FMA when ``ATEN_CPU_CAPABILITY=avx2`` asks torch to
act as an AVX2 machine, the baseline ISA for ``default``, without AMX when
``ONEDNN_MAX_CPU_ISA`` leaves it out; ``$LLMSERVE_CPU_MARCH``, for tests, another kind
the CPU can run, e.g. ``icelake-server``), cached under the llmserve
cache folder keyed by the sources and header, the compiler, the flags and the CPU, and
called through ctypes (which releases the GIL), typed by one table (SIGNATURES, checked
against ``kernels.h``). Each call runs on torch's thread count; with torch's own
``libgomp.so.1`` already loaded, the kernel shares its thread pool too.

Why ctypes and not torch custom ops (``benchmarks/cpu/kernel_binding.py``): a bf16 decode
step makes 5-9 calls a layer, and a Python custom op's dispatch costs several times a
ctypes call; a C++ op would save little more but needs torch's headers, a C++ compiler
and a minutes-long build per CPU and torch version on every machine, where this C
builds in seconds. The price: torch.compile'd layers do not call these kernels (the
loader binds them to torch's ops: ``model_executor/layers/backends.py``).

Where no compiler is found or the build fails, ``cpu_library()`` returns None and
the engine keeps the pure-torch path (``attention.py``), with one warning.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shlex
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import torch

from llmserve import envs
from llmserve.envs import cache_root
from llmserve.platforms.cpu import onednn_allows_amx

log = logging.getLogger(__name__)

# Attention, rotary and norms; the decoder stack built on them; int4 weights in
# float32; bf16 GEMMs;
# int8 products (the LM head); multi-LoRA: one library.
SOURCES = [Path(__file__).with_name(name)
           for name in ("decode.c", "decoder.c", "dequant.c", "gemm.c", "q8_rows.c",
                        "lora.c")]
HEADERS = [Path(__file__).with_name(name)  # in the key
           for name in ("kernels.h", "panel.h", "panel_int8.h")]
# Reassociation lets the compiler vectorise the dot products and sums; no
# finite-math: softmax inputs are finite here, but the flag would change too much.
CFLAGS = ["-O3", "-fPIC", "-shared", "-fopenmp", "-fno-math-errno", "-fno-trapping-math",
          "-fassociative-math", "-fno-signed-zeros", "-ffp-contract=fast"]
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}

_I32, _I64, _F32, _PTR = ctypes.c_int, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
# Every entry point of the library, as kernels.h declares it: its argument types in
# order (int -> c_int, int64_t -> c_int64, float -> c_float, any pointer -> c_void_p).
# Each returns int (0: done; the failure codes at the definition). ctypes trusts this
# table blindly, so a test checks it against the header, and the compiler checks the
# header against the definitions.
SIGNATURES: dict[str, list[type]] = {
    # decode.c
    "paged_decode": [_I32, _PTR, _I64, _PTR, _PTR, _PTR, _PTR, _I32, _PTR, _PTR, _I32, _I64,
                     _I32, _I32, _I32, _I32, _F32, _PTR, _F32, _I32],
    "rope_and_cache": [_I32, _PTR, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, _I32, _I64, _I32, _I32,
                       _I32, _I32, _I32],
    "add_rms_norm_bf16": [_I32, _PTR, _PTR, _PTR, _PTR, _PTR, _I32, _I32, _F32],
    "silu_and_mul_bf16": [_I32, _PTR, _I32, _I64, _PTR],
    "argmax_rows_bf16": [_I32, _PTR, _I32, _I64, _I64, _PTR],
    # decoder.c
    "panel_int8": [],
    "q4_int8_min_rows": [],
    "q4_linear_bf16": [_I32, _PTR, _I32, _PTR, _I32, _PTR, _I32],
    "stack_decode_layers": [_I32, _PTR, _PTR, _I32, _PTR, _I32, _PTR, _PTR, _PTR, _PTR, _I32,
                         _PTR],
    # dequant.c
    "q4_dequant_f32": [_I32, _PTR, _I32, _I64, _I64, _PTR],
    # gemm.c
    "bf16_gemm_available": [],
    "bf16_gemm": [_I32, _PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, _PTR, _I64],
    "bf16_gemm_pack": [_I32, _PTR, _I64, _I64, _PTR],
    "quant_gemm": [_I32, _PTR, _I64, _I64, _PTR, _PTR, _I32, _I64, _I64, _PTR, _PTR, _I64],
    "gemm_use_amx": [_I32],
    # q8_rows.c
    "panel_gemms": [],
    "q8_int8_built": [],
    "q8_rows_bf16": [_I32, _PTR, _I64, _I64, _PTR, _PTR, _I64, _I64, _PTR, _PTR, _I64, _I32],
    # lora.c
    "lora_add_rows": [_I32, _PTR, _I64, _I64, _PTR, _I64, _I64, _I64, _I32, _PTR, _PTR, _I32,
                      _PTR, _PTR, _I32, _I32, _I32, _I64, _PTR],
}


def _bind(lib: ctypes.CDLL) -> None:
    """Types every entry point of ``lib`` from SIGNATURES: the one place the Python side
    states the C ABI."""
    for name, argtypes in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, ctypes.c_int


def _march() -> list[str]:
    if envs.LLMSERVE_CPU_MARCH:  # tests: another CPU kind this one can run
        return [f"-march={envs.LLMSERVE_CPU_MARCH}"]  # (icelake-server on an AMX Xeon)
    isa = envs.ATEN_CPU_CAPABILITY.lower()
    if isa == "avx2":
        return ["-march=haswell"]  # AVX2 + FMA, what torch's AVX2 kernels assume
    if isa == "default" or platform.machine() not in ("x86_64", "AMD64"):
        return []  # the compiler's baseline for the architecture
    if "amx_tile" in _cpu_signature().split() and not onednn_allows_amx(
            envs.ONEDNN_MAX_CPU_ISA):  # an AMX Xeon acting as a Zen 4
        return ["-march=native", "-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"]
    return ["-march=native"]


def _cpu_signature() -> str:
    """What -march=native depends on: x86's "flags" line, arm's "Features"."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("flags", "Features"))]
    except OSError:
        lines = []
    return platform.machine() + (lines[0] if lines else "")


def _private_dir(path: Path) -> Path | None:
    """``path``, created 0700 if missing, if it is ours and nobody else may write it:
    a library loaded from a directory another user controls would run their code."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = path.stat()
    except OSError:
        return None
    if st.st_uid != os.getuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return None
    return path


def _build_dir() -> Path | None:
    root = cache_root() / "kernels"
    try:
        root.mkdir(parents=True, exist_ok=True)
        if os.access(root, os.W_OK):
            return root
    except OSError:
        pass
    # A read-only cache (the image's): a private folder of our own under /tmp.
    return _private_dir(Path(tempfile.gettempdir()) / f"llmserve-kernels-{os.getuid()}")


def _compile(compiler: list[str], flags: list[str]) -> Path:
    version = subprocess.run([*compiler, "--version"], capture_output=True, text=True,
                             timeout=30).stdout
    texts = [src.read_text() for src in SOURCES + HEADERS]
    key = hashlib.sha256("\0".join([*texts, " ".join(compiler), version, *flags,
                                    _cpu_signature()]).encode()).hexdigest()[:16]
    build_dir = _build_dir()
    if build_dir is None:
        raise OSError("no writable folder of our own to build the kernel in")
    out_dir = build_dir / key
    target = out_dir / "kernels.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        subprocess.run([*compiler, *flags, *map(str, SOURCES), "-o", tmp], check=True,
                       capture_output=True, text=True, timeout=120)
        os.replace(tmp, target)  # atomic: concurrent engines never load half a file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@functools.cache
def panel_gemms_built() -> bool:
    """Whether the library has panel.h's GEMMs (AVX-512 and AVX2 builds): q8_rows of any
    number of rows, int4 products of 16+ rows, the C decoder stack to 128 rows where
    quant_gemm does not take its products. Asked once."""
    lib = cpu_library()
    return lib is not None and lib.panel_gemms() == 1


@functools.cache
def panel_int8_block_n() -> int:
    """The column block of ATen's int4 pack that the library's int8 panels read (64: an
    AVX-512 VNNI build; 32: an AVX2 build), or 0: no such panels
    (panel_int8.h). Asked once."""
    lib = cpu_library()
    return 0 if lib is None else lib.panel_int8()


def panel_int8_built() -> bool:
    """Whether the library can round x to int8 for int4 products of many rows."""
    return panel_int8_block_n() > 0


@functools.cache
def q4_int8_min_rows() -> int:
    """The fewest rows whose int4 products the library rounds x to int8 for, where asked
    (decoder.c's Q4_INT8_ROWS: 1 on AVX2, whose float32 tiles are slower than the
    weight's stream, 3 on AVX-512 VNNI), or 0: no int8 panels. Asked once."""
    lib = cpu_library()
    return 0 if lib is None or not panel_int8_built() else lib.q4_int8_min_rows()


@functools.cache
def q8_rows_int8_built() -> bool:
    """Whether q8_rows.c can round x to int8 for the int8 LM head (AVX-512 VNNI builds,
    and AVX2 ones, which take the weight as two int4 weights of nibbles). Asked once."""
    lib = cpu_library()
    return lib is not None and lib.q8_int8_built() == 1


@functools.cache
def cpu_library():
    """The compiled library of every CPU kernel (a ``ctypes.CDLL`` whose entry points
    SIGNATURES types), or None: no compiler, a failed build, or
    ``LLMSERVE_CPU_KERNELS=torch`` (the torch paths are used)."""
    if envs.LLMSERVE_CPU_KERNELS == "torch":
        return None
    cc = envs.CC or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        log.warning("no C compiler found: CPU decode attention uses the slower torch path")
        return None
    try:
        lib = ctypes.CDLL(str(_compile(shlex.split(cc), [*CFLAGS, *_march()])))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or e
        log.warning("building the CPU decode kernel failed (%s): using the torch path",
                    detail)
        return None
    _bind(lib)
    return lib


def argmax_applies(x: torch.Tensor) -> bool:
    """``argmax_rows``' domain: an eager 2-D bf16 CPU tensor, with the kernels built (the
    sampler's logits are bf16 or float32 from step to step: tensor-parallel ranks
    gather float32)."""
    return (x.dim() == 2 and x.dtype == torch.bfloat16 and x.device.type == "cpu"
            and not torch.compiler.is_compiling() and cpu_library() is not None)


def silu_and_mul(gate_up: torch.Tensor, intermediate: int) -> torch.Tensor:
    """``F.silu(gate) * up`` of the fused projection ``gate_up [..., 2 * intermediate]``
    (bf16, gate columns first) in one pass, instead of a split, two ops and a temporary
    (rounding as torch's; see ``silu_and_mul_bf16``)."""
    gate_up = gate_up.contiguous()
    rows = gate_up.numel() // (2 * intermediate)
    act = torch.empty(*gate_up.shape[:-1], intermediate, dtype=gate_up.dtype)
    cpu_library().silu_and_mul_bf16(torch.get_num_threads(), gate_up.data_ptr(), rows,
                                      intermediate, act.data_ptr())
    return act


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` of a 2-D bf16 tensor whose rows are contiguous (a column
    slice of logits is fine): greedy sampling without a float32 copy of the logits."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(x.shape[0], dtype=torch.int64)
    cpu_library().argmax_rows_bf16(torch.get_num_threads(), x.data_ptr(), x.shape[0],
                                     x.shape[1], x.stride(0), out.data_ptr())
    return out


def add_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 delta: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of bf16 rows in one call, computed as Hugging Face does (float32
    statistics; normalised rows rounded to bf16, then times the weight). With
    ``delta``: (x + delta, its norm), the decoder layer's residual add fused in.
    Returns (residual, normed); the residual is ``x`` itself without ``delta``."""
    dim = x.shape[-1]
    x = x.contiguous()
    out = torch.empty_like(x)
    residual = x if delta is None else torch.empty_like(x)
    delta_ptr = None if delta is None else delta.contiguous().data_ptr()
    rc = cpu_library().add_rms_norm_bf16(
        torch.get_num_threads(), x.data_ptr(), delta_ptr, weight.data_ptr(), out.data_ptr(),
        None if delta is None else residual.data_ptr(), x.numel() // dim, dim, eps)
    if rc != 0:
        raise ValueError(f"add_rms_norm: rows of {dim} unsupported (at most 16384)")
    return residual, out


def _check_cache(kv_cache: torch.Tensor, dtype: torch.dtype) -> None:
    if dtype not in DTYPE_CODES or kv_cache.dtype != dtype:
        raise ValueError(f"CPU kernels: tensors {dtype}, cache {kv_cache.dtype}: one dtype "
                         f"of {sorted(map(str, DTYPE_CODES))}")
    if not kv_cache.is_contiguous():
        raise ValueError("CPU kernels: the layer cache must be contiguous")


def rope_and_cache(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   kv_cache: torch.Tensor, slots: torch.Tensor, num_heads: int) -> torch.Tensor:
    """The rotary embedding of one step's fused projection ``qkv [tokens, heads + 2 *
    kv_heads, head_dim]`` (``cos``, ``sin`` ``[tokens, head_dim / 2]`` float32): the
    rotated K and the V of token t stored at flat slot ``slots[t]`` (int64) of the layer
    cache, the rotated queries returned ``[tokens, heads, head_dim]``. One call where the
    torch path takes a dozen ops."""
    _, num_blocks, block_size, kv_heads, head_dim = kv_cache.shape
    _check_cache(kv_cache, qkv.dtype)
    tokens = qkv.shape[0]
    if qkv.shape[1:] != (num_heads + 2 * kv_heads, head_dim) or qkv.stride(1) != head_dim \
            or qkv.stride(2) != 1:
        qkv = qkv.contiguous().view(tokens, num_heads + 2 * kv_heads, head_dim)
    cos = cos.reshape(tokens, -1).float().contiguous()
    sin = sin.reshape(tokens, -1).float().contiguous()
    slots = slots.to(torch.int64).contiguous()
    q = torch.empty(tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    rc = cpu_library().rope_and_cache(
        torch.get_num_threads(), qkv.data_ptr(), qkv.stride(0), q.data_ptr(),
        kv_cache.data_ptr(), cos.data_ptr(), sin.data_ptr(), slots.data_ptr(), tokens,
        num_blocks, block_size, num_heads, kv_heads, head_dim, DTYPE_CODES[qkv.dtype])
    if rc != 0:
        raise ValueError(f"rope_and_cache: head_dim {head_dim} unsupported (even, <= 512)")
    return q


def paged_decode(q: torch.Tensor, out: torch.Tensor, kv_cache: torch.Tensor,
                 q_rows: torch.Tensor, tables: torch.Tensor, seq_lens: torch.Tensor,
                 scale: float, first_keys: torch.Tensor | None = None,
                 sinks: torch.Tensor | None = None, softcap: float | None = None) -> None:
    """``out[q_rows[i]]`` = sequence i's new token attending over its cached context,
    from key ``first_keys[i]`` on (int32; a sliding window's start) or all of it.
    ``sinks``: ``[num_heads]`` logits joining each head's softmax denominator only
    (attention sinks); ``softcap``: scores become ``softcap * tanh(scores / softcap)``.
    ``q`` may be a view whose token rows are strided (the split of a fused QKV), but
    each head's ``head_dim`` values contiguous; ``out``, ``kv_cache`` (one layer:
    ``[2, blocks, block_size, kv_heads, head_dim]``), and the int32 ``q_rows``,
    ``tables`` ``[seqs, max_blocks]`` and ``seq_lens`` contiguous."""
    _, num_blocks, block_size, kv_heads, head_dim = kv_cache.shape
    num_heads = q.shape[1]
    _check_cache(kv_cache, q.dtype)
    if out.dtype != q.dtype or not out.is_contiguous():
        raise ValueError("paged_decode: out must be contiguous, in q's dtype")
    if num_heads % kv_heads or q.shape[2] != head_dim:
        raise ValueError(f"paged_decode: {num_heads} query heads of {q.shape[2]} over "
                         f"{kv_heads} KV heads of {head_dim}")
    if q.stride(2) != 1 or q.stride(1) != head_dim:
        q = q.contiguous()  # the kernel steps over token rows only
    if sinks is not None:
        if sinks.shape != (num_heads,):
            raise ValueError(f"paged_decode: sinks of shape {tuple(sinks.shape)}, "
                             f"not ({num_heads},)")
        sinks = sinks.detach().float().contiguous()  # kept alive until the call returns
    rc = cpu_library().paged_decode(
        torch.get_num_threads(), q.data_ptr(), q.stride(0), out.data_ptr(),
        kv_cache.data_ptr(), q_rows.data_ptr(), tables.data_ptr(), tables.shape[1],
        None if first_keys is None else first_keys.data_ptr(), seq_lens.data_ptr(),
        seq_lens.shape[0], num_blocks, block_size, num_heads, kv_heads,
        head_dim, scale, None if sinks is None else sinks.data_ptr(), softcap or 0.0,
        DTYPE_CODES[q.dtype])
    if rc != 0:
        raise MemoryError("paged_decode: out of memory for its scratch buffers")



def lora_rows_args(rows: torch.Tensor, starts: torch.Tensor) -> tuple[int, int, int]:
    """``lora_add_rows``' groups: group g's rows are ``rows[starts[g]:starts[g + 1]]``
    (int64 and int32, contiguous; kept alive by the caller while the result is used)."""
    if rows.dtype != torch.int64 or starts.dtype != torch.int32 \
            or not (rows.is_contiguous() and starts.is_contiguous()):
        raise ValueError("lora_add_rows: rows int64, starts int32, both contiguous")
    return rows.data_ptr(), starts.data_ptr(), starts.shape[0] - 1


def lora_weights_args(a: torch.Tensor, bt: torch.Tensor, slice_ends: torch.Tensor) -> tuple:
    """``lora_add_rows``' weights (kept alive by the caller while the result is used):
    ``a`` ``[G, n*r, K]``; ``bt`` ``[G, r, N]``, column c of slice i holding that
    slice's B row (its r ranks down the column); ``slice_ends``: each slice's end
    column (int64 ``[n]``). ``a`` and ``bt`` contiguous, of one dtype (float32, bf16)."""
    n, r = slice_ends.shape[0], bt.shape[1]
    if a.dtype != bt.dtype or a.dtype not in DTYPE_CODES:
        raise ValueError(f"lora_add_rows: weights {a.dtype} and {bt.dtype}: one dtype of "
                         f"{sorted(map(str, DTYPE_CODES))}")
    if a.dim() != 3 or a.shape[1] != n * r or bt.shape[0] != a.shape[0] \
            or slice_ends.dtype != torch.int64 or int(slice_ends[-1]) != bt.shape[2] \
            or not (a.is_contiguous() and bt.is_contiguous() and slice_ends.is_contiguous()):
        raise ValueError(f"lora_add_rows: a {tuple(a.shape)}, bt {tuple(bt.shape)} and "
                         f"{n} slices ending at {slice_ends.tolist()} do not fit")
    return (a.data_ptr(), bt.data_ptr(), DTYPE_CODES[a.dtype], n, r, a.shape[2],
            slice_ends.data_ptr())


def lora_add_rows(y: torch.Tensor, x: torch.Tensor, rows_args: tuple[int, int, int],
                  weights_args: tuple) -> None:
    """``y[rows of group g] += (x[those rows] @ A_g.T) @ B_g.T`` in place, every slice of
    every group in one call (``lora.c``), rounded once into y; the groups and weights
    as ``lora_rows_args`` and ``lora_weights_args`` return them (prepared once: a step
    calls this for every projection). ``x`` ``[T, K]`` and ``y`` ``[T, N]`` with
    contiguous rows, of one dtype (float32 or bf16)."""
    if x.dtype != y.dtype or x.dtype not in DTYPE_CODES or x.stride(-1) != 1 \
            or y.stride(-1) != 1 or x.dim() != 2 or y.dim() != 2:
        raise ValueError(f"lora_add_rows: x {x.dtype} {tuple(x.shape)}, y {y.dtype} "
                         f"{tuple(y.shape)}: 2-D, contiguous rows, one dtype of "
                         f"{sorted(map(str, DTYPE_CODES))}")
    rc = cpu_library().lora_add_rows(
        torch.get_num_threads(), x.data_ptr(), x.stride(0), x.shape[1], y.data_ptr(),
        y.stride(0), y.shape[1], min(x.shape[0], y.shape[0]), DTYPE_CODES[x.dtype],
        *rows_args, *weights_args)
    if rc == -1:
        raise ValueError(f"lora_add_rows: x {tuple(x.shape)} and y {tuple(y.shape)} do not "
                         f"fit the weights (K {weights_args[5]}) or the groups' rows")
    if rc != 0:
        raise MemoryError("lora_add_rows: out of memory for its scratch buffers")


def amx_tiles(want: bool | None = None) -> bool:
    """Whether gemm.c multiplies with AMX tiles (TDPBF16PS) rather than AVX512-BF16 dot
    products: where it was built for an AMX CPU and Linux grants the tile state.
    ``want`` switches them on or off for the process (tests and benchmarks compare
    both); None only asks. Layers bound before keep the kernels they chose."""
    lib = cpu_library()
    return lib is not None and lib.gemm_use_amx(-1 if want is None else int(want)) == 1
