"""What binding the C kernels costs per call: today's ctypes call against the same
kernel registered as a torch op (the custom ops the kernels would move to if no slower).

One cheap entry point (``silu_and_mul_bf16`` on one row of 2 x 16 bf16 values: the
kernel itself is tens of ns) called through

- ``ctypes raw``: the ctypes function with its arguments already computed (the floor);
- ``ctypes wrapper``: ``native.silu_and_mul`` as the model calls it today (allocates
  the output, reads pointers);
- ``torch.library.custom_op``: that wrapper as a Python custom op, called through
  ``torch.ops`` (what makes it typed and visible to torch.compile);
- ``Library.impl (CPU)``: the same Python kernel registered with the low-level
  ``torch.library.Library`` API (no autograd/fake-tensor wrapper of custom_op);
- ``C++ op`` (``--cpp``, compiles a torch extension once: ~100 s on 2 busy cores, then
  loaded from torch's extension cache): a C++ kernel
  registered with TORCH_LIBRARY calling the same C function, the fastest a torch op
  could be;
- ``aten.silu`` for scale: one of torch's own ops on the same tensor.

Printed: us per call (best of several repetitions) and the ratio to the ctypes
wrapper (> 1: slower than today). Machines here are shared and noisy: compare ratios.

    python benchmarks/cpu/kernel_binding.py
    python benchmarks/cpu/kernel_binding.py --cpp
"""

from __future__ import annotations

import argparse
import ctypes
import time

import torch

from llmserve.kernels.cpu import native

INTER = 16

CPP_SOURCE = r"""
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

typedef int (*silu_fn)(int, const void *, int, int64_t, void *);
static silu_fn fn = nullptr;

static at::Tensor silu_and_mul(const at::Tensor &gate_up, int64_t inter) {
    auto x = gate_up.contiguous();
    auto sizes = x.sizes().vec();
    sizes.back() = inter;
    auto act = at::empty(sizes, x.options());
    fn(1, x.data_ptr(), (int)(x.numel() / (2 * inter)), inter, act.data_ptr());
    return act;
}

static int64_t bind(int64_t address) { fn = (silu_fn)address; return 0; }

TORCH_LIBRARY(llmserve_bench_cpp, m) {
    m.def("silu_and_mul(Tensor gate_up, int inter) -> Tensor");
    m.def("bind(int address) -> int");
}
TORCH_LIBRARY_IMPL(llmserve_bench_cpp, CPU, m) { m.impl("silu_and_mul", &silu_and_mul); }
TORCH_LIBRARY_IMPL(llmserve_bench_cpp, CompositeExplicitAutograd, m) { m.impl("bind", &bind); }
"""


def best_us(fn, calls: int = 20000, reps: int = 7) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, time.perf_counter() - t0)
    return best / calls * 1e6


def custom_op():
    @torch.library.custom_op("llmserve_bench::silu_and_mul", mutates_args=())
    def silu_and_mul(gate_up: torch.Tensor, inter: int) -> torch.Tensor:
        return native.silu_and_mul(gate_up, inter)

    @silu_and_mul.register_fake
    def _(gate_up, inter):
        return gate_up.new_empty(*gate_up.shape[:-1], inter)

    return torch.ops.llmserve_bench.silu_and_mul


def library_impl():
    lib = torch.library.Library("llmserve_bench_low", "DEF")  # noqa: TOR901 (a benchmark)
    lib.define("silu_and_mul(Tensor gate_up, int inter) -> Tensor")
    lib.impl("silu_and_mul", native.silu_and_mul, "CPU")
    library_impl.keep = lib  # the registration lives as long as the object
    return torch.ops.llmserve_bench_low.silu_and_mul


def cpp_op():
    from torch.utils.cpp_extension import load_inline
    t0 = time.perf_counter()
    load_inline("llmserve_bench_cpp", CPP_SOURCE, is_python_module=False,
                extra_cflags=["-O2"])
    print(f"C++ extension built (or loaded from torch's cache) in "
          f"{time.perf_counter() - t0:.1f} s")
    address = ctypes.cast(native.cpu_library().silu_and_mul_bf16, ctypes.c_void_p).value
    torch.ops.llmserve_bench_cpp.bind(address)
    return torch.ops.llmserve_bench_cpp.silu_and_mul


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpp", action="store_true",
                        help="also build and time a C++ torch op (tens of seconds)")
    parser.add_argument("--calls", type=int, default=20000)
    args = parser.parse_args()
    torch.set_num_threads(1)  # the kernel's threads are not what is measured
    lib = native.cpu_library()
    if lib is None:
        raise SystemExit("the C kernels did not build here")
    x = torch.randn(1, 2 * INTER).to(torch.bfloat16)
    out = torch.empty(1, INTER, dtype=torch.bfloat16)
    xp, op = x.data_ptr(), out.data_ptr()
    raw = lib.silu_and_mul_bf16
    variants = {
        "ctypes raw": lambda: raw(1, xp, 1, INTER, op),
        "ctypes wrapper": lambda: native.silu_and_mul(x, INTER),
    }
    for name, make in (("torch.library.custom_op", custom_op),
                       ("Library.impl (CPU)", library_impl)):
        f = make()
        assert torch.equal(f(x, INTER), native.silu_and_mul(x, INTER))
        variants[name] = lambda f=f: f(x, INTER)
    if args.cpp:
        f = cpp_op()
        assert torch.equal(f(x, INTER), native.silu_and_mul(x, INTER))
        variants["C++ op"] = lambda: f(x, INTER)
    gate = x[:, :INTER]
    variants["aten.silu (scale)"] = lambda: torch.ops.aten.silu(gate)
    times = {name: best_us(fn, args.calls) for name, fn in variants.items()}
    base = times["ctypes wrapper"]
    print(f"{'binding':26} {'us/call':>8} {'vs ctypes wrapper':>18}")
    for name, us in times.items():
        print(f"{name:26} {us:8.2f} {us / base:17.2f}x")


if __name__ == "__main__":
    main()
