"""What an AVX2 int8 panel product spends its time on: the whole per-group kernel
(``panel_int8.h``'s ``panel8_rows``: VPMADDUBSW sums, then each group's scaling into
float32) against its integer sums alone, one thread, everything in L1, so that neither
memory nor the panels' rearrangement counts. The difference is what the scaling of each
group of 32 k costs (VPMADDWD, conversion, two multiplies and two FMAs a row and 8
columns, all on the FMA ports 0 and 1, which the VPMADDUBSW also need).

Compiles a small C harness against the tree's header with the AVX2 build's flags
(``-march=haswell``), so it runs wherever the CPU has AVX2; prints GMAC/s of each,
multiply-adds a cycle at the clock given, and the ratio.

    python benchmarks/cpu/int8_panel_parts.py [--rows 96] [--ghz 3.5]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

if not __package__:  # run as a file: the repository root, so that `benchmarks` imports
    sys.path.append(str(Path(__file__).resolve().parents[2]))

from benchmarks.lib.paths import ROOT

KERNELS = ROOT / "llmserve" / "kernels" / "cpu"

HARNESS = r"""
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include "panel_int8.h"
static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}
int main(int argc, char **argv) {
    const int64_t K = PANEL8_CHUNK, N = PANEL8_COLS, M = atoi(argv[1]);
    const int reps = atoi(argv[2]);
    int8_t *codes = aligned_alloc(64, M * K);
    uint8_t *panel = aligned_alloc(64, K * PANEL8_COLS);
    float *step = malloc(sizeof(float) * M * K / 32), *csum = malloc(sizeof(float) * M * K / 32);
    float *sums = aligned_alloc(64, sizeof(float) * M * PANEL8_COLS);
    uint16_t *sz = malloc(sizeof(uint16_t) * 2 * N * K / 32);
    for (int64_t i = 0; i < M * K; i++) codes[i] = (int8_t)(i * 7 % 255 - 127);
    for (int64_t i = 0; i < K * PANEL8_COLS; i++) panel[i] = (uint8_t)(i % 16);
    for (int64_t i = 0; i < M * K / 32; i++) step[i] = 0.01f, csum[i] = 0.1f;
    for (int64_t i = 0; i < 2 * N * K / 32; i++) sz[i] = 0x3c00;
    double t0 = now();
    for (int r = 0; r < reps; r++) panel8_rows(codes, step, csum, K, M, panel, sz, N, 0, K, sums);
    const double whole = now() - t0;
    __m256i keep = _mm256_setzero_si256();
    t0 = now();
    for (int r = 0; r < reps; r++)
        for (int64_t t = 0; t + 4 <= M; t += 4)
            for (int64_t g = 0; g < K / 32; g++) {
                __m256i s[8];
                const int8_t *x = codes + t * K + g * 32;
                panel8_quads4(panel + g * 32 * PANEL8_COLS, x, x + K, x + 2 * K, x + 3 * K,
                              &s[0], &s[1], &s[2], &s[3], &s[4], &s[5], &s[6], &s[7]);
                for (int i = 0; i < 8; i++) keep = _mm256_add_epi16(keep, s[i]);
            }
    const double sums_only = now() - t0;
    const double macs = (double)reps * (M / 4 * 4) * K * PANEL8_COLS;
    printf("%.3f %.3f %d %f\n", macs / whole / 1e9, macs / sums_only / 1e9,
           _mm256_extract_epi16(keep, 3), sums[5]);
    return 0;
}
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=96, help="rows of x (a multiple of 4)")
    ap.add_argument("--reps", type=int, default=20000)
    ap.add_argument("--ghz", type=float, default=3.5, help="the core's clock, for MACs a cycle")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "harness.c", Path(tmp) / "harness"
        src.write_text(HARNESS)
        subprocess.run(["cc", "-O3", "-march=haswell", "-fno-math-errno", "-fno-trapping-math",
                        "-Wno-psabi", f"-I{KERNELS}", str(src), "-o", str(exe)], check=True)
        print("| round | whole kernel, GMAC/s | MACs a cycle | integer sums alone, GMAC/s "
              "| MACs a cycle | scaling's share of the kernel |")
        print("|---|---|---|---|---|---|")
        for r in range(args.rounds):
            out = subprocess.run([str(exe), str(args.rows), str(args.reps)], check=True,
                                 capture_output=True, text=True).stdout.split()
            whole, sums = float(out[0]), float(out[1])
            print(f"| {r + 1} | {whole:.1f} | {whole / args.ghz:.1f} | {sums:.1f} | "
                  f"{sums / args.ghz:.1f} | {1 - whole / sums:.0%} |")


if __name__ == "__main__":
    main()
