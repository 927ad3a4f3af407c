"""Which engine settings refuse each other, in one table.

``EngineConfig`` checks each setting on its own first, then this table once: the first
entry that applies is the error. A feature with several clashes names all of them at
once (``Together``), so a user fixes a command line in one go. Each entry says why,
in words a user can act on; ``yet`` marks what is not built rather than impossible.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from llmserve.config.speculative import UNSUPPORTED_WITH

if TYPE_CHECKING:
    from llmserve.config.engine import EngineConfig

Predicate = Callable[["EngineConfig"], bool]

GPU_FAST_PATH = ("cuda_graphs", "pinned_staging", "device_block_tables", "profile_kv_cache")


@dataclass(frozen=True)
class Clash:
    """``applies``: the settings cannot go together; ``why``: the message (or a function
    of the config that makes it)."""
    applies: Predicate
    why: str | Callable[[EngineConfig], str]

    def problem(self, c: EngineConfig) -> str | None:
        if not self.applies(c):
            return None
        return self.why(c) if callable(self.why) else self.why


@dataclass(frozen=True)
class Together:
    """A feature (``flag``, on when ``enabled``) and every setting it refuses."""
    flag: str
    enabled: Predicate
    clashes: tuple[tuple[Predicate, str], ...]

    def problem(self, c: EngineConfig) -> str | None:
        if not self.enabled(c):
            return None
        found = [why for applies, why in self.clashes if applies(c)]
        if not found:
            return None
        return f"{self.flag} is not supported together with {'; '.join(found)} yet"


def gpu_flags(c: EngineConfig) -> list[str]:
    """The GPU fast-path flags given."""
    return ["--" + name.replace("_", "-") for name in GPU_FAST_PATH if getattr(c, name)]


def _tp(c: EngineConfig) -> bool:
    return c.tensor_parallel_size > 1


def _split_kv(c: EngineConfig) -> bool:
    return c.kv_role != "both"


CLASHES = (
    Clash(lambda c: c.compile and _tp(c),
          "--compile is not supported with --tensor-parallel-size > 1 yet (the all-reduces "
          "inside the layers are not traced)"),
    Clash(lambda c: c.fused_kernels and not c.uses_triton,
          "--fused-kernels are Triton kernels: give --attention-backend triton (on a CPU "
          "they run under TRITON_INTERPRET=1)"),
    Clash(lambda c: c.async_scheduling and _tp(c),
          "--async-scheduling is not supported with --tensor-parallel-size > 1 yet (the "
          "workers would need the previous step's tokens)"),
    Clash(lambda c: c.async_scheduling and c.check_kv_integrity,
          "--async-scheduling and --check-kv-integrity are not supported together (the "
          "check hashes blocks whose tokens are pending)"),
    Clash(lambda c: c.fused_kernels and c.compile,
          "--fused-kernels and --compile are not supported together: the compiled layers "
          "fuse their own elementwise ops"),
    Clash(lambda c: bool(gpu_flags(c)) and not c.device.startswith("cuda"),
          lambda c: f"{', '.join(gpu_flags(c))}: GPU optimisations that need --device cuda "
                    f"(this engine runs on {c.device!r})"),
    Clash(lambda c: bool(gpu_flags(c)) and _tp(c),
          lambda c: f"{', '.join(gpu_flags(c))}: not supported with "
                    f"--tensor-parallel-size > 1 yet"),
    Clash(lambda c: c.cuda_graphs and not c.uses_triton,
          "--cuda-graphs captures the Triton attention kernels; it cannot run with "
          "--attention-backend torch"),
    Clash(lambda c: c.cuda_graphs and c.compile,
          "--cuda-graphs and --compile are not supported together yet"),
    Clash(lambda c: c.profile_kv_cache and c.kv_cache_memory is not None,
          "--profile-kv-cache sizes the KV cache and --kv-cache-memory fixes it: give one "
          "of them"),
    Clash(lambda c: _split_kv(c) and _tp(c),
          lambda c: f"--kv-role {c.kv_role} is not supported with --tensor-parallel-size > 1 "
                    f"yet (each rank holds a shard of the KV); serve each pool with "
                    f"--tensor-parallel-size 1"),
    Clash(lambda c: c.kv_role == "decode" and not c.enable_prefix_caching,
          "--kv-role decode needs prefix caching (the KV read from a prefill engine enters "
          "the prefix cache): drop --no-prefix-caching"),
    Together("--speculative-config", lambda c: c.speculative is not None, (
        (lambda c: c.async_scheduling, UNSUPPORTED_WITH["async_scheduling"]),
        (_tp, UNSUPPORTED_WITH["tensor_parallel_size"]),
        (_split_kv, UNSUPPORTED_WITH["kv_role"]),
        (lambda c: c.check_kv_integrity, UNSUPPORTED_WITH["check_kv_integrity"]))),
    Together("--enable-lora", lambda c: c.enable_lora, (
        (lambda c: c.compile, "--compile (the compiled layers do not apply adapters)"),
        (_split_kv, "--kv-role prefill/decode (the KV would cross engines without its "
                    "adapter)"))),
)


def check_clashes(c: EngineConfig) -> None:
    """Raise ValueError for the first entry of ``CLASHES`` that applies."""
    for entry in CLASHES:
        problem = entry.problem(c)
        if problem is not None:
            raise ValueError(problem)
