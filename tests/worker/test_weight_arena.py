"""The CPU weights moved onto huge pages (``worker/weight_arena.py``): every parameter and
buffer keeps its values, dtype and shape and lies in a block on 2 MB boundaries; tied
weights stay one tensor; tensors sharing a storage stay together; a model bigger than a
block takes several, each tensor once; Linux backs the blocks with huge pages where it
does (checked in /proc/self/smaps); and the engine generates the same tokens with them
as without."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from llmserve import SamplingParams
from llmserve.config import EngineConfig
from llmserve.engine.llm_engine import LLMEngine
from llmserve.kernels.cpu.gemm import native_gemm_available
from llmserve.model_executor.layers.cpu_linear import NativeLinear
from llmserve.platforms.memory import HUGE_PAGE
from llmserve.worker import weight_arena
from llmserve.worker.weight_arena import pack_weights


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(300, 64)
        self.proj = nn.Linear(64, 96).to(torch.bfloat16)
        self.head = nn.Linear(64, 300, bias=False)
        self.head.weight = self.embed.weight  # tied: one Parameter in two modules
        self.register_buffer("codes", torch.randint(-128, 127, (1000, 33), dtype=torch.int8))
        self.register_buffer("flags", torch.tensor([True, False, True]))
        self.register_buffer("scalar", torch.tensor(3.5))
        self.aside = torch.randn(10)  # not registered: stays where it is
        both = torch.randn(8, 16)  # two buffers viewing one storage: left together
        self.register_buffer("whole", both)
        self.register_buffer("rows", both[2:5])


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in [*model.named_parameters(), *model.named_buffers()]}


def huge_bytes_at(start: int, end: int) -> int:
    """AnonHugePages of this process's mappings inside [start, end), from smaps."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(a, 16) for a in head.split("-"))
                inside = lo < end and hi > start
            elif inside and head == "AnonHugePages:":
                total += int(line.split()[1]) << 10
    return total


def blocks_of(model: nn.Module) -> set[int]:
    """The 2 MB-aligned starts of the blocks the model's tensors lie in (a block's
    first tensor starts it)."""
    ptrs = sorted({t.data_ptr() for t in [*model.parameters(), *model.buffers()]})
    return {p for p in ptrs if p % HUGE_PAGE == 0}


def check_moved(model: nn.Module, before: dict[str, torch.Tensor]) -> None:
    after = dict([*model.named_parameters(), *model.named_buffers()])
    assert after.keys() == before.keys()
    for name, t in after.items():
        assert t.dtype == before[name].dtype and t.shape == before[name].shape, name
        assert torch.equal(t, before[name]), name
        assert t.data_ptr() % weight_arena.ALIGN == 0, name


def test_every_weight_keeps_its_values_in_one_block():
    torch.manual_seed(0)
    model = Tied()
    before, aside, embed = snapshot(model), model.aside.data_ptr(), model.embed.weight
    pack_weights(model)
    check_moved(model, before)
    assert model.head.weight is model.embed.weight is embed  # still one Parameter
    assert model.aside.data_ptr() == aside
    assert len(blocks_of(model)) == 1
    model.whole[3].fill_(9.0)  # still one storage: a write shows through the other
    assert torch.equal(model.rows[1], torch.full((16,), 9.0))


def test_a_model_past_a_block_takes_several_each_tensor_once(monkeypatch):
    monkeypatch.setattr(weight_arena, "BLOCK_BYTES", 40 << 10)
    torch.manual_seed(1)
    model = Tied()
    before = snapshot(model)
    pack_weights(model)
    check_moved(model, before)
    starts = blocks_of(model)
    assert len(starts) >= 3  # 77 KB of embedding alone: larger than a block, one of its own
    ptrs = [t.data_ptr() for t in {id(t): t for t in [*model.parameters(),
                                                      *model.buffers()]}.values()]
    assert len(ptrs) == len(set(ptrs))


@pytest.mark.skipif(not native_gemm_available(), reason="gemm.c needs AVX512-BF16")
def test_gemm_c_packed_weights_move_and_compute_the_same():
    """NativeLinear's packed bf16 weight and float32 bias are buffers: they move too,
    and its product is bit for bit what it was."""
    torch.manual_seed(2)
    model = nn.Sequential(NativeLinear(nn.Linear(256, 512)), NativeLinear(nn.Linear(512, 128)))
    x = torch.randn(5, 256).to(torch.bfloat16)
    y, before = model(x), snapshot(model)
    pack_weights(model)
    check_moved(model, before)
    assert min(m.packed.data_ptr() for m in model) in blocks_of(model)
    assert torch.equal(model(x), y)


def thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "none"


def test_linux_backs_the_blocks_with_huge_pages():
    """Where Linux offers transparent huge pages, the blocks are on them: what
    pack_weights reports is what smaps shows."""
    if thp_mode() in ("never", "none"):
        pytest.skip(f"transparent huge pages: {thp_mode()}")
    model = nn.Sequential(nn.Linear(1024, 2048), nn.Linear(2048, 1024))  # 16 MB of float32
    before = snapshot(model)
    on_huge_pages = pack_weights(model)
    check_moved(model, before)
    start = min(t.data_ptr() for t in model.parameters())
    assert on_huge_pages >= 8 * HUGE_PAGE
    assert huge_bytes_at(start, start + on_huge_pages) >= on_huge_pages - HUGE_PAGE


def generate(model: str, huge: str, monkeypatch) -> list[list[int]]:
    monkeypatch.setenv("LLMSERVE_CPU_HUGE_PAGES", huge)
    engine = LLMEngine(EngineConfig(model=model, kv_cache_memory=1 << 22))
    try:
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        for prompt in ([5, 6, 7, 8], list(range(100, 140)), [42] * 9):
            engine.add_request(prompt, params)
        done = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
        return [done[k] for k in sorted(done)]
    finally:
        engine.shutdown()


def test_the_engine_generates_the_same_tokens_on_huge_pages(tiny_llama, monkeypatch):
    assert (generate(str(tiny_llama), "1", monkeypatch)
            == generate(str(tiny_llama), "0", monkeypatch))
