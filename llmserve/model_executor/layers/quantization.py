"""Weight-only quantisation (int8/int4) of the engine's linears, and which mode a
checkpoint is served in (``resolve_quantization``; the modes are
``llmserve.config.QUANTIZATION_MODES``). The CPU's features and the dtype
choice are ``llmserve.platforms.cpu``.
"""

from __future__ import annotations

import bisect
import functools

import torch

from llmserve.kernels.cpu import dispatch
from llmserve.kernels.cpu.decoder import q4_matmul
from llmserve.kernels.cpu.dequant import int4_runs_in_float32, q4_dequant_mm
from llmserve.kernels.cpu.gemm import q8_rows, quant_gemm

# --- weight-only quantisation ---------------------------------------------------------
# GGUF types at 4 bits or fewer per weight: int4 groups of 32 hold them (nearly) exactly.
_GGUF_4BIT_PREFIXES = ("Q4_", "IQ4", "Q3_", "IQ3", "Q2_", "IQ2", "IQ1")


def is_4bit_gguf(layer_types: dict[str, int] | None) -> bool:
    """Every layer weight of the GGUF at 4 bits or fewer (a "Q4_K_M" file keeps some
    layers in Q6_K, which int4 would lose precision on: not 4-bit)."""
    return bool(layer_types) and all(kind.upper().startswith(_GGUF_4BIT_PREFIXES)
                                     for kind in layer_types)


def resolve_quantization(requested: str, gguf_layer_types: dict[str, int] | None,
                         device: str, dtype: torch.dtype, tensor_parallel_size: int = 1) -> str:
    """``--quantization auto``: serve a 4-bit GGUF checkpoint (the built-in model is
    Q4_1) at its own precision, int4 in groups of 32, which re-encodes its weights
    almost exactly, where the int4 kernels run at full speed: on CPUs serving bf16
    (which includes bf16 storage on AVX-512 CPUs without bf16 arithmetic:
    ``bf16_storage_for_int4``), one rank. Everything else (safetensors checkpoints,
    GGUFs with 5-8 bit layers, float32 serving, CUDA) is served unquantised. An
    explicit mode is kept as it is."""
    if requested != "auto":
        return requested
    if (is_4bit_gguf(gguf_layer_types) and device == "cpu" and dtype == torch.bfloat16
            and tensor_parallel_size == 1):
        return "int4"
    return "none"


def bf16_storage_for_int4(requested: str, gguf_layer_types: dict[str, int] | None,
                          device: str, tensor_parallel_size: int = 1) -> bool:
    """Whether ``--dtype auto``, float32 on a CPU without bf16 arithmetic, becomes bf16
    so that ``--quantization auto`` serves a 4-bit GGUF in int4 there too: where the
    int4 kernels compute in float32 (``int4_runs_in_float32``: the C decoder stack for
    decode steps, the dequantised float32 GEMM for many rows), bf16 being only the
    storage of activations and the KV cache. A decode step then streams an eighth of
    the float32 weights' bytes (docs/benchmarks.md, "int4 on CPUs without bf16
    arithmetic")."""
    return (requested == "auto" and is_4bit_gguf(gguf_layer_types) and device == "cpu"
            and tensor_parallel_size == 1 and int4_runs_in_float32())


INT4_GROUP = 32  # as GGUF Q4_0/Q4_1: a Q4_1 checkpoint re-encodes (nearly) exactly


class QuantizedLinear(torch.nn.Module):
    """A Linear whose weight is stored as int8 (per output channel, symmetric) or int4
    (groups of 32 inputs, asymmetric), multiplied by ATen's weight-only CPU kernels or
    our C kernels: which one for each class of row counts is bound when the layer is
    built (``bind_kernels``, from ``kernels/cpu/dispatch.py``'s table), so a forward
    looks its row count up once.

    The kernels are vectorised (AVX2 / AVX-512) only for bf16 activations, so inputs
    are computed in bf16 and the output is returned in the input's dtype. Reading a
    quarter (int8) or an eighth (int4) of the fp32 bytes is what makes a single stream
    fast: decoding one token reads every weight once.
    """

    def __init__(self, linear: torch.nn.Linear, bits: int):
        super().__init__()
        self.bits = bits
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach().float()
        if bits == 8:
            scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-8)
            self.register_buffer("qweight", (w / scale[:, None]).round().clamp(-127, 127)
                                 .to(torch.int8))
            self.register_buffer("scales", scale.to(torch.bfloat16))
        else:
            q, scales_zeros = _quantize_int4(w, INT4_GROUP)
            self.register_buffer("qweight",
                                 # ATen's own int4 pack (no public name)
                                 torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2))  # noqa: SLF001
            self.register_buffer("scales", scales_zeros)
        bias = linear.bias
        self.register_buffer("bias", None if bias is None else bias.detach().to(torch.bfloat16))
        self.bind_kernels()

    def bind_kernels(self, facts: dispatch.CpuFacts | None = None) -> None:
        """This CPU's kernel for each class of row counts (``facts``: the CPU now)."""
        self.row_kernels = dispatch.bind(self.bits, self.in_features, self.out_features,
                                         facts)
        self._starts = self.row_kernels.starts
        self._kernels = tuple(KERNELS[name] for name in self.row_kernels.names)
        self._product = self._routed

    def bind_backend(self, backends) -> None:
        """Inside a compiled graph ATen's kernel alone; else the kernels bound when the
        layer was built stay."""
        if backends.compiled:
            self.bind_compiled()

    def bind_compiled(self) -> None:
        """ATen's kernel alone, for a layer inside a torch.compile'd graph: a choice by
        row count there would be a guard on it (each layer compiled twice)."""
        self.row_kernels = dispatch.ATEN_ONLY
        self._product = self._aten

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._product(x.to(torch.bfloat16)).to(x.dtype)

    def kernel_for(self, x: torch.Tensor) -> str:
        """The name of the kernel that computes ``self(x)`` (ATen's, which refuses it,
        for an input of another width)."""
        if x.shape[-1] != self.in_features:
            return dispatch.ATEN
        return self.row_kernels.name_for(x.numel() // self.in_features)

    def _routed(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            return aten_product(x, self)
        rows = x.numel() // self.in_features
        return self._kernels[bisect.bisect_right(self._starts, rows) - 1](x, self)

    def _aten(self, x: torch.Tensor) -> torch.Tensor:
        return aten_product(x, self)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, int{self.bits}"


def aten_product(x: torch.Tensor, linear: QuantizedLinear) -> torch.Tensor:
    """ATen's weight-only kernel on the packed bytes, plus the bias (in bf16)."""
    y = weight_only_mm(x, linear.qweight, linear.scales, linear.bits)
    return y if linear.bias is None else y + linear.bias


# The kernel functions behind the dispatch table's names: (bf16 x [..., K], layer) -> y.
KERNELS = {
    dispatch.ATEN: aten_product,
    dispatch.QUANT_GEMM: quant_gemm,
    dispatch.INT4_INT8X: functools.partial(q4_matmul, int8_x=True),
    dispatch.INT4_F32: functools.partial(q4_matmul, int8_x=False),
    dispatch.INT4_DEQUANT: q4_dequant_mm,
    dispatch.Q8_ROWS_INT8X: functools.partial(q8_rows, int8_x=True),
    dispatch.Q8_ROWS: functools.partial(q8_rows, int8_x=False),
}


def weight_only_mm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                   bits: int) -> torch.Tensor:
    """ATen's weight-only kernel, as an op opaque to torch.compile: inductor would
    otherwise lower it its own way, measured slower than ATen's (docs/benchmarks.md).
    Eagerly the kernel is called directly (a custom op's dispatch costs more than the
    int4 GEMM of a decode)."""
    if torch.compiler.is_compiling():
        return torch.ops.llmserve.weight_only_mm(x, qweight, scales, bits)
    return _weight_only_mm_kernel(x, qweight, scales, bits)


def _weight_only_mm_kernel(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                           bits: int) -> torch.Tensor:
    if bits == 8:
        return torch.ops.aten._weight_int8pack_mm(x, qweight, scales)  # noqa: SLF001
    # ATen's weight-only int4 GEMM (no public name)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, qweight, INT4_GROUP, scales)  # noqa: SLF001


# The op wraps the plain function, which eager calls keep calling directly.
_weight_only_mm = torch.library.custom_op("llmserve::weight_only_mm", _weight_only_mm_kernel,
                                          mutates_args=())


@_weight_only_mm.register_fake
def _(x, qweight, scales, bits):
    return x.new_empty((x.shape[0], scales.shape[0] if bits == 8 else scales.shape[1]))


def _quantize_int4(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric per group: w ~ (q - 8) * scale + zero with q in 0..15. Returns the
    int32 codes [N, K] and the kernel's [K / group, N, 2] bf16 (scale, zero) table."""
    n, k = w.shape
    wg = w.view(n, k // group, group)
    low, high = wg.amin(dim=-1), wg.amax(dim=-1)
    scale = ((high - low) / 15).clamp(min=1e-8)
    q = ((wg - low[..., None]) / scale[..., None]).round().clamp(0, 15)
    zero = low + scale * 8
    scales_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()
    return q.to(torch.int32).view(n, k), scales_zeros.to(torch.bfloat16)


def quantizable(linear: torch.nn.Linear, bits: int) -> bool:
    if bits == 4:  # the int4 packing tiles K by 32 and groups by INT4_GROUP
        return linear.in_features % INT4_GROUP == 0 and linear.out_features % 8 == 0
    return True


def quantize_model(model: torch.nn.Module, mode: str) -> int:
    """Replace the decoder's projections and the LM head by weight-only quantised ones
    (the LM head is a fifth of the built-in model's weights). The token embedding stays
    dense: a lookup reads a handful of rows. Returns how many layers were quantised."""
    if mode == "none":
        return 0
    if mode not in ("int8", "int4"):  # "auto" is resolved by the engine, never here
        raise ValueError(f"unresolved quantization mode {mode!r}")
    bits = 8 if mode == "int8" else 4
    count = 0
    for layer in model.model.layers:
        # A mixture-of-experts block's experts are MLPs; its router stays dense (small).
        mlps = getattr(layer.mlp, "experts", [layer.mlp])
        for parent, name in ((layer.self_attn, "qkv_proj"), (layer.self_attn, "o_proj"),
                             *((mlp, proj) for mlp in mlps
                               for proj in ("gate_up_proj", "down_proj"))):
            linear = getattr(parent, name)
            if quantizable(linear, bits):
                setattr(parent, name, QuantizedLinear(linear, bits))
                count += 1
    # The LM head stays int8 even in int4 mode (as llama.cpp keeps Q8_0 outputs):
    # int4 there costs more quality than it saves time (the built-in model's perplexity
    # with an int4 head: docs/benchmarks.md).
    model.lm_head = QuantizedLinear(model.lm_head, 8)
    return count + 1
