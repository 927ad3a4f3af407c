"""The GPU fast path (CUDA graphs, pinned staging, device block tables, profiled KV
sizing), checked on CPU as far as a CPU can: the Triton kernels run under
TRITON_INTERPRET=1 (see conftest), the graphs run their static padded path without
capture, and the staging buffer is not pinned. Speed and the capture itself wait for
a GPU run (benchmarks/gpu/gpu_check.sh)."""

from __future__ import annotations

import copy
import logging
import random
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch

from llmserve import SamplingParams
from llmserve.config import EngineConfig, cuda_graphs_off_because
from llmserve.engine.llm_engine import LLMEngine
from llmserve.worker.cuda_graphs import default_sizes, uncapturable
from llmserve.worker.kv_sizing import kv_budget_from_profile
from llmserve.worker.step_buffers import (
    DeviceBlockTables,
    StagingBuffer,
    enable_fast_path,
    enable_fast_path_from_config,
)

CPU = torch.device("cpu")


# --- pinned staging: packing and unpacking ------------------------------------------------
def test_staging_buffer_round_trips_fields_of_every_dtype_and_grows():
    buf = StagingBuffer(CPU, capacity=64)
    rng = random.Random(0)
    for step in range(20):
        fields = [([rng.randrange(-2**40, 2**40) for _ in range(rng.randrange(0, 50))],
                   torch.int64),
                  ([rng.randrange(-2**30, 2**30) for _ in range(rng.randrange(0, 7))],
                   torch.int32),
                  ([], torch.int64),
                  ([rng.randrange(0, 100) for _ in range(3)], torch.int32)]
        views = buf.stage(fields)
        for (values, dtype), view in zip(fields, views):
            assert view.dtype == dtype and view.tolist() == values, step
    assert buf.host.numel() > 64  # grew past its first capacity
    assert buf.dev.data_ptr() != buf.host.data_ptr()  # a copy, not the host memory


# --- device block tables ----------------------------------------------------------------
def test_device_block_tables_equal_a_full_rebuild_after_random_steps():
    """Random steps of growth, copy-on-write, preemption (a new table), swap-out
    (absent, then back with other blocks), finishing and new sequences: the device
    rows always hold each sequence's table, and steps without changes write nothing."""
    rng = random.Random(1)
    max_rows, max_blocks = 8, 12
    dt = DeviceBlockTables(max_rows, max_blocks, CPU)
    tables: dict[int, list[int]] = {}
    next_id = 0
    total_writes = full_writes = 0
    for step in range(400):
        for sid in list(tables):
            r = rng.random()
            if r < 0.05:
                del tables[sid]  # finished
            elif r < 0.1:
                tables[sid] = [rng.randrange(100) for _ in range(rng.randint(1, 4))]  # recompute
            elif r < 0.15 and tables[sid]:
                tables[sid][-1] = rng.randrange(100)  # copy-on-write of the last block
            elif r < 0.4 and len(tables[sid]) < max_blocks:
                tables[sid].append(rng.randrange(100))  # grew a block
        while len(tables) < max_rows and rng.random() < 0.3:
            tables[next_id] = [rng.randrange(100) for _ in range(rng.randint(1, 6))]
            next_id += 1
        # Some sequences sit out a step (swapped out, or not scheduled), in any order.
        ids = [s for s in tables if rng.random() < 0.85]
        rng.shuffle(ids)
        if not ids:
            continue
        plan = dt.plan(ids, [tables[s] for s in ids])
        total_writes += len(plan[1])
        full_writes += sum(len(tables[s]) for s in ids)
        out = dt.apply(*(torch.tensor(p, dtype=d) for p, d in
                         zip(plan, (torch.int64, torch.int64, torch.int64, torch.int32))))
        for i, sid in enumerate(ids):
            assert out[i, :len(tables[sid])].tolist() == tables[sid], (step, sid)
        again = dt.plan(ids, [tables[s] for s in ids])
        assert again[1:] == ([], [], []), "an unchanged step must write nothing"
    assert 0 < total_writes < full_writes / 3  # incremental: far fewer than full uploads


def test_device_block_tables_grow_past_max_num_seqs():
    """One request's parallel samples may exceed max_num_seqs when nothing else runs."""
    dt = DeviceBlockTables(2, 4, CPU)
    tables = [[i, i + 10] for i in range(5)]
    plan = dt.plan(list(range(5)), tables)
    out = dt.apply(*(torch.tensor(p, dtype=d) for p, d in
                     zip(plan, (torch.int64, torch.int64, torch.int64, torch.int32))))
    assert dt.table.shape[0] == 8 and out[:, :2].tolist() == tables


def test_device_block_tables_refuse_a_table_longer_than_their_rows():
    dt = DeviceBlockTables(2, 3, CPU)
    with pytest.raises(ValueError, match="exceeds the device table"):
        dt.plan([0], [[1, 2, 3, 4]])


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_staged_inputs_and_device_tables_through_preemption_and_copy_on_write(tiny_llama, mode):
    """The engine with a tight KV budget (preemptions), prefix caching and parallel
    samples (copy-on-write), on the CPU torch path with staged inputs and device block
    tables: every step's device tables hold each sequence's table, and the outputs are
    the default path's."""
    block_bytes = 2 * 2 * 16 * 2 * 16 * 4  # the tiny model's KV block in fp32
    kw = dict(model=str(tiny_llama), device="cpu", dtype="float32", preemption_mode=mode,
              kv_cache_memory=24 * block_bytes, swap_space=200 * block_bytes,
              max_num_batched_tokens=64, watermark=0.0, max_num_seqs=8, num_threads=1)
    rng = random.Random(2)
    prefix = [rng.randrange(3, 1000) for _ in range(40)]
    prompts = [prefix + [rng.randrange(3, 1000) for _ in range(rng.randint(1, 40))]
               for _ in range(6)]
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=40, ignore_eos=True)

    def run(engine):
        reqs = [engine.add_request(p, params) for p in prompts]
        while engine.has_unfinished():
            engine.step()
        engine.block_manager.check_all_free()
        return [[s.output_token_ids for s in r.sequences] for r in reqs]

    default = run(LLMEngine(EngineConfig(**kw)))
    engine = LLMEngine(EngineConfig(**kw))
    enable_fast_path(engine.runner, engine.max_model_len, pinned_staging=True,
                     device_block_tables=True)
    builder = engine.runner.step_builder
    real_build, checked = builder.build, []

    def build(inputs, seq_ids, prev_tokens=None):
        ids, pos, meta, rows = real_build(inputs, seq_ids, prev_tokens)
        for i, table in enumerate(inputs.block_tables):
            assert meta.block_tables[i, :len(table)].tolist() == table
        assert rows.tolist() == inputs.sample_rows and pos.tolist() == inputs.positions
        checked.append(len(seq_ids))
        return ids, pos, meta, rows

    builder.build = build
    assert run(engine) == default
    assert engine.scheduler.num_preemptions > 0 and len(checked) > 20


# --- CUDA-graph buckets, without capture, under the Triton interpreter -------------------
def test_default_bucket_sizes():
    assert default_sizes(1) == [1]
    assert default_sizes(6) == [1, 2, 4, 6]
    assert default_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert default_sizes(32)[-3:] == [16, 24, 32]


def _greedy(engine, prompts, lengths):
    reqs = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
            for p, n in zip(prompts, lengths)]
    while engine.has_unfinished():
        engine.step()
    return [r.sequences[0].output_token_ids for r in reqs]


class _FakeGraph:
    """torch.cuda.CUDAGraph on CPU: the "capture" records the forward's arguments and
    output; a replay runs the forward again on whatever the static buffers hold then
    and writes the captured output tensor, as a real replay does."""

    def __init__(self):
        self.call = None

    def replay(self):
        forward, args, out = self.call
        out.copy_(forward(*args))


def _fake_cuda_graphs(monkeypatch, runner):
    @contextmanager
    def graph(g, pool=None):
        real = runner.forward

        def record(*args):
            out = real(*args)
            g.call = (real, args, out)
            return out

        runner.forward = record
        try:
            yield
        finally:
            del runner.forward

    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)


@pytest.mark.parametrize("max_model_len,capture", [(128, False), (512, False), (128, True)])
def test_padded_buckets_give_the_greedy_tokens_of_the_eager_path(tiny_llama, max_model_len,
                                                                capture, monkeypatch):
    """The static, padded bucket path (staged inputs, device block tables, a fixed
    split count per bucket, padding slots -1) decodes exactly what the eager path does.
    Five streams of different lengths make batches of 5, 4, 3, 2, 1 in buckets 8, 4, 4,
    2, 1, one decode step each (Triton's interpreter is slow): padding rows are real, and
    a padding row that wrote the KV cache or a wrong split count would change tokens.
    Split counts: 1 at max_model_len 128, 8 at 512 (the shortest context that splits:
    every split is 4 blocks, and the 60-token prompt's decodes write position 64, in its
    second split, while the other streams leave splits empty).
    ``capture``: through capture and replay, with a stand-in for CUDA graphs that
    replays by re-running the captured forward on the static buffers (buckets are
    captured lazily, in the middle of steps)."""
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), device="cpu", dtype="float32",
                                    attention_backend="triton", kv_cache_memory=4 << 20,
                                    max_num_seqs=8, max_model_len=max_model_len,
                                    enable_prefix_caching=False, num_threads=1))
    rng = random.Random(max_model_len)
    prompts = [[rng.randrange(3, 1000) for _ in range(n)] for n in (5, 40, 17, 60, 9)]
    lengths = [2, 3, 4, 6, 5]
    eager = _greedy(engine, prompts, lengths)

    runner = engine.runner
    if capture:
        _fake_cuda_graphs(monkeypatch, runner)
    enable_fast_path(runner, engine.max_model_len, pinned_staging=True,
                     device_block_tables=True, graph_sizes=[1, 2, 4, 8], capture=capture)
    assert max(runner.graphs.splits.values()) == (1 if max_model_len == 128 else 8)
    used = []
    real_run = runner.graphs.run

    def spy(b, ids, pos, meta):
        used.append((b, ids.shape[0]))
        return real_run(b, ids, pos, meta)

    runner.graphs.run = spy
    assert _greedy(engine, prompts, lengths) == eager
    assert {(8, 5), (4, 3), (2, 2), (1, 1)} <= set(used)
    assert sorted(runner.graphs.graphs) == ([1, 2, 4, 8] if capture else [])
    engine.block_manager.check_all_free()


# --- profiled KV sizing: the arithmetic ---------------------------------------------------
def test_kv_budget_from_profile():
    gib = 1 << 30
    # 80 GiB device, 0.9 usable = 72; the profile peaked at 20; 1 GiB used outside torch
    # (context): 51 GiB for the KV pool.
    budget = kv_budget_from_profile(total=80 * gib, free=58 * gib, utilization=0.9,
                                    torch_peak=20 * gib, torch_reserved=21 * gib)
    assert budget == int(80 * gib * 0.9) - 20 * gib - 1 * gib
    # Reserved above used (nothing outside torch) never adds memory.
    assert kv_budget_from_profile(total=10 * gib, free=9 * gib, utilization=0.5,
                                  torch_peak=gib, torch_reserved=2 * gib) == 4 * gib
    with pytest.raises(ValueError, match="no memory left for the KV cache"):
        kv_budget_from_profile(total=10 * gib, free=gib, utilization=0.5, torch_peak=5 * gib,
                               torch_reserved=5 * gib)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_profiled_forward_runs_a_full_budget_step_and_sizes_from_its_peak(tiny_llama, backend,
                                                                        monkeypatch):
    """The profile's dummy step (on CPU, with the CUDA memory queries stubbed): one
    sequence of max_num_batched_tokens tokens, more than the model's positions, the
    engine's KV cache untouched, and the budget from the stubbed numbers."""
    from llmserve.worker import kv_sizing
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), device="cpu", dtype="float32",
                                    kv_cache_memory=1 << 20, max_model_len=256,
                                    attention_backend=backend, num_threads=1))
    runner = engine.runner
    gib = 1 << 30
    for name, fn in {"empty_cache": lambda: None, "synchronize": lambda d=None: None,
                     "reset_peak_memory_stats": lambda d=None: None,
                     "max_memory_allocated": lambda d=None: 3 * gib,
                     "memory_reserved": lambda d=None: 4 * gib,
                     "mem_get_info": lambda d=None: (10 * gib, 16 * gib)}.items():
        monkeypatch.setattr(torch.cuda, name, fn)
    seen = []
    real_forward = runner.model.forward
    monkeypatch.setattr(runner.model, "forward",
                        lambda ids, pos: seen.append((ids.shape[0], int(pos.max())))
                        or real_forward(ids, pos))
    before = runner.kv_cache.storage.clone()
    runner.model.bind_kv_cache(runner.kv_cache.storage)
    budget = kv_sizing.profile_kv_budget(runner, 300, 8)
    assert seen == [(300, 255)]  # positions wrap at the model's 256
    # 0.9 x 16 - 3 (peak) - (6 used - 4 reserved) outside torch
    assert budget == int(16 * gib * 0.9) - 3 * gib - 2 * gib
    assert torch.equal(runner.kv_cache.storage, before)


# --- flags: refused where they cannot work ------------------------------------------------
@pytest.mark.parametrize("flag", ["cuda_graphs", "pinned_staging", "device_block_tables",
                                  "profile_kv_cache"])
def test_gpu_flags_are_refused_on_cpu(flag):
    name = "--" + flag.replace("_", "-")
    with pytest.raises(ValueError, match=f"{name}: GPU optimisations that need --device cuda"):
        EngineConfig(model="none", device="cpu", **{flag: True})


def test_cuda_graph_sizes_are_checked():
    with pytest.raises(ValueError, match=r"with CUDA graphs off \(the engine runs on 'cpu'"):
        EngineConfig(model="none", device="cpu", cuda_graph_sizes="1,2")
    with pytest.raises(ValueError, match=r"in \[1, max_num_seqs=4\]"):
        EngineConfig(model="none", device="cpu", cuda_graphs=True, cuda_graph_sizes="1,8",
                     max_num_seqs=4)
    with pytest.raises(ValueError, match="comma-separated integers"):
        EngineConfig(model="none", device="cpu", cuda_graphs=True, cuda_graph_sizes="1,x")


# --- CUDA graphs by default, where they apply ---------------------------------------------
def test_cuda_graphs_apply_by_default_to_one_cuda_rank_with_triton_attention():
    assert cuda_graphs_off_because("cuda", 1, True, False) is None
    assert cuda_graphs_off_because("cuda:0", 1, True, False) is None
    assert "'cpu', not CUDA" in cuda_graphs_off_because("cpu", 1, True, False)
    assert "CUDA_VISIBLE_DEVICES" in cuda_graphs_off_because("cuda:1", 1, True, False)
    assert "--tensor-parallel-size" in cuda_graphs_off_because("cuda", 2, True, False)
    assert "--attention-backend torch" in cuda_graphs_off_because("cuda", 1, False, False)
    assert "--compile" in cuda_graphs_off_because("cuda", 1, True, True)
    assert "--kv-role prefill" in cuda_graphs_off_because("cuda", 1, True, False, "prefill")
    assert cuda_graphs_off_because("cuda", 1, True, False, "decode") is None


@pytest.fixture
def cuda_config(monkeypatch):
    """EngineConfig as on a CUDA machine: its checks ask only is_available()."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    return lambda **kw: EngineConfig(model="none", device="cuda", **kw)


def test_on_cuda_the_default_turns_graphs_on_and_a_rebuilt_config_decides_again(cuda_config):
    import dataclasses
    default = cuda_config()
    assert default.cuda_graphs is None and default.use_cuda_graphs
    assert default.cuda_graphs_off_because is None
    # The field keeps what was asked (None), so a rebuilt config with another backend
    # turns graphs off instead of holding an "explicit" True against it.
    torch_attention = dataclasses.replace(default, attention_backend="torch")
    assert not torch_attention.use_cuda_graphs
    assert "--attention-backend torch" in torch_attention.cuda_graphs_off_because
    assert not cuda_config(cuda_graphs=False).use_cuda_graphs
    assert cuda_config(cuda_graphs=True, cuda_graph_sizes="1,2").use_cuda_graphs
    with pytest.raises(ValueError, match="cannot run with --attention-backend torch"):
        cuda_config(cuda_graphs=True, attention_backend="torch")
    with pytest.raises(ValueError, match=r"CUDA graphs off \(--no-cuda-graphs\)"):
        cuda_config(cuda_graphs=False, cuda_graph_sizes="1,2")


def test_the_default_resolves_off_on_cpu_with_its_reason():
    default = EngineConfig(model="none", device="cpu")
    assert default.cuda_graphs is None and not default.use_cuda_graphs
    assert "not CUDA" in default.cuda_graphs_off_because
    asked_off = EngineConfig(model="none", device="cpu", cuda_graphs=False)
    assert not asked_off.use_cuda_graphs and asked_off.cuda_graphs_off_because is None


def thawed(config: EngineConfig) -> EngineConfig:
    """A copy of a resolved (frozen) configuration that a test may change."""
    config = copy.copy(config)
    del config.__dict__["_frozen"]
    return config


def test_graphs_the_config_decided_on_are_attached_at_load(tiny_llama):
    """What the runner does with use_cuda_graphs (as decided on CUDA): its buckets, the
    default ones or --cuda-graph-sizes; on a CPU without capture."""
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), device="cpu", dtype="float32",
                                    attention_backend="triton", kv_cache_memory=4 << 20,
                                    max_num_seqs=8, max_model_len=128, num_threads=1))
    runner = engine.runner
    assert runner.graphs is None
    runner.config = thawed(runner.config)  # the engine's is frozen: decide as CUDA would
    runner.config.use_cuda_graphs = True
    enable_fast_path_from_config(runner, engine.max_model_len)
    assert runner.graphs.sizes == [1, 2, 4, 8] and not runner.graphs.capture
    runner.config.cuda_graph_sizes = [1, 2]
    enable_fast_path_from_config(runner, engine.max_model_len)
    assert runner.graphs.sizes == [1, 2]


@pytest.mark.parametrize("argv, value", [([], None), (["--cuda-graphs"], True),
                                         (["--no-cuda-graphs"], False)])
def test_cli_cuda_graphs_on_off_or_the_default_and_what_up_hands_on(argv, value):
    import argparse

    from llmserve.entrypoints.cli import add_engine_args, engine_argv
    p = argparse.ArgumentParser()
    add_engine_args(p)
    args = p.parse_args(argv)
    assert args.cuda_graphs is value
    assert [a for a in engine_argv(args) if "cuda-graphs" in a] == argv


def test_a_host_side_expert_loop_keeps_graphs_off_or_refuses_an_explicit_ask(caplog):
    from llmserve.model_executor.layers.fused_moe.layer import SparseMoeBlock

    def expert():  # what use_triton_kernel stacks: bias-free gate_up and down Linears
        return SimpleNamespace(gate_up_proj=torch.nn.Linear(16, 16, bias=False),
                               down_proj=torch.nn.Linear(8, 16, bias=False))

    block = SparseMoeBlock(16, 4, 2, True, make_expert=lambda: torch.nn.Module())
    for module, parts in zip(block.experts, (expert() for _ in range(4))):
        module.gate_up_proj, module.down_proj = parts.gate_up_proj, parts.down_proj
    model = torch.nn.Sequential(block)
    assert "in a loop on the host" in uncapturable(model)
    config = EngineConfig(model="none", device="cpu")
    config.use_cuda_graphs = True  # as the default decides on CUDA
    runner = SimpleNamespace(config=config, model=model, device=CPU, graphs=None,
                             step_builder=None)
    with caplog.at_level(logging.INFO, "llmserve.worker.step_buffers"):
        enable_fast_path_from_config(runner, 256)
    assert runner.graphs is None and "CUDA graphs off: SparseMoeBlock" in caplog.text
    config.cuda_graphs = True  # --cuda-graphs
    with pytest.raises(ValueError, match="serve this model with --no-cuda-graphs"):
        enable_fast_path_from_config(runner, 256)
    assert block.use_triton_kernel()  # experts routed on the device: capturable
    assert uncapturable(model) is None


def test_gpu_flags_reach_the_engine_config_from_the_cli():
    import argparse

    from llmserve.entrypoints.cli import add_engine_args, engine_argv
    p = argparse.ArgumentParser()
    add_engine_args(p)
    argv = ["--cuda-graphs", "--cuda-graph-sizes", "1,2,8", "--pinned-staging",
            "--device-block-tables", "--profile-kv-cache"]
    args = p.parse_args(argv)
    assert args.cuda_graphs and args.pinned_staging and args.device_block_tables
    assert args.profile_kv_cache and args.cuda_graph_sizes == "1,2,8"
    assert set(argv) <= set(engine_argv(args))  # `up` hands them to its engines
