"""``hf://ORG/REPO[@REVISION]``: a snapshot of a Hugging Face Hub repo, in the Hub's cache.

Only what the engine reads is downloaded: the config, the tokenizer files and the
safetensors weights (never ``.bin``, ``.pth``, ``.gguf``, ONNX or subfolders). With a
``model.safetensors.index.json`` only the shards it names are fetched (and loaded), so
a repo that also carries another copy of the weights (Mistral's
``consolidated.safetensors``) costs no second download. The snapshot lives in
huggingface_hub's own cache (``HF_HUB_CACHE``, else ``HF_HOME/hub``, else
``~/.cache/huggingface/hub``), so it is shared with transformers, vLLM and
``hf download``, survives restarts when that is a volume, and works offline
(``HF_HUB_OFFLINE=1``) once cached. ``HF_TOKEN`` opens private and gated repos.
huggingface_hub draws its own progress bars (on a terminal).

Environment variables are read when a model is resolved, not only when
huggingface_hub is imported, so a process (or a test) that sets them late is obeyed.
Every failure becomes a one-line ``ModelLoadError``.
"""

from __future__ import annotations

import os
import re
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from llmserve import envs
from llmserve.errors import ModelLoadError
from llmserve.model_executor.model_loader.weights import INDEX_FILE, indexed_shards

SCHEME = "hf://"
CONFIG_FILES = ("config.json", "generation_config.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "merges.txt", "chat_template.jinja")
WEIGHTS_PATTERN = "*.safetensors"
# The loader reads the top level of the snapshot only; subfolders (original/, onnx/,
# other formats or quantizations) are never fetched.
IGNORE_PATTERNS = ("*/*",)

_REPO_ID = re.compile(r"^(?:[A-Za-z0-9][\w.-]*/)?[A-Za-z0-9][\w.-]*$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_TRUE = {"1", "ON", "YES", "TRUE"}


@dataclass(frozen=True)
class HubSource:
    repo_id: str
    revision: str | None  # None: the repo's default branch ("main")

    @property
    def display(self) -> str:
        return self.repo_id + (f"@{self.revision}" if self.revision else "")


@dataclass(frozen=True)
class HubSettings:
    cache_dir: str
    endpoint: str
    token: str | None
    offline: bool
    etag_timeout: float
    unreachable: str | None = None  # why the Hub did not answer, once it did not


def parse_uri(uri: str) -> HubSource:
    """``hf://ORG/REPO[@REVISION]`` -> (repo id, revision)."""
    body = uri[len(SCHEME):] if uri.startswith(SCHEME) else uri
    repo_id, at, revision = body.partition("@")
    if (not _REPO_ID.match(repo_id) or ".." in repo_id or repo_id.endswith((".", "-"))
            or (at and not revision) or any(c.isspace() for c in revision)):
        raise ModelLoadError(f"model source {uri!r} is not of the form "
                             f"hf://ORG/REPO or hf://ORG/REPO@REVISION")
    return HubSource(repo_id, revision or None)


def settings() -> HubSettings:
    """huggingface_hub's settings, from the environment as it is now (huggingface_hub
    itself reads most of them once, at import)."""
    from huggingface_hub import constants

    def path(value: str) -> str:
        return os.path.expandvars(os.path.expanduser(value))

    # The precedence of huggingface_hub.constants: HF_HUB_CACHE, the legacy
    # HUGGINGFACE_HUB_CACHE, HF_HOME/hub, XDG_CACHE_HOME/huggingface/hub.
    if envs.HF_HUB_CACHE:
        cache = path(envs.HF_HUB_CACHE)
    elif envs.HUGGINGFACE_HUB_CACHE:
        cache = path(envs.HUGGINGFACE_HUB_CACHE)
    elif envs.HF_HOME:
        cache = os.path.join(path(envs.HF_HOME), "hub")
    elif envs.XDG_CACHE_HOME:
        cache = os.path.join(path(envs.XDG_CACHE_HOME), "huggingface", "hub")
    else:
        cache = constants.HF_HUB_CACHE
    offline_env = envs.HF_HUB_OFFLINE or envs.TRANSFORMERS_OFFLINE
    # Offline if either says so: huggingface_hub refuses to connect when its
    # import-time constant is set, whatever we pass.
    offline = (offline_env or "").upper() in _TRUE or bool(constants.HF_HUB_OFFLINE)
    token = (envs.HF_TOKEN or envs.HUGGING_FACE_HUB_TOKEN or "").strip() or None
    default_timeout = getattr(constants, "HF_HUB_ETAG_TIMEOUT", 10)
    try:
        etag_timeout = float(envs.HF_HUB_ETAG_TIMEOUT or default_timeout)
    except ValueError:
        etag_timeout = float(default_timeout)
    endpoint = (envs.HF_ENDPOINT or constants.ENDPOINT).rstrip("/")
    return HubSettings(cache, endpoint, token, offline, etag_timeout)


def download(uri: str) -> Path:
    """The local snapshot directory of ``uri``, downloaded (or completed) if needed."""
    src = parse_uri(uri)
    s = settings()
    from huggingface_hub import snapshot_download

    start = time.monotonic()
    if not s.offline:
        print(f"resolving {uri} on {s.endpoint} (cache: {s.cache_dir}; config, tokenizer "
              f"and safetensors only)", file=sys.stderr, flush=True)
        s = _probe(src, s)
    # Unreachable, huggingface_hub would fall back to the cache too, but only after
    # retrying each listing for half a minute: go straight to the cache instead.
    common = dict(repo_id=src.repo_id, cache_dir=s.cache_dir, token=s.token,
                  endpoint=s.endpoint, local_files_only=s.offline or bool(s.unreachable),
                  etag_timeout=s.etag_timeout, ignore_patterns=list(IGNORE_PATTERNS))
    # 1. The small files, which pin the revision to a commit (and record the branch or
    #    tag in refs/, for offline use) and name the shards.
    with _errors(src, s):
        folder = Path(snapshot_download(
            revision=src.revision,
            allow_patterns=[*CONFIG_FILES, *TOKENIZER_FILES, INDEX_FILE], **common))
    # 2. The weights of that same commit (a branch may move in between).
    commit = folder.name
    shards = _indexed_shards(folder, src)
    with _errors(src, s):
        folder = Path(snapshot_download(revision=commit,
                                        allow_patterns=shards or [WEIGHTS_PATTERN], **common))
    _check_snapshot(folder, src, s, commit, shards)
    how = ", offline" if s.offline else ", from the cache" if s.unreachable else ""
    print(f"{uri}: commit {commit} in {folder} ({time.monotonic() - start:.1f} s{how})",
          file=sys.stderr, flush=True)
    return folder


def _probe(src: HubSource, s: HubSettings) -> HubSettings:
    """Ask the Hub for the revision once, without retries. A missing repo, revision or
    access is an error; no answer (or a 5xx) marks the Hub unreachable."""
    from huggingface_hub import HfApi
    from huggingface_hub.utils import (
        HfHubHTTPError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )
    try:
        HfApi(endpoint=s.endpoint, token=s.token).repo_info(
            src.repo_id, revision=src.revision, timeout=s.etag_timeout)
    except (RepositoryNotFoundError, RevisionNotFoundError) as e:  # gated too
        raise ModelLoadError(_message(e, src, s)) from e
    except HfHubHTTPError as e:
        status = _status(e)
        if status is not None and status < 500 and status != 429:
            raise ModelLoadError(_message(e, src, s)) from e
        reason = f"it answered HTTP {status}"
    except Exception as e:  # noqa: BLE001 - connection, DNS, TLS, timeout, proxy errors
        reason = f"{type(e).__name__}: {_first_line(e)}"
    else:
        return s
    print(f"cannot reach the Hugging Face Hub at {s.endpoint} ({reason}); looking in the "
          f"cache", file=sys.stderr, flush=True)
    return replace(s, unreachable=reason)


def _indexed_shards(folder: Path, src: HubSource) -> list[str]:
    if not (folder / INDEX_FILE).is_file():
        return []
    try:
        return indexed_shards(folder)
    except ModelLoadError as e:
        raise ModelLoadError(f"Hugging Face repo {src.display!r}: {e}") from e


def _check_snapshot(folder: Path, src: HubSource, s: HubSettings, commit: str,
                    shards: list[str]) -> None:
    where = (f"Hugging Face repo {src.display!r} (commit {commit[:12]}"
             + (f", from the cache at {s.cache_dir}" if s.offline else "") + ")")
    if not (folder / "config.json").is_file():
        raise ModelLoadError(f"{where} has no config.json: it is not a transformers checkpoint "
                             f"(for a GGUF-only repo, download the .gguf file and pass its path)")
    missing = [f for f in shards if not (folder / f).is_file()]
    if missing:
        raise ModelLoadError(f"{where} lacks {len(missing)} of the {len(shards)} weight shards "
                             f"its index names ({missing[0]}, ...): the cached snapshot is "
                             f"incomplete; run once with network access to complete it")
    if not shards and not list(folder.glob(WEIGHTS_PATTERN)):
        raise ModelLoadError(f"{where} has no *.safetensors weights; llmserve loads only "
                             f"safetensors (not .bin, .pth or .gguf files in a repo)")


class _errors:
    """Translate huggingface_hub's exceptions into one-line ModelLoadErrors."""

    def __init__(self, src: HubSource, s: HubSettings):
        self.src, self.s = src, s

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc is None or isinstance(exc, (ModelLoadError, KeyboardInterrupt, SystemExit)):
            return False
        raise ModelLoadError(_message(exc, self.src, self.s)) from exc


def _message(exc: BaseException, src: HubSource, s: HubSettings) -> str:
    from huggingface_hub.utils import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )
    repo, url = src.repo_id, f"https://huggingface.co/{src.repo_id}"
    k8s = " (on Kubernetes: spec.model.hfTokenSecret)"
    has_token = s.token is not None or _stored_token()
    if isinstance(exc, GatedRepoError):
        if has_token:
            return (f"Hugging Face repo {repo!r} is gated and the token in use has no access "
                    f"to it: accept its conditions at {url} with the token's account")
        return (f"Hugging Face repo {repo!r} is gated: accept its conditions at {url} and set "
                f"HF_TOKEN to a token of an account with access{k8s}")
    if isinstance(exc, RepositoryNotFoundError) or (
            isinstance(exc, HfHubHTTPError) and _status(exc) == 401):
        if has_token:
            return (f"Hugging Face repo {repo!r} was not found, or the token in use cannot "
                    f"read it (private repo of another account?)")
        return (f"Hugging Face repo {repo!r} was not found; if it is private, set HF_TOKEN "
                f"to a token that can read it{k8s}")
    if isinstance(exc, RevisionNotFoundError):
        return (f"revision {src.revision!r} was not found in Hugging Face repo {repo!r} "
                f"(a branch, tag or full commit hash is expected)")
    if isinstance(exc, LocalEntryNotFoundError):
        cause = exc.__cause__
        if type(exc).__name__ == "IncompleteSnapshotError":
            return (f"the cached snapshot of Hugging Face repo {src.display!r} in {s.cache_dir} "
                    f"is incomplete and the Hub cannot be reached to complete it"
                    + (" (HF_HUB_OFFLINE=1)" if s.offline
                       else f" at {s.endpoint} ({s.unreachable or _first_line(exc)})"))
        if s.offline or isinstance(cause, OfflineModeIsEnabled):
            return _not_cached(src, s) + " and HF_HUB_OFFLINE=1 forbids downloading it"
        reason = s.unreachable or (f"{type(cause).__name__}: {_first_line(cause)}" if cause
                                   else _first_line(exc))
        return (f"cannot reach the Hugging Face Hub at {s.endpoint} ({reason}) and "
                + _not_cached(src, s))
    if isinstance(exc, PermissionError):
        return (f"cannot write the Hugging Face cache {s.cache_dir} ({exc.strerror}: "
                f"{exc.filename}); set HF_HOME or HF_HUB_CACHE to a writable directory")
    if isinstance(exc, HfHubHTTPError):
        return (f"downloading Hugging Face repo {src.display!r} from {s.endpoint} failed: "
                f"{_first_line(exc)}")
    return (f"downloading Hugging Face repo {src.display!r} from {s.endpoint} failed: "
            f"{type(exc).__name__}: {_first_line(exc)}")


def _not_cached(src: HubSource, s: HubSettings) -> str:
    """'<what> is not in the cache at <dir>', naming what the cache does hold."""
    repo_dir = Path(s.cache_dir) / ("models--" + src.repo_id.replace("/", "--"))
    snapshots = repo_dir / "snapshots"
    if not snapshots.is_dir() or not any(snapshots.iterdir()):
        return f"Hugging Face repo {src.repo_id!r} is not in the cache at {s.cache_dir}"
    refs = sorted(str(p.relative_to(repo_dir / "refs")) for p in (repo_dir / "refs").rglob("*")
                  if p.is_file()) if (repo_dir / "refs").is_dir() else []
    commits = sorted(p.name[:12] for p in snapshots.iterdir() if _COMMIT.match(p.name))
    held = ", ".join(refs + commits) or "none"
    revision = src.revision or "main"
    return (f"revision {revision!r} of Hugging Face repo {src.repo_id!r} is not in the cache "
            f"at {s.cache_dir} (cached: {held})")


def _status(exc) -> int | None:
    response = getattr(exc, "response", None)
    return getattr(response, "status_code", None)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _stored_token() -> bool:
    """A token from `hf auth login` (the token file in HF_HOME) counts too."""
    try:
        from huggingface_hub import get_token
        return get_token() is not None
    except Exception:  # noqa: BLE001 - only used to word a message
        return False


ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def download_adapter(uri: str) -> Path:
    """The local snapshot of a PEFT LoRA adapter repo (its config and safetensors only),
    downloaded if needed; the same cache, token and offline rules as models."""
    src = parse_uri(uri)
    s = settings()
    from huggingface_hub import snapshot_download

    if not s.offline:
        s = _probe(src, s)
    with _errors(src, s):
        folder = Path(snapshot_download(
            repo_id=src.repo_id, revision=src.revision, cache_dir=s.cache_dir, token=s.token,
            endpoint=s.endpoint, local_files_only=s.offline or bool(s.unreachable),
            etag_timeout=s.etag_timeout, allow_patterns=list(ADAPTER_FILES)))
    missing = [f for f in ADAPTER_FILES if not (folder / f).is_file()]
    if missing:
        raise ModelLoadError(f"Hugging Face repo {src.display!r} has no {missing[0]}: it is "
                             f"not a PEFT LoRA adapter saved as safetensors")
    return folder
