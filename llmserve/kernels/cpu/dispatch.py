"""Which kernel computes a CPU linear: a table by CPU kind, weight format and row count
(``TABLE``), read once per layer when it is built (``bind``), never per call.

What a layer binds (``RowKernels``) is a short sorted list of row-count thresholds and a
kernel name for each class of rows: a forward looks its row count up once. The kernel
functions themselves are the layer's (``model_executor/layers/quantization.py`` maps
these names to them); this module knows tensors' shapes, never tensors.

How a choice is made, in order:

1. ``probe()`` reads what this process can run: whether the C library is built and for
   which ISA, gemm.c's AVX512-BF16 kernels, whether gemm.c multiplies through AMX tiles
   now, whether x is rounded to int8 (``gemm.rounds_x_to_int8``), whether int4 runs in
   float32 (``dequant.int4_runs_in_float32``), ATen's int4 pack layout, the thread
   count, and ``LLMSERVE_BF16_GEMM``.
2. ``cpu_kind`` and ``x_format`` name the row of the table (pure functions of the facts).
3. The row lists routes in priority order, each a kernel from a first row (to a last).
   ``bind`` keeps the routes whose kernel is available here and takes the layer's
   shape (``takes``), then gives each row count the first route that covers it; ATen's
   weight-only kernel covers what no route does.

A layer bound before ``amx_tiles(want)`` or an environment variable changes keeps its
kernels: tests and benchmarks that switch them build (or rebind) their layers after.
The routes' crossovers were measured with ``benchmarks/cpu/cpu_linear.py``,
``benchmarks/cpu/int8_products.py`` and ``benchmarks/cpu/cpu_many_rows.py``; the figures are in
docs/benchmarks.md, whose "CPU dispatch by CPU kind" table is this module's
``render_markdown()`` (``python -m llmserve.kernels.cpu.dispatch``).
"""

from __future__ import annotations

import bisect
import sys
from dataclasses import dataclass

import torch

from llmserve.kernels.cpu.decoder import int4_pack_block_n
from llmserve.kernels.cpu.dequant import int4_runs_in_float32
from llmserve.kernels.cpu.gemm import (
    amx_tiles,
    forced_backend,
    native_gemm_available,
    native_measured,
    quant_tiled_available,
    rounds_x_to_int8,
)
from llmserve.kernels.cpu.native import cpu_library, panel_gemms_built, panel_int8_block_n
from llmserve.platforms.cpu import cpu_features

# --- the kernels, by name ------------------------------------------------------------------
ATEN = "aten"  # ATen's weight-only kernel on the packed bytes (int4: nibbles; int8)
QUANT_GEMM = "quant_gemm"  # gemm.c: each group of panels dequantised to bf16 once, bf16 tiles
INT4_INT8X = "int4_panels_int8x"  # decoder.c with x rounded to int8 (panel_int8.h)
INT4_F32 = "int4_panels_f32"  # decoder.c in float32: its tiles, then panel.h's GEMM
INT4_DEQUANT = "int4_dequant_mkl"  # dequant.c writes the weight in float32 for MKL's GEMM
Q8_ROWS_INT8X = "q8_rows_int8x"  # q8_rows.c, x rounded to int8 where its grid allows
Q8_ROWS = "q8_rows"  # q8_rows.c in float32: its tiles, then panel.h's GEMM where built

KERNEL_NOTES = {
    ATEN: "ATen's weight-only kernel (`_weight_int4pack_mm_for_cpu`, `_weight_int8pack_mm`)",
    QUANT_GEMM: "`gemm.c` quant_gemm: panels dequantised to bf16, AMX tiles or VDPBF16PS",
    INT4_INT8X: "`decoder.c` int4 product, x rounded to int8 per group of 32 "
                "(`panel_int8.h`: VPDPBUSD; AVX2: VPMADDUBSW)",
    INT4_F32: "`decoder.c` int4 product in float32: its tiles, from 16 rows a GEMM over "
              "dequantised panels (`panel.h`)",
    INT4_DEQUANT: "`dequant.c`: the weight in float32, then MKL's float32 GEMM",
    Q8_ROWS_INT8X: "`q8_rows.c`, from 4 rows x rounded to int8 (k % 64, n % 32)",
    Q8_ROWS: "`q8_rows.c` in float32: tiles, from 12 rows a GEMM over panels where built",
}


# --- the table -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Route:
    """``kernel`` for products of ``first`` to ``last`` rows (None: any more), where it
    takes the layer's shape. ``off_int8_grid``: only for weights the int8 panels do not
    take (an int8 LM head whose n is no multiple of 32, say), which keep quant_gemm's
    crossover over the float32 kernels."""

    kernel: str
    first: int
    last: int | None = None
    off_int8_grid: bool = False


# The fewest rows whose products go through each kernel (docs/benchmarks.md, "CPU
# dispatch by CPU kind", has the crossovers). quant_gemm's tiles pay from 8 rows over
# ATen's kernels, but only from 24 on an AMX CPU multiplying without its tiles (VDPBF16PS
# there loses to ATen below). The int8 panels pay from 3 rows on AVX-512 VNNI, from 1 on
# AVX2 (decoder.c's Q4_INT8_ROWS, which the library reports: a test holds them equal).
# Without bf16 arithmetic the float32 panel GEMM pays from 16 rows and the dequantised
# float32 copy for MKL from 384 (long prefill chunks). q8_rows takes at most 8 rows
# where its panel GEMM is not built, or where quant_gemm takes many rows with x in bf16.
QUANT_GEMM_ROWS = 8
QUANT_GEMM_ROWS_UNTILED = 24
INT8X_ROWS = 3
INT8X_ROWS_AVX2 = 1
PANEL_MIN_ROWS = 16
DEQUANT_MIN_ROWS = 384
Q8_ROWS_MAX = 8

_F32_INT4 = (Route(INT4_F32, PANEL_MIN_ROWS, DEQUANT_MIN_ROWS - 1),
             Route(INT4_DEQUANT, DEQUANT_MIN_ROWS))


def _bf16_x(tiles_from: int, float32_int4: bool = False) -> dict[int, tuple[Route, ...]]:
    """A kind with gemm.c whose x stays bf16: quant_gemm from ``tiles_from`` rows; below,
    q8_rows for the int8 head and ATen for int4 (or, where int4 runs in float32, its
    float32 kernels, which quant_gemm leaves the shapes it does not take)."""
    return {4: (Route(QUANT_GEMM, tiles_from), *(_F32_INT4 if float32_int4 else ())),
            8: (Route(QUANT_GEMM, tiles_from), Route(Q8_ROWS, 1, Q8_ROWS_MAX))}


def _int8_x(int8_from: int, tiles_from: int | None) -> dict[int, tuple[Route, ...]]:
    """A kind that rounds x to int8: the int8 panels from ``int8_from`` rows for int4,
    q8_rows for any number of int8 rows; quant_gemm (where built) only for int8 weights
    off the panels' grid."""
    off_grid = (Route(QUANT_GEMM, tiles_from, off_int8_grid=True),) if tiles_from else ()
    return {4: (Route(INT4_INT8X, int8_from),), 8: (*off_grid, Route(Q8_ROWS_INT8X, 1))}


# (CPU kind, x format) -> weight bits -> routes, first match wins; ATen takes the rest.
TABLE: dict[tuple[str, str], dict[int, tuple[Route, ...]]] = {
    ("amx", "bf16"): _bf16_x(QUANT_GEMM_ROWS),
    ("amx", "float32"): _bf16_x(QUANT_GEMM_ROWS, float32_int4=True),
    ("amx_untiled", "int8"): _int8_x(INT8X_ROWS, QUANT_GEMM_ROWS_UNTILED),
    ("amx_untiled", "bf16"): _bf16_x(QUANT_GEMM_ROWS_UNTILED),
    ("amx_untiled", "float32"): _bf16_x(QUANT_GEMM_ROWS_UNTILED, float32_int4=True),
    ("avx512_bf16", "int8"): _int8_x(INT8X_ROWS, QUANT_GEMM_ROWS),
    ("avx512_bf16", "bf16"): _bf16_x(QUANT_GEMM_ROWS),
    ("avx512_bf16", "float32"): _bf16_x(QUANT_GEMM_ROWS, float32_int4=True),
    ("avx512", "int8"): _int8_x(INT8X_ROWS, None),
    ("avx512", "float32"): {4: _F32_INT4, 8: (Route(Q8_ROWS, 1),)},
    ("avx512", "bf16"): {4: (), 8: (Route(Q8_ROWS, 1),)},
    ("avx2", "int8"): _int8_x(INT8X_ROWS_AVX2, None),
    ("avx2", "float32"): {4: _F32_INT4, 8: (Route(Q8_ROWS, 1),)},
    ("avx2", "bf16"): {4: (), 8: (Route(Q8_ROWS, 1),)},
    ("baseline", "bf16"): {4: (), 8: (Route(Q8_ROWS, 1, Q8_ROWS_MAX),)},
    ("none", "bf16"): {4: (), 8: ()},
}

KINDS = {
    "amx": "AVX-512 with AMX, tiles in use (Sapphire Rapids and later)",
    "amx_untiled": "an AMX CPU whose tiles Linux does not grant (or `amx_tiles(False)`)",
    "avx512_bf16": "AVX512-BF16 without AMX (Zen 4, Cooper Lake; an AMX Xeon with "
                   "`ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16`)",
    "avx512": "AVX-512 without bf16 arithmetic (Ice Lake, Cascade Lake, Skylake-X)",
    "avx2": "AVX2 only (Zen 2/3, Haswell to Broadwell; `ATEN_CPU_CAPABILITY=avx2`)",
    "baseline": "the compiler's baseline ISA (`ATEN_CPU_CAPABILITY=default`, not x86)",
    "none": "no C kernels (`LLMSERVE_CPU_KERNELS=torch`, no compiler)",
}
X_FORMATS = {
    "int8": "x rounded to int8 (the default where the int8 panels are built and no AMX "
            "tiles are in use)",
    "bf16": "x in bf16 (AMX tiles in use, no int8 panels, or "
            "`LLMSERVE_CPU_INT8_ACTIVATIONS=0`)",
    "float32": "x not rounded, int4 computed in float32 (no bf16 arithmetic)",
}
# Dense bf16 linears, packed once at load (model_executor/layers/cpu_linear.py): gemm.c
# where built, but oneDNN's own AMX kernels on an AMX CPU without the tiles.
DENSE_BF16 = {"amx": "native", "avx512_bf16": "native"}


# --- what this process can run -------------------------------------------------------------
@dataclass(frozen=True)
class CpuFacts:
    """What the table is read with, probed from the build and the CPU (``probe``)."""

    library: bool  # the C kernels are built
    library_isa: str  # what they were built with: "avx512", "avx2", "baseline"
    bf16_gemm: bool  # gemm.c's AVX512-BF16 kernels (not the stub)
    amx_cpu: bool  # the CPU has AMX-BF16 and oneDNN may use it
    amx_tiles: bool  # gemm.c multiplies through AMX tiles now
    int8_x: bool  # x is rounded to int8 (gemm.rounds_x_to_int8)
    int4_in_float32: bool  # int4 runs in float32 (dequant.int4_runs_in_float32)
    int4_pack_block: int | None  # the column block of ATen's int4 pack
    quant_gemm_bits: frozenset[int]  # the weight widths quant_gemm runs for here
    gemm_forced: str  # LLMSERVE_BF16_GEMM: auto, native or onednn
    threads: int


def probe() -> CpuFacts:
    """This process's facts now (AMX tiles and the environment as they are)."""
    library = cpu_library() is not None
    block = panel_int8_block_n()
    isa = "baseline" if not panel_gemms_built() else "avx2" if block == 32 else "avx512"
    return CpuFacts(
        library=library, library_isa=isa, bf16_gemm=native_gemm_available(),
        amx_cpu=cpu_features().amx_bf16, amx_tiles=amx_tiles(),
        int8_x=rounds_x_to_int8(), int4_in_float32=int4_runs_in_float32(),
        int4_pack_block=int4_pack_block_n(),
        quant_gemm_bits=frozenset(b for b in (4, 8) if quant_tiled_available(b)),
        gemm_forced=forced_backend(), threads=torch.get_num_threads())


def cpu_kind(facts: CpuFacts) -> str:
    """The table's CPU kind for ``facts`` (``KINDS``)."""
    if not facts.library:
        return "none"
    if facts.bf16_gemm:
        return "amx" if facts.amx_tiles else "amx_untiled" if facts.amx_cpu else "avx512_bf16"
    return facts.library_isa


def x_format(facts: CpuFacts) -> str:
    """How the int4 and int8 products treat x here (``X_FORMATS``)."""
    if facts.int8_x:
        return "int8"
    return "float32" if facts.int4_in_float32 else "bf16"


def gemm_backend(facts: CpuFacts | None = None) -> str:
    """Who computes packed dense bf16 linears (``facts``: the CPU now): "native"
    (gemm.c) on AVX512-BF16 without AMX, and on AMX CPUs where Linux grants the tiles;
    "onednn" on an AMX CPU without the grant, where gemm.c's VDPBF16PS tiles lose to
    oneDNN's AMX kernels past a few rows. ``LLMSERVE_BF16_GEMM`` forces one ("native"
    only where gemm.c is built)."""
    facts = facts or probe()
    if facts.gemm_forced == "onednn" or not facts.bf16_gemm:
        return "onednn"
    if facts.gemm_forced == "native":
        return "native"
    return DENSE_BF16.get(cpu_kind(facts), "onednn")


def takes(route: Route, bits: int, k: int, n: int, facts: CpuFacts) -> bool:
    """Whether ``route``'s kernel runs here and takes a [n, k] weight of ``bits``: each
    kernel's grid, and quant_gemm only where built and (unless forced) on the shapes it
    was measured faster for (``gemm.native_measured``)."""
    if route.off_int8_grid and k % 64 == 0 and n % 32 == 0:
        return False
    if route.kernel == QUANT_GEMM:
        return (bits in facts.quant_gemm_bits and k % 32 == 0
                and n % (64 if bits == 4 else 16) == 0
                and (facts.gemm_forced == "native" or native_measured(n, k, facts.threads)))
    if route.kernel in (INT4_INT8X, INT4_F32, INT4_DEQUANT):
        return bool(facts.int4_pack_block) and n % facts.int4_pack_block == 0 and k % 32 == 0
    return k % 16 == 0  # q8_rows


# --- a layer's kernels ---------------------------------------------------------------------
@dataclass(frozen=True)
class RowKernels:
    """A layer's kernel for each class of row counts: ``names[i]`` from ``starts[i]``
    rows (``starts[0]`` is 0), bound for ``kind`` and ``x``."""

    starts: tuple[int, ...]
    names: tuple[str, ...]
    kind: str = "none"
    x: str = "bf16"

    def index(self, rows: int) -> int:
        return bisect.bisect_right(self.starts, rows) - 1

    def name_for(self, rows: int) -> str:
        return self.names[self.index(rows)]

    def first_row(self, name: str) -> int | None:
        """The fewest rows ``name`` computes for this layer (None: never)."""
        return next((max(s, 1) for s, k in zip(self.starts, self.names) if k == name), None)

    def trailing(self, name: str) -> int | None:
        """From how many rows ``name`` computes every product (None: not the last class)."""
        return max(self.starts[-1], 1) if self.names[-1] == name else None


ATEN_ONLY = RowKernels((0,), (ATEN,))


def resolve(routes: tuple[Route, ...]) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The row classes of ``routes`` (priority order): each row count takes the first
    route that covers it, ATen where none does; rows 0 take the 1-row class."""
    bounds = sorted({1} | {r.first for r in routes}
                    | {r.last + 1 for r in routes if r.last is not None})
    starts, names = [], []
    for start in bounds:
        name = next((r.kernel for r in routes if r.first <= start
                     and (r.last is None or start <= r.last)), ATEN)
        if not names or names[-1] != name:
            starts.append(start)
            names.append(name)
    starts[0] = 0
    return tuple(starts), tuple(names)


def bind(bits: int, k: int, n: int, facts: CpuFacts | None = None) -> RowKernels:
    """The kernels of a weight-only [n, k] linear of ``bits`` on this CPU (``facts``:
    ``probe()`` by default), for every row count."""
    facts = facts or probe()
    kind, x = cpu_kind(facts), x_format(facts)
    routes = tuple(r for r in TABLE[(kind, x)][bits] if takes(r, bits, k, n, facts))
    starts, names = resolve(routes)
    return RowKernels(starts, names, kind, x)


def route(bits: int, kernels: tuple[str, ...], facts: CpuFacts | None = None) -> Route | None:
    """The route of this CPU's table row that sends ``bits`` products on shapes every
    kernel takes to one of ``kernels`` (None: none does): where it starts and ends."""
    facts = facts or probe()
    return next((r for r in TABLE[(cpu_kind(facts), x_format(facts))][bits]
                 if r.kernel in kernels and not r.off_int8_grid), None)


# --- the table as docs/benchmarks.md prints it --------------------------------------------
def _classes(routes: tuple[Route, ...]) -> str:
    starts, names = resolve(routes)
    ends = [s - 1 for s in starts[1:]] + [None]
    cells = []
    for start, end, name in zip(starts, ends, names):
        start = max(start, 1)
        span = f"{start}+" if end is None else f"{start}" if end == start else f"{start}-{end}"
        cells.append(f"{span}: `{name}`")
    return "; ".join(cells)


def _int8_cell(routes: tuple[Route, ...]) -> str:
    on_grid = _classes(tuple(r for r in routes if not r.off_int8_grid))
    if not any(r.off_int8_grid for r in routes):
        return on_grid
    return f"{on_grid} (off the int8 grid: {_classes(routes)})"


def render_markdown() -> str:
    """The table for docs/benchmarks.md: one line per (CPU kind, x format), the row
    classes of int4 and int8 weights on shapes every kernel takes, and who computes
    dense bf16 linears; then what its names mean."""
    lines = ["| CPU kind | x | int4 weights, by rows | int8 weights (the LM head), by rows "
             "| dense bf16 |", "|---|---|---|---|---|"]
    for (kind, x), by_bits in TABLE.items():
        dense = "`gemm.c`" if DENSE_BF16.get(kind) == "native" else "oneDNN"
        lines.append(f"| `{kind}` | {x} | {_classes(by_bits[4])} | {_int8_cell(by_bits[8])} "
                     f"| {dense} |")
    lines += ["", "CPU kinds (`cpu_kind`):", ""]
    lines += [f"- `{kind}`: {text}" for kind, text in KINDS.items()]
    lines += ["", "x formats (`x_format`):", ""]
    lines += [f"- {x}: {text}" for x, text in X_FORMATS.items()]
    lines += ["", "Kernels (a shape off a kernel's grid, or a kernel not built, goes to the "
              "next route; `quant_gemm` only on the shapes measured faster, "
              "`gemm.native_measured`, unless `LLMSERVE_BF16_GEMM=native`, and never with "
              "`LLMSERVE_BF16_GEMM=onednn`):", ""]
    lines += [f"- `{name}`: {text}" for name, text in KERNEL_NOTES.items()]
    return "\n".join(lines)


def describe_here() -> str:
    facts = probe()
    return f"this CPU: kind {cpu_kind(facts)}, x {x_format(facts)} ({facts})"


if __name__ == "__main__":
    print(describe_here() if "--here" in sys.argv[1:] else render_markdown())
