"""Engine configuration: everything that sizes the KV cache and bounds a step.

``EngineConfig`` is the one place for the engine's settings: their names, defaults,
choices and help. The ``llmserve`` command builds its engine flags from these fields
(``flag()`` marks a field as one), so this module imports neither torch nor pydantic at
the top: ``llmserve gateway`` parses its command line without paying torch's import,
and the GPU machine's image has no pydantic.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

from llmserve.config.clashes import check_clashes
from llmserve.config.lora import parse_lora_modules
from llmserve.config.speculative import SpeculativeConfig
from llmserve.flags import flag
from llmserve.platforms.threads import usable_cpu_count

if TYPE_CHECKING:
    import torch

# dtype names the engine accepts -> the torch dtype (resolved when asked: torch_dtype).
_DTYPES = {
    "float32": "float32",
    "fp32": "float32",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
}
# Weight-only quantisation of the linear layers (model_executor/layers/quantization.py).
QUANTIZATION_MODES = ("auto", "none", "int8", "int4")


GPU_GROUP = "GPU fast path (CUDA only)"


@dataclass
class EngineConfig:
    model: str = flag("smollm2-135m-instruct",
                      "checkpoint directory, .gguf file or built-in name")
    served_model_name: str | None = flag(None)
    device: str = flag("auto")  # "auto" picks CUDA when present, else CPU
    # auto: bfloat16 on CUDA and on CPUs with native bf16 (AMX / AVX512-BF16), else float32
    dtype: str = flag("auto", "auto | float32 | float16 | bfloat16")
    block_size: int = flag(16)
    # KV budget. On CPU an absolute number of bytes; on CUDA, when unset, a fraction
    # of the memory that is free after the weights are loaded.
    kv_cache_memory: int | None = flag(None, "KV cache bytes")
    gpu_memory_utilization: float = flag(0.9)
    max_num_seqs: int = flag(128)
    # Token budget per step. vLLM's 2048 suits a GPU; on a CPU one 2048-token step
    # takes seconds, stalling every running stream, so the CPU default is smaller.
    max_num_batched_tokens: int | None = flag(
        None, "token budget per step (default 2048 on CUDA, 512 on CPU)")
    max_model_len: int | None = flag(None)  # defaults to the model's own limit
    enable_chunked_prefill: bool = flag(True)  # --no-chunked-prefill
    # Admission keeps this fraction of blocks free so running sequences can grow
    # without immediately preempting each other. (No flag.)
    watermark: float = 0.01
    enable_prefix_caching: bool = flag(True)  # --no-prefix-caching
    preemption_mode: str = flag("recompute", choices=("recompute", "swap"))
    swap_space: int = flag(1 << 30, "CPU swap bytes")  # for swapped-out KV blocks
    scheduling_policy: str = flag("fcfs", choices=("fcfs", "priority"))
    attention_backend: str = flag("auto", choices=("auto", "triton", "torch"))
    num_threads: int | None = flag(
        None, "CPU threads for the model (default: all cores we may use)")
    # No flag: `generate`'s --seed is the sampling seed.
    seed: int = 0
    # auto is resolved by the engine once it knows the checkpoint
    # (quantization.resolve_quantization).
    quantization: str = flag(
        "auto", "CPU: weight-only int8/int4 linear layers (bf16 activations); fastest for "
        "few concurrent streams. auto: int4 for a 4-bit GGUF (the built-in model) served "
        "in bf16 (with --dtype auto, also on AVX-512 CPUs without bf16 arithmetic), none "
        "otherwise", choices=QUANTIZATION_MODES)
    # One shared graph per decoder layer, dynamic token count.
    compile: bool = flag(False, "torch.compile the decoder layers (CPU: fewer, fused ops "
                         "per step; compiled during the start-up warm-up, cached on disk)")
    # continuous: iteration-level; static: the A/B baseline.
    batching: str = flag("continuous", "static: run each batch to its end before "
                         "admitting more (baseline)", choices=("continuous", "static"))
    target_itl_ms: float | None = flag(
        None, "cap each step's predicted duration (a latency SLO): prefill chunks shrink "
        "and the least urgent decodes wait")
    # On a CPU the ranks show the communication cost, not a speed-up.
    tensor_parallel_size: int = flag(
        1, "split the model across this many ranks: one per GPU (GPUs 0..N-1), or on CPU "
        "processes that share the cores", aliases=("-tp",))
    max_waiting: int | None = flag(
        None, "overload: answer 503 server_overloaded (with Retry-After) to new requests "
        "while this many wait unscheduled (default: unbounded)", metavar="N")
    max_queue_delay: float | None = flag(
        None, "overload: a request not scheduled within this many seconds leaves the "
        "queue with 503 server_overloaded (default: waits forever)", metavar="S")
    # OpenTelemetry (llmserve/tracing.py): the server's spans per request, built from the
    # timestamps the engine records anyway. Off: a no-op tracer.
    otlp_traces_endpoint: str | None = flag(
        None, "export OpenTelemetry traces of requests to this OTLP/HTTP collector, e.g. "
        "http://localhost:4318 (serve, up; default: off)", metavar="URL")
    # Raises KVIntegrityError on a mismatch; costs a hash of every moved block.
    check_kv_integrity: bool = flag(False, "debug: hash KV blocks across swaps and "
                                    "copy-on-write, fail loudly on a mismatch (slow)")
    # GPU fast path (worker/cuda_graphs.py, step_buffers.py, kv_sizing.py), CUDA only.
    # CUDA graphs are on by default where they apply (measured on an H200: decode steps
    # 3.5-11x faster on every model family, greedy tokens leaving eager steps' only at
    # bf16 ties); None (the default) is decided in __post_init__ into use_cuda_graphs.
    # The other pieces stay off until a GPU run makes them pay (docs/architecture.md).
    cuda_graphs: bool | None = flag(
        None, "replay CUDA graphs for decode steps, one per batch-size bucket (default: "
        "on where they apply: --device cuda, one rank, Triton attention, no --compile, "
        "not --kv-role prefill, a model with no host-side expert loop); "
        "--no-cuda-graphs runs every step eagerly",
        group=GPU_GROUP)
    # A list once validated; None: 1, 2, 4 and multiples of 8 up to max_num_seqs.
    cuda_graph_sizes: str | list[int] | None = flag(
        None, "the buckets (default 1,2,4 and multiples of 8 up to --max-num-seqs)",
        metavar="N,N,...", group=GPU_GROUP)
    pinned_staging: bool = flag(
        False, "a step's metadata in one pinned buffer, one non-blocking copy",
        group=GPU_GROUP)
    device_block_tables: bool = flag(
        False, "block tables kept on the GPU, only changed entries written", group=GPU_GROUP)
    # Fused Triton kernels (kernels/triton/fused.py): residual add + RMSNorm, rotary + KV
    # write, SiLU x up. They need the Triton backend (a CPU runs them interpreted, as
    # the tests do); off until a GPU run validates them.
    fused_kernels: bool = flag(
        False, "Triton kernels for add+RMSNorm, rotary+KV write and SiLU*up (needs the "
        "Triton attention backend; off until validated on a GPU)")
    # Overlap (engine/overlap.py): step N+1 is scheduled and launched before step N's
    # sampled tokens are read back. Runs on any device; it pays off where launches are
    # asynchronous (CUDA).
    async_scheduling: bool = flag(
        False, "schedule and launch step N+1 before reading back step N's tokens (pays "
        "off where launches are asynchronous: CUDA)")
    # Speculative decoding (spec_decode/): vLLM's JSON shape; n-gram (prompt lookup) or
    # draft-model proposals, verified exactly (greedy outputs unchanged, sampling by
    # rejection).
    speculative_config: str | dict | None = flag(
        None, 'speculative decoding, e.g. {"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4, "prompt_lookup_min": 2, "disable_by_batch_size": 8}, or '
        '{"model": DRAFT, "num_speculative_tokens": 4} for a draft model sharing the '
        "tokenizer (any form --model takes) (default: off)", metavar="JSON")
    # Multi-LoRA (model_executor/lora/): adapters of the base model, several in one batch.
    enable_lora: bool = flag(False, "serve LoRA adapters of the base model (a request's "
                             "'model' names one)", group="LoRA adapters")
    lora_modules: list[str] | None = flag(
        None, "adapters to load at start-up, NAME=SOURCE each (SOURCE: a PEFT adapter "
        "directory, file://, pvc:// or hf://ORG/REPO[@REV])", nargs="+", metavar="NAME=SOURCE",
        group="LoRA adapters")
    max_loras: int = flag(4, "distinct adapters in one step", group="LoRA adapters")
    max_lora_rank: int = flag(64, "the largest adapter rank accepted", group="LoRA adapters")
    max_cpu_loras: int | None = flag(
        None, "adapters whose weights are kept in host memory, least recently used "
        "dropped first (default: 2 x --max-loras)", group="LoRA adapters")
    disable_lora_updates: bool = flag(
        False, "refuse POST /v1/load_lora_adapter and /v1/unload_lora_adapter (adapters "
        "then come only from --lora-modules)", group="LoRA adapters")
    # Prefill/decode disaggregation (engine/disagg.py, distributed/kv_transfer/): a
    # prefill engine holds a leg-1 request's KV under a lease and serves it through its
    # side channel; a decode engine reads the blocks its prefix cache lacks.
    kv_role: str = flag(
        "both", "prefill: serve leg-1 requests and hold their KV for a decode engine; "
        "decode: read a leg-2 request's KV from the prefill engine its "
        "kv_transfer_params name; both: no transfer (colocated)",
        choices=("prefill", "decode", "both"))
    kv_transfer_port: int = flag(
        5600, "the side channel a prefill engine serves KV on (0: any free port)",
        metavar="N")
    kv_transfer_host: str | None = flag(
        None, "the address a prefill engine advertises to decode engines (default: "
        "$POD_IP, else 127.0.0.1)")
    kv_transfer_backend: str = flag(
        "auto", "how KV moves: nixl (one-sided reads), tcp (inline on the side channel), "
        "auto (nixl where it loads)", choices=("auto", "nixl", "tcp"))
    kv_lease_ttl: float = flag(
        30.0, "seconds a prefill engine holds KV for a decode engine to read", metavar="S")
    # KV pool = total x gpu_memory_utilization - the profiled peak of a
    # max_num_batched_tokens step (instead of a share of the memory free after loading).
    profile_kv_cache: bool = flag(
        False, "size the KV cache from a profiled max-num-batched-tokens step",
        group=GPU_GROUP)

    # Whether --dtype auto was decided by the CPU's features alone (not CUDA, not
    # LLMSERVE_CPU_DTYPE): the engine may then still store an int4-served checkpoint's
    # activations in bf16 on a CPU without bf16 arithmetic (quantization.py's
    # bf16_storage_for_int4). Not a flag.
    dtype_from_cpu: bool = field(default=False, init=False, repr=False)
    # Decided by _resolve_cuda_graphs from cuda_graphs (kept as given, so a rebuilt config
    # decides again): whether the engine captures CUDA graphs, and why the default left
    # them off (None when it did not). Not flags.
    use_cuda_graphs: bool = field(default=False, init=False, repr=False)
    cuda_graphs_off_because: str | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        """Every setting checked on its own, the defaults that depend on the machine
        decided, then the settings that refuse each other (clashes.py)."""
        self._resolve_device_and_dtype()
        self._check_step_sizes()
        self._check_choices()
        self._check_limits()
        self._check_tensor_parallel()
        self._check_gpu_fast_path()
        self._check_kv_transfer()
        self.speculative = SpeculativeConfig.parse(self.speculative_config)  # None: off
        self._check_lora()
        check_clashes(self)

    def _resolve_device_and_dtype(self) -> None:
        import torch
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        elif self.device.startswith("cuda") and not torch.cuda.is_available():
            # Asked for a GPU (the operator's GPU pods ask): never serve on the CPU instead.
            raise ValueError(f"--device {self.device}, but CUDA is not available to this "
                             f"process (torch.cuda.is_available() is False): no GPU is "
                             f"visible, or the driver does not match; on Kubernetes, check "
                             f"the node's NVIDIA runtime (spec.resources.runtimeClassName)")
        if self.dtype == "auto":
            from llmserve.platforms.cpu import auto_dtype, dtype_from_cpu_features
            self.dtype = auto_dtype(self.device)
            self.dtype_from_cpu = dtype_from_cpu_features(self.device)
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")

    def _check_step_sizes(self) -> None:
        """The KV block and what one step may hold."""
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

    def _check_limits(self) -> None:
        """Latency target, quantisation's device, memory, overload bounds, tracing,
        threads."""
        if self.target_itl_ms is not None and not self.target_itl_ms > 0:
            raise ValueError("target_itl_ms must be a positive number of milliseconds")
        if self.quantization in ("int8", "int4") and self.device.startswith("cuda"):
            raise ValueError("--quantization int8/int4 uses CPU kernels; on CUDA serve a "
                             "bf16 or fp16 model")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError("watermark must be in [0, 1)")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError("kv_cache_memory must be a positive number of bytes")
        if self.max_waiting is not None and self.max_waiting < 1:
            raise ValueError("max_waiting must be >= 1")
        if self.max_queue_delay is not None and not self.max_queue_delay > 0:
            raise ValueError("max_queue_delay must be a positive number of seconds")
        if self.otlp_traces_endpoint:
            from llmserve.tracing import traces_url
            traces_url(self.otlp_traces_endpoint)  # ValueError unless an http(s) URL
        if self.num_threads is None:
            self.num_threads = usable_cpu_count()

    def _check_lora(self) -> None:
        if self.lora_modules and not self.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora")
        if not self.enable_lora:
            return
        if self.max_loras < 1:
            raise ValueError("max_loras must be >= 1")
        if not 1 <= self.max_lora_rank <= 512:
            raise ValueError(f"max_lora_rank must be in [1, 512], got {self.max_lora_rank}")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = 2 * self.max_loras
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras "
                             f"({self.max_loras})")
        parse_lora_modules(self.lora_modules or [])  # ValueError naming the bad entry

    def _check_kv_transfer(self) -> None:
        if not 0 <= self.kv_transfer_port < 65536:
            raise ValueError(f"kv_transfer_port must be a TCP port (0-65535), got "
                             f"{self.kv_transfer_port}")
        if not self.kv_lease_ttl > 0:
            raise ValueError("kv_lease_ttl must be a positive number of seconds")

    def _check_choices(self) -> None:
        """Each field with choices (the CLI's argparse checks its own; the Python API
        and the operator's args do not pass through it)."""
        for f in fields(self):
            choices = f.metadata.get("choices")
            if choices and getattr(self, f.name) not in choices:
                quoted = [repr(c) for c in choices]
                raise ValueError(f"{f.name} must be {', '.join(quoted[:-1])} or {quoted[-1]}")

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
            import torch
            available = torch.cuda.device_count()
            if tp > available:
                raise ValueError(f"--tensor-parallel-size {tp} needs {tp} GPUs, this machine "
                                 f"has {available} visible")
        elif self.device != "cpu":
            raise ValueError(f"tensor parallelism runs on cuda or cpu, not {self.device!r}")

    def _check_gpu_fast_path(self) -> None:
        """CUDA graphs decided, and their sizes parsed (what the fast-path flags refuse
        is in clashes.py)."""
        self._resolve_cuda_graphs()
        if self.cuda_graph_sizes is not None:
            self.cuda_graph_sizes = _parse_sizes(self.cuda_graph_sizes, self.max_num_seqs)
            if not self.use_cuda_graphs:
                raise ValueError("--cuda-graph-sizes is given with CUDA graphs off ("
                                 + (self.cuda_graphs_off_because or "--no-cuda-graphs")
                                 + ")")

    def _resolve_cuda_graphs(self) -> None:
        """``use_cuda_graphs``: ``cuda_graphs`` where given (an explicit True is checked
        below, and refused by the model runner if the model cannot be captured); by
        default, wherever graphs apply, else off with the reason in
        ``cuda_graphs_off_because`` (the runner then only logs a model it cannot
        capture)."""
        if self.cuda_graphs is not None:
            self.use_cuda_graphs, self.cuda_graphs_off_because = self.cuda_graphs, None
            return
        self.cuda_graphs_off_because = cuda_graphs_off_because(
            self.device, self.tensor_parallel_size, self.uses_triton, self.compile,
            self.kv_role)
        self.use_cuda_graphs = self.cuda_graphs_off_because is None

    def __setattr__(self, name: str, value: object) -> None:
        if self.__dict__.get("_frozen"):
            raise AttributeError(f"this EngineConfig is resolved and frozen ({name} cannot "
                                 f"change); dataclasses.replace makes a new one")
        super().__setattr__(name, value)

    def frozen(self) -> EngineConfig:
        """This configuration, frozen: the engine resolves it once (model_config.py) and
        nothing rewrites it after."""
        super().__setattr__("_frozen", True)
        return self

    @property
    def uses_triton(self) -> bool:
        """Triton attention kernels: on CUDA by default, or when asked for."""
        if self.attention_backend == "auto":
            return self.device.startswith("cuda")
        return self.attention_backend == "triton"

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch
        return getattr(torch, _DTYPES[self.dtype])

    @classmethod
    def from_kwargs(cls, **kwargs) -> EngineConfig:
        known = {f.name for f in fields(cls) if f.init}
        unknown = set(kwargs) - known
        if unknown:
            raise TypeError(f"unknown engine arguments: {sorted(unknown)}")
        return cls(**kwargs)


def cuda_graphs_off_because(device: str, tensor_parallel_size: int, uses_triton: bool,
                            compile: bool, kv_role: str = "both") -> str | None:
    """Why CUDA graphs do not apply to an engine of these settings by default, or None
    where they do (the model itself is checked at load: ``cuda_graphs.uncapturable``)."""
    if not device.startswith("cuda"):
        return f"the engine runs on {device!r}, not CUDA"
    if device not in ("cuda", "cuda:0"):
        # A capture records on the current device, which a one-rank engine leaves at 0.
        return (f"--device {device}: graphs are captured on the current device (cuda:0); "
                f"choose the GPU with CUDA_VISIBLE_DEVICES and --device cuda")
    if kv_role == "prefill":
        return "--kv-role prefill (a prefill engine runs no decode steps)"
    if tensor_parallel_size > 1:
        return "--tensor-parallel-size > 1"
    if not uses_triton:
        return "--attention-backend torch (the graphs capture the Triton kernels)"
    if compile:
        return "--compile"
    return None


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
