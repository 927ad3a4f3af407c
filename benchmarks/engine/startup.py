"""How long `llmserve up` takes to serve its first chat completion, with warm caches.

Starts `llmserve up` (the built-in model, one engine behind the gateway) `--runs`
times, and times from the process start to the first successful
/v1/chat/completions answer through the gateway. The first run may fill caches (the
GGUF conversion, the C kernels' build); the others are what a restart costs. As a
baseline measured in the same run: a bare `python -c "import torch"` (every engine
pays it), so the ratio says how much start-up costs beyond importing torch.

    python benchmarks/engine/startup.py --runs 3
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

if not __package__:  # run as a file: the repository root, so that `benchmarks` imports
    sys.path.append(str(Path(__file__).resolve().parents[2]))

from benchmarks.lib.paths import RESULTS
from benchmarks.lib.server import poll, stop_server
from llmserve.utils import free_port


def first_answer_s(extra: list[str], timeout: float) -> float:
    port = free_port()
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "llmserve", "up", "--port", str(port),
                             "--host", "127.0.0.1", *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    body = json.dumps({"model": "smollm2-135m-instruct", "max_tokens": 4,
                       "messages": [{"role": "user", "content": "Hello!"}]}).encode()

    def answered() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"llmserve up exited with {proc.returncode}")
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions",
                                     data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status == 200 and bool(json.load(r)["choices"])

    try:
        if poll(answered, timeout, interval=0.1):
            return time.perf_counter() - t0
        raise TimeoutError(f"no answer in {timeout:.0f} s")
    finally:
        stop_server(proc, signal.SIGINT, grace=30)  # `up` stops its engines on SIGINT


def import_torch_s() -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch"], check=True)
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--up-args", default="", help="extra `llmserve up` flags")
    ap.add_argument("--out", default=str(RESULTS / "startup.json"))
    args = ap.parse_args()
    times = [first_answer_s(args.up_args.split(), args.timeout) for _ in range(args.runs)]
    baseline = min(import_torch_s() for _ in range(3))
    warm = statistics.median(times[1:]) if len(times) > 1 else times[0]
    for i, t in enumerate(times):
        print(f"run {i + 1}: first chat completion after {t:5.1f} s")
    print(f"warm start-up (median of runs 2..{len(times)}): {warm:.1f} s; "
          f"`import torch` alone: {baseline:.1f} s (ratio {warm / baseline:.1f}x)")
    with open(args.out, "w") as f:
        json.dump({"runs_s": times, "warm_s": warm, "import_torch_s": baseline}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
