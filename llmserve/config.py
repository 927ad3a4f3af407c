"""Engine configuration: everything that sizes the KV cache and bounds a step."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

import torch

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


@dataclass
class EngineConfig:
    model: str = "smollm2-135m-instruct"
    served_model_name: str | None = None
    device: str = "auto"  # "auto" picks CUDA when present, else CPU
    # auto: bfloat16 on CUDA and on CPUs with native bf16 (AMX / AVX512-BF16), else float32
    dtype: str = "auto"
    block_size: int = 16
    # KV budget. On CPU an absolute number of bytes; on CUDA, when unset, a fraction
    # of the memory that is free after the weights are loaded.
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 128
    # Token budget per step. vLLM's 2048 suits a GPU; on a CPU one 2048-token step
    # takes seconds, stalling every running stream, so the CPU default is smaller.
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None  # defaults to the model's own limit
    enable_chunked_prefill: bool = True
    # Admission keeps this fraction of blocks free so running sequences can grow
    # without immediately preempting each other.
    watermark: float = 0.01
    enable_prefix_caching: bool = True
    preemption_mode: str = "recompute"  # or "swap"
    swap_space: int = 1 << 30  # bytes of CPU memory for swapped-out KV blocks
    scheduling_policy: str = "fcfs"  # or "priority"
    attention_backend: str = "auto"  # auto | triton | torch
    num_threads: int | None = None  # CPU threads; defaults to the cores we may use
    seed: int = 0
    # torch.compile each decoder layer (one shared graph, dynamic token count); the
    # compile happens during the start-up warm-up and is cached on disk.
    compile: bool = False
    # Weight-only quantisation of the linear layers on CPU: auto | none | int8 | int4
    # (auto: int4 for a 4-bit GGUF served in bf16 on a CPU, else none; resolved by the
    # engine once it knows the checkpoint: quantization.resolve_quantization).
    quantization: str = "auto"
    # continuous (iteration-level) | static (a batch runs to its end; the A/B baseline)
    batching: str = "continuous"
    # Keep each step's predicted duration at or below this (ms); None: no cap.
    target_itl_ms: float | None = None
    # Debug: hash KV blocks across swap-out/swap-in and copy-on-write and raise
    # KVIntegrityError on a mismatch. Costs a hash of every moved block; off by default.
    check_kv_integrity: bool = False
    # Tensor parallelism: the model split across this many ranks (one per GPU; on a CPU,
    # processes sharing its cores, which shows the communication cost, not a speed-up).
    tensor_parallel_size: int = 1
    # Overload: refuse a new request (503 server_overloaded) while this many requests
    # wait unscheduled; None: unbounded.
    max_waiting: int | None = None
    # Overload: a request still unscheduled after this many seconds leaves the
    # waiting queue and is answered 503 server_overloaded; None: it waits forever.
    max_queue_delay: float | None = None
    # GPU fast path (engine/cuda_graphs.py, step_buffers.py, kv_sizing.py). Each piece is
    # CUDA-only and off until a GPU run validates it (docs/architecture.md).
    # CUDA graphs for decode-only steps, one per batch-size bucket.
    cuda_graphs: bool = False
    # The buckets, e.g. "1,2,4,8"; None: 1, 2, 4 and multiples of 8 up to max_num_seqs.
    cuda_graph_sizes: str | list[int] | None = None
    # A step's int metadata in one pinned host buffer, one non-blocking copy.
    pinned_staging: bool = False
    # Block tables kept on the device, only changed entries written each step.
    device_block_tables: bool = False
    # KV pool = total x gpu_memory_utilization - the profiled peak of a
    # max_num_batched_tokens step (instead of a share of the memory free after loading).
    profile_kv_cache: bool = False

    def __post_init__(self) -> None:
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        elif self.device.startswith("cuda") and not torch.cuda.is_available():
            # Asked for a GPU (the operator's GPU pods ask): never serve on the CPU instead.
            raise ValueError(f"--device {self.device}, but CUDA is not available to this "
                             f"process (torch.cuda.is_available() is False): no GPU is "
                             f"visible, or the driver does not match; on Kubernetes, check "
                             f"the node's NVIDIA runtime (spec.resources.runtimeClassName)")
        if self.dtype == "auto":
            from llmserve.platforms.cpu import auto_dtype
            self.dtype = auto_dtype(self.device)
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be a power of two <= 128, got {self.block_size}")
        if self.uses_triton:
            from llmserve.kernels.triton.attention import check_supported
            check_supported(block_size=self.block_size)  # ValueError naming the limit
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = 2048 if self.device.startswith("cuda") else 512
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError("preemption_mode must be 'recompute' or 'swap'")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError("scheduling_policy must be 'fcfs' or 'priority'")
        if self.batching not in ("continuous", "static"):
            raise ValueError("batching must be 'continuous' or 'static'")
        if self.target_itl_ms is not None and not self.target_itl_ms > 0:
            raise ValueError("target_itl_ms must be a positive number of milliseconds")
        if self.quantization not in ("auto", "none", "int8", "int4"):
            raise ValueError("quantization must be 'auto', 'none', 'int8' or 'int4'")
        if self.quantization in ("int8", "int4") and self.device.startswith("cuda"):
            raise ValueError("--quantization int8/int4 uses CPU kernels; on CUDA serve a "
                             "bf16 or fp16 model")
        if self.attention_backend not in ("auto", "triton", "torch"):
            raise ValueError("attention_backend must be 'auto', 'triton' or 'torch'")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError("watermark must be in [0, 1)")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError("kv_cache_memory must be a positive number of bytes")
        if self.max_waiting is not None and self.max_waiting < 1:
            raise ValueError("max_waiting must be >= 1")
        if self.max_queue_delay is not None and not self.max_queue_delay > 0:
            raise ValueError("max_queue_delay must be a positive number of seconds")
        if self.num_threads is None:
            self.num_threads = len(os.sched_getaffinity(0))
        self._check_tensor_parallel()
        self._check_gpu_fast_path()

    def _check_tensor_parallel(self) -> None:
        """What the configuration alone can refuse; the model's shape is checked by the
        engine once its config is loaded (``shapes.check_tensor_parallel``)."""
        tp = self.tensor_parallel_size
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {tp!r}")
        if tp == 1:
            return
        if self.device.startswith("cuda"):
            if self.device != "cuda":
                raise ValueError(f"--tensor-parallel-size {tp} uses GPUs 0..{tp - 1}; give "
                                 f"--device cuda (not {self.device!r}) and choose the GPUs "
                                 f"with CUDA_VISIBLE_DEVICES")
            available = torch.cuda.device_count()
            if tp > available:
                raise ValueError(f"--tensor-parallel-size {tp} needs {tp} GPUs, this machine "
                                 f"has {available} visible")
        elif self.device != "cpu":
            raise ValueError(f"tensor parallelism runs on cuda or cpu, not {self.device!r}")
        if self.compile:
            raise ValueError("--compile is not supported with --tensor-parallel-size > 1 yet "
                             "(the all-reduces inside the layers are not traced)")

    GPU_FAST_PATH = ("cuda_graphs", "pinned_staging", "device_block_tables", "profile_kv_cache")

    def _check_gpu_fast_path(self) -> None:
        """The GPU fast-path flags: CUDA only, one rank, and consistent with the rest."""
        if self.cuda_graph_sizes is not None:
            self.cuda_graph_sizes = _parse_sizes(self.cuda_graph_sizes, self.max_num_seqs)
            if not self.cuda_graphs:
                raise ValueError("--cuda-graph-sizes is given without --cuda-graphs")
        flags = ["--" + name.replace("_", "-") for name in self.GPU_FAST_PATH
                 if getattr(self, name)]
        if not flags:
            return
        if not self.device.startswith("cuda"):
            raise ValueError(f"{', '.join(flags)}: GPU optimisations that need --device cuda "
                             f"(this engine runs on {self.device!r}); they are off by "
                             f"default until a GPU run validates them")
        if self.tensor_parallel_size > 1:
            raise ValueError(f"{', '.join(flags)}: not supported with "
                             f"--tensor-parallel-size > 1 yet")
        if self.cuda_graphs and not self.uses_triton:
            raise ValueError("--cuda-graphs captures the Triton attention kernels; it cannot "
                             "run with --attention-backend torch")
        if self.cuda_graphs and self.compile:
            raise ValueError("--cuda-graphs and --compile are not supported together yet")
        if self.profile_kv_cache and self.kv_cache_memory is not None:
            raise ValueError("--profile-kv-cache sizes the KV cache and --kv-cache-memory "
                             "fixes it: give one of them")

    @property
    def uses_triton(self) -> bool:
        """Triton attention kernels: on CUDA by default, or when asked for."""
        if self.attention_backend == "auto":
            return self.device.startswith("cuda")
        return self.attention_backend == "triton"

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @classmethod
    def from_kwargs(cls, **kwargs) -> EngineConfig:
        known = {f.name for f in fields(cls)}
        unknown = set(kwargs) - known
        if unknown:
            raise TypeError(f"unknown engine arguments: {sorted(unknown)}")
        return cls(**kwargs)


def _parse_sizes(sizes: str | list[int], max_num_seqs: int) -> list[int]:
    """CUDA-graph batch sizes from "1,2,4,8" or a list: distinct integers in
    [1, max_num_seqs], ascending."""
    try:
        values = [int(x) for x in (sizes.split(",") if isinstance(sizes, str) else sizes)]
    except ValueError:
        raise ValueError(f"cuda_graph_sizes must be comma-separated integers, "
                         f"got {sizes!r}") from None
    if not values or any(not 1 <= v <= max_num_seqs for v in values):
        raise ValueError(f"cuda_graph_sizes must be integers in [1, max_num_seqs="
                         f"{max_num_seqs}], got {sizes!r}")
    return sorted(set(values))
