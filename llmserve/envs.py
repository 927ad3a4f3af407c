"""Where llmserve keeps its files: shared by every layer, importing nothing of llmserve."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """Converted checkpoints, built C kernels: ``$LLMSERVE_CACHE``, else the user's
    cache folder (``~/.cache/llmserve`` on Linux)."""
    if os.environ.get("LLMSERVE_CACHE"):  # set: platformdirs is not needed (GPU image)
        return Path(os.environ["LLMSERVE_CACHE"])
    from platformdirs import user_cache_dir
    return Path(user_cache_dir("llmserve"))


def kv_transfer_secret() -> bytes | None:
    """The deployment's shared secret for the P/D side channel
    (``$LLMSERVE_KV_TRANSFER_SECRET``; the operator sets it from a Secret), or None."""
    secret = os.environ.get("LLMSERVE_KV_TRANSFER_SECRET", "")
    return secret.encode() if secret else None
