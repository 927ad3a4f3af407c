"""Tensor parallelism from a plain Python script, in a real subprocess: with or without
an ``if __name__ == "__main__":`` guard, the script runs once (its workers never
re-run it) and generates on two ranks."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

ENGINE = ("{path!r}, tensor_parallel_size=2, kv_cache_memory=8 << 20, "
          "max_num_batched_tokens=16")

UNGUARDED = """\
import json, os
from llmserve import LLM, SamplingParams

with open({runs!r}, "a") as f:  # one line each time this file's top level runs
    f.write(f"{{os.getpid()}}\\n")
llm = LLM({engine})
out = llm.generate(["The tensor-parallel script says", [5, 6, 7, 8, 9]],
                   SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
print("TOKENS", json.dumps([o.outputs[0].token_ids for o in out]))
llm.shutdown()
"""

GUARDED = """\
import json, os
from llmserve import LLM, SamplingParams

with open({runs!r}, "a") as f:
    f.write(f"{{os.getpid()}}\\n")


def main():
    llm = LLM({engine})
    out = llm.generate(["The tensor-parallel script says", [5, 6, 7, 8, 9]],
                       SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    print("TOKENS", json.dumps([o.outputs[0].token_ids for o in out]))
    llm.shutdown()


if __name__ == "__main__":
    main()
"""


def run_script(tmp_path, name: str, template: str, model) -> tuple[list, list[str]]:
    """(the token ids it printed, the pids its top level ran in)."""
    runs = tmp_path / f"{name}.runs"
    script = tmp_path / f"{name}.py"
    script.write_text(template.format(runs=str(runs),
                                      engine=ENGINE.format(path=str(model))))
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=600)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    [line] = [s for s in done.stdout.splitlines() if s.startswith("TOKENS ")]
    return json.loads(line[len("TOKENS "):]), runs.read_text().split()


@pytest.fixture(scope="module")
def guarded_tokens(tmp_path_factory, tiny_llama):
    tokens, runs = run_script(tmp_path_factory.mktemp("guarded"), "guarded", GUARDED,
                              tiny_llama)
    assert len(runs) == 1, "the workers re-ran the script's top level"
    return tokens


def test_a_guarded_script_generates_on_two_ranks(guarded_tokens):
    assert [len(t) for t in guarded_tokens] == [6, 6]


def test_an_unguarded_script_generates_the_same_and_runs_once(tmp_path, tiny_llama,
                                                              guarded_tokens):
    """Multiprocessing's spawn would re-run the module in each worker, which would
    build an engine there and die; the workers start without the caller's module."""
    tokens, runs = run_script(tmp_path, "unguarded", UNGUARDED, tiny_llama)
    assert len(runs) == 1, f"the script's top level ran {len(runs)} times"
    assert tokens == guarded_tokens
