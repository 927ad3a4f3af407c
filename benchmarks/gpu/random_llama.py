"""Write a random-weight Llama checkpoint of one of ``lib/random_checkpoints.py``'s
shapes (``tiny``, ``smollm2-135m``, ``llama-1b``): the models ``gpu_check.sh`` measures,
written on the GPU machine, which has no hub access.

    python benchmarks/gpu/random_llama.py llama-1b /tmp/llama-1b
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if not __package__:  # run as a file: the repository root, so that `benchmarks` imports
    sys.path.append(str(Path(__file__).resolve().parents[2]))

from benchmarks.lib.random_checkpoints import SHAPES, write_random_llama


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("out", type=Path)
    args = ap.parse_args()
    write_random_llama(args.out, args.shape)
    print(f"wrote {args.shape} to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
