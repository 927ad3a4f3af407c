"""Model sources the loader understands: hf://ORG/REPO[@REV], file:///PATH, pvc://CLAIM/PATH.

All offline. hf:// is tested against a Hugging Face cache built here in the Hub's own
layout (blobs, snapshot symlinks, refs) — checked by calling huggingface_hub itself —
and against a small fake Hub on 127.0.0.1 that speaks the HTTP API huggingface_hub
uses (repo info, tree listing, resolve), so the download path, the file filters and
the error messages of real huggingface_hub exceptions are exercised without a network.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest
from huggingface_hub import constants as hub_constants
from huggingface_hub import snapshot_download

from llmserve.errors import ModelLoadError
from llmserve.model_executor.model_loader.sources import PVC_MOUNT, resolve_model

COMMIT_A = "a" * 40  # main: the tiny llama
COMMIT_B = "b" * 40  # branch v1: the same model with only config and weights
HF_ENV = ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "HF_HUB_OFFLINE",
          "TRANSFORMERS_OFFLINE", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_ENDPOINT")


def add_snapshot(cache: Path, repo_id: str, commit: str, files: dict[str, bytes],
                 refs: tuple[str, ...] = ()) -> Path:
    """Write one commit of a repo as huggingface_hub caches it: content-addressed blobs,
    the snapshot's files as relative symlinks to them, refs/<name> holding the commit."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    for name, data in files.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        if not blob.exists():
            blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)  # no newline: huggingface_hub reads it raw
    return snapshot


def checkpoint_files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory, tiny_llama) -> Path:
    cache = tmp_path_factory.mktemp("hf") / "hub"
    files = checkpoint_files(tiny_llama)
    add_snapshot(cache, "org/tiny", COMMIT_A, files, refs=("main",))
    add_snapshot(cache, "org/tiny", COMMIT_B,
                 {k: v for k, v in files.items() if k in ("config.json", "model.safetensors")},
                 refs=("v1",))
    add_snapshot(cache, "org/bin-only", COMMIT_A,
                 {"config.json": files["config.json"], "pytorch_model.bin": b"\0" * 64},
                 refs=("main",))
    index = {"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors",
                                            "b": "model-00002-of-00002.safetensors"}}
    add_snapshot(cache, "org/half", COMMIT_A,
                 {"config.json": files["config.json"],
                  "model.safetensors.index.json": json.dumps(index).encode(),
                  "model-00001-of-00002.safetensors": files["model.safetensors"]},
                 refs=("main",))
    return cache


def clear_hub_env(monkeypatch):
    for name in HF_ENV:
        monkeypatch.delenv(name, raising=False)
    # huggingface_hub reads HF_HUB_OFFLINE once, at import: keep it from a stray
    # environment of whoever runs the tests.
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", False)


@pytest.fixture
def offline(monkeypatch, hub_cache) -> Path:
    clear_hub_env(monkeypatch)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return hub_cache


def test_the_cache_layout_is_what_huggingface_hub_resolves(hub_cache):
    snapshot = hub_cache / "models--org--tiny" / "snapshots"
    for revision, commit in ((None, COMMIT_A), ("main", COMMIT_A), (COMMIT_A, COMMIT_A),
                             ("v1", COMMIT_B), (COMMIT_B, COMMIT_B)):
        got = snapshot_download("org/tiny", revision=revision, cache_dir=hub_cache,
                                local_files_only=True)
        assert Path(got) == snapshot / commit
    config = Path(got) / "config.json"
    assert config.is_symlink() and config.resolve().parent.name == "blobs"
    assert json.loads(config.read_text())["architectures"] == ["LlamaForCausalLM"]


def test_hf_source_offline_generates_what_the_directory_does(offline, tiny_llama):
    from llmserve import LLM, SamplingParams
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = ["The capital of France is", "1, 2, 3,"]
    hub = LLM("hf://org/tiny", kv_cache_memory=8 << 20)
    assert hub.engine.model_path == offline / "models--org--tiny" / "snapshots" / COMMIT_A
    local = LLM(str(tiny_llama), kv_cache_memory=8 << 20)
    got = [o.outputs[0].token_ids for o in hub.generate(prompts, params)]
    want = [o.outputs[0].token_ids for o in local.generate(prompts, params)]
    assert got == want and all(len(t) == 8 for t in got)


@pytest.mark.parametrize("uri,commit", [
    ("hf://org/tiny@main", COMMIT_A), (f"hf://org/tiny@{COMMIT_A}", COMMIT_A),
    ("hf://org/tiny@v1", COMMIT_B), (f"hf://org/tiny@{COMMIT_B}", COMMIT_B),
])
def test_hf_revisions_offline(offline, uri, commit):
    assert resolve_model(uri) == offline / "models--org--tiny" / "snapshots" / commit


def test_hf_cache_from_hf_home(monkeypatch, hub_cache):
    """Without HF_HUB_CACHE, the cache is HF_HOME/hub (what the operator sets)."""
    clear_hub_env(monkeypatch)
    monkeypatch.setenv("HF_HOME", str(hub_cache.parent))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_model("hf://org/tiny").parent.name == "snapshots"


def test_unknown_repo_offline_says_it_is_not_cached(offline):
    with pytest.raises(ModelLoadError) as e:
        resolve_model("hf://org/nope")
    assert str(e.value) == (f"Hugging Face repo 'org/nope' is not in the cache at {offline} "
                            f"and HF_HUB_OFFLINE=1 forbids downloading it")


def test_unknown_revision_offline_names_the_cached_ones(offline):
    with pytest.raises(ModelLoadError) as e:
        resolve_model("hf://org/tiny@v9")
    assert str(e.value) == (
        f"revision 'v9' of Hugging Face repo 'org/tiny' is not in the cache at {offline} "
        f"(cached: main, v1, {COMMIT_A[:12]}, {COMMIT_B[:12]}) and HF_HUB_OFFLINE=1 "
        f"forbids downloading it")
    with pytest.raises(ModelLoadError, match=f"revision '{'c' * 40}' of .* is not in the cache"):
        resolve_model(f"hf://org/tiny@{'c' * 40}")


def test_snapshot_without_safetensors_is_a_clear_error(offline):
    with pytest.raises(ModelLoadError) as e:
        resolve_model("hf://org/bin-only")
    assert str(e.value) == (
        f"Hugging Face repo 'org/bin-only' (commit {COMMIT_A[:12]}, from the cache at "
        f"{offline}) has no *.safetensors weights; llmserve loads only safetensors "
        f"(not .bin, .pth or .gguf files in a repo)")


def test_snapshot_missing_a_shard_is_a_clear_error(offline):
    with pytest.raises(ModelLoadError, match=r"'org/half' .* lacks 1 of the 2 weight shards "
                       r"its index names \(model-00002-of-00002.safetensors, ...\): the cached "
                       r"snapshot is incomplete"):
        resolve_model("hf://org/half")


@pytest.mark.parametrize("uri", ["hf://", "hf://org/", "hf://org/tiny@", "hf://a/b/c",
                                 "hf://org/ti ny", "hf://org/tiny@v 1", "hf://org/../x"])
def test_malformed_hf_uris(offline, uri):
    with pytest.raises(ModelLoadError, match=re.escape(
            f"model source {uri!r} is not of the form hf://ORG/REPO or hf://ORG/REPO@REVISION")):
        resolve_model(uri)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def online(monkeypatch, hub_cache):
    """Online mode with short timeouts (huggingface_hub reads HF_HUB_DOWNLOAD_TIMEOUT at
    import, so the constant is patched too)."""
    clear_hub_env(monkeypatch)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setenv("HF_HUB_ETAG_TIMEOUT", "3")
    monkeypatch.setattr(hub_constants, "HF_HUB_ETAG_TIMEOUT", 3)
    monkeypatch.setattr(hub_constants, "HF_HUB_DOWNLOAD_TIMEOUT", 3)
    return hub_cache


def test_unreachable_hub_and_not_cached(online, monkeypatch):
    endpoint = f"http://127.0.0.1:{free_port()}"  # closed: the connection is refused
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    with pytest.raises(ModelLoadError) as e:
        resolve_model("hf://org/absent@v2")
    message = str(e.value)
    # (ConnectError: [Errno 111] Connection refused), as the HTTP client words it
    assert re.match(rf"cannot reach the Hugging Face Hub at {endpoint} \(\w+: .+\) and",
                    message), message
    assert message.endswith(f") and Hugging Face repo 'org/absent' is not in the cache at "
                            f"{online}")
    assert "\n" not in message


def test_unreachable_hub_falls_back_to_the_cache(online, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{free_port()}")
    assert resolve_model("hf://org/tiny").name == COMMIT_A
    assert resolve_model("hf://org/tiny@v1").name == COMMIT_B


# --- a fake Hub ---------------------------------------------------------------------------------
class FakeHub:
    """Repos of {path: bytes} at one commit each, served the way huggingface.co does;
    records every file downloaded."""

    def __init__(self):
        self.repos: dict[str, tuple[str, dict[str, bytes]]] = {}
        self.gated: dict[str, str] = {}  # repo -> the token that may read it
        self.downloads: list[str] = []
        self.down = False  # answer 503 to everything
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_HEAD(self):
                hub.handle(self, head=True)

            def do_GET(self):
                hub.handle(self, head=False)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,),
                                       daemon=True)

    def handle(self, req, head: bool):
        path = unquote(urlparse(req.path).path)
        if self.down:
            return self.reply(req, 503, {}, b"{}")
        m = (re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/([^/]+)(?:/.*)?", path)
             or re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/(.+))?", path)
             or re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path))
        if not m or m.group(1) not in self.repos:
            return self.reply(req, 404, {"X-Error-Code": "RepoNotFound"}, b'{"error":"nope"}')
        repo, revision = m.group(1), m.group(2) or "main"
        commit, files = self.repos[repo]
        if repo in self.gated and req.headers.get("authorization") != f"Bearer {self.gated[repo]}":
            return self.reply(req, 403 if req.headers.get("authorization") else 401,
                              {"X-Error-Code": "GatedRepo"}, b'{"error":"gated"}')
        if revision not in ("main", commit):
            return self.reply(req, 404, {"X-Error-Code": "RevisionNotFound"}, b'{"error":"rev"}')
        if "/tree/" not in path and "/resolve/" not in path:
            body = {"id": repo, "modelId": repo, "sha": commit, "private": False,
                    "siblings": [{"rfilename": f} for f in files]}
            return self.reply(req, 200, {}, json.dumps(body).encode())
        if "/tree/" in path:
            tree = [{"type": "file", "oid": hashlib.sha1(d).hexdigest(), "size": len(d),
                     "path": f} for f, d in files.items()]
            return self.reply(req, 200, {}, json.dumps(tree).encode())
        name = m.group(3)
        if name not in files:
            return self.reply(req, 404, {"X-Error-Code": "EntryNotFound",
                                         "X-Repo-Commit": commit}, b"{}")
        data = files[name]
        if not head:
            self.downloads.append(name)
        self.reply(req, 200, {"X-Repo-Commit": commit,
                              "ETag": f'"{hashlib.sha1(data).hexdigest()}"'},
                   b"" if head else data, length=len(data))

    @staticmethod
    def reply(req, status: int, headers: dict, body: bytes, length: int | None = None):
        req.send_response(status)
        for k, v in headers.items():
            req.send_header(k, v)
        req.send_header("Content-Type", "application/json" if status != 200 or not length
                        else "application/octet-stream")
        req.send_header("Content-Length", str(len(body) if length is None else length))
        req.end_headers()
        if body:
            req.wfile.write(body)


@pytest.fixture
def fake_hub(online, monkeypatch, tmp_path):
    hub = FakeHub()
    hub.thread.start()
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))  # an empty cache
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    yield hub
    hub.server.shutdown()
    hub.server.server_close()


def test_download_fetches_only_config_tokenizer_and_indexed_safetensors(fake_hub, tiny_llama,
                                                                       tmp_path, monkeypatch):
    files = checkpoint_files(tiny_llama)
    weights = files.pop("model.safetensors")
    index = {"metadata": {}, "weight_map": {"x": "model-00001-of-00001.safetensors"}}
    fake_hub.repos["org/tiny"] = ("c" * 40, {
        **files, "model-00001-of-00001.safetensors": weights,
        "model.safetensors.index.json": json.dumps(index).encode(),
        "consolidated.safetensors": b"another copy", "pytorch_model.bin": b"pickle",
        "model.gguf": b"gguf", "onnx/model.safetensors": b"onnx", "README.md": b"# tiny"})
    path = resolve_model("hf://org/tiny")
    assert path == tmp_path / "hub" / "models--org--tiny" / "snapshots" / ("c" * 40)
    assert sorted(fake_hub.downloads) == sorted(
        [*files, "model-00001-of-00001.safetensors", "model.safetensors.index.json"])
    assert len(fake_hub.downloads) == len(set(fake_hub.downloads))
    # the loader reads only the indexed shard, so the engine loads it
    from llmserve.model_executor.model_loader.weights import weight_files
    assert [p.name for p in weight_files(path)] == ["model-00001-of-00001.safetensors"]
    # a second resolve is served by the cache, and so is one offline (refs/main was kept)
    fake_hub.downloads.clear()
    assert resolve_model("hf://org/tiny@main") == path and fake_hub.downloads == []
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_model("hf://org/tiny") == path


def test_hub_answering_5xx_is_unreachable(fake_hub, monkeypatch, tmp_path):
    fake_hub.repos["org/one"] = ("d" * 40, {"config.json": b"{}", "model.safetensors": b"w"})
    assert resolve_model("hf://org/one").name == "d" * 40
    fake_hub.down = True
    assert resolve_model("hf://org/one").name == "d" * 40  # from the cache
    with pytest.raises(ModelLoadError) as e:
        resolve_model("hf://org/two")
    assert str(e.value) == (
        f"cannot reach the Hugging Face Hub at {fake_hub.url} (it answered HTTP 503) and "
        f"Hugging Face repo 'org/two' is not in the cache at {tmp_path / 'hub'}")


def test_download_without_index_takes_top_level_safetensors(fake_hub):
    fake_hub.repos["org/one"] = ("d" * 40, {"config.json": b"{}", "model.safetensors": b"w",
                                            "sub/model.safetensors": b"x"})
    assert resolve_model("hf://org/one").name == "d" * 40
    assert sorted(fake_hub.downloads) == ["config.json", "model.safetensors"]


def test_hub_errors_are_one_line(fake_hub, monkeypatch):
    fake_hub.repos["org/binonly"] = ("e" * 40, {"config.json": b"{}", "pytorch_model.bin": b"b"})
    fake_hub.repos["org/gguf"] = ("f" * 40, {"model.Q4_0.gguf": b"gguf"})
    fake_hub.repos["meta/gated"] = ("1" * 40, {"config.json": b"{}", "model.safetensors": b"w"})
    fake_hub.gated["meta/gated"] = "hf_good"

    def message(uri: str) -> str:
        with pytest.raises(ModelLoadError) as e:
            resolve_model(uri)
        assert "\n" not in str(e.value)
        return str(e.value)

    k8s = " (on Kubernetes: spec.model.hfTokenSecret)"
    assert message("hf://org/missing") == (
        "Hugging Face repo 'org/missing' was not found; if it is private, set HF_TOKEN to a "
        "token that can read it" + k8s)
    assert message("hf://org/binonly@v2") == (
        "revision 'v2' was not found in Hugging Face repo 'org/binonly' (a branch, tag or "
        "full commit hash is expected)")
    assert message("hf://org/binonly") == (
        f"Hugging Face repo 'org/binonly' (commit {'e' * 12}) has no *.safetensors weights; "
        "llmserve loads only safetensors (not .bin, .pth or .gguf files in a repo)")
    assert message("hf://org/gguf").endswith(
        "has no config.json: it is not a transformers checkpoint (for a GGUF-only repo, "
        "download the .gguf file and pass its path)")
    assert message("hf://meta/gated") == (
        "Hugging Face repo 'meta/gated' is gated: accept its conditions at "
        "https://huggingface.co/meta/gated and set HF_TOKEN to a token of an account with "
        "access" + k8s)
    monkeypatch.setenv("HF_TOKEN", "hf_wrong")
    assert message("hf://meta/gated") == (
        "Hugging Face repo 'meta/gated' is gated and the token in use has no access to it: "
        "accept its conditions at https://huggingface.co/meta/gated with the token's account")
    monkeypatch.setenv("HF_TOKEN", "hf_good\n")  # as a Secret made from a file often is
    fake_hub.downloads.clear()
    assert resolve_model("hf://meta/gated").name == "1" * 40
    assert fake_hub.downloads == ["config.json", "model.safetensors"]


# --- file:// and pvc:// ---------------------------------------------------------------------------
def test_file_uri_is_the_local_path(tiny_llama):
    assert resolve_model(f"file://{tiny_llama}") == tiny_llama
    assert resolve_model(f"file://localhost{tiny_llama}") == tiny_llama
    with pytest.raises(ModelLoadError, match="needs an absolute path, file:///PATH"):
        resolve_model("file://relative/dir")
    with pytest.raises(ModelLoadError, match="model not found: '/nonexistent/m' does not exist"):
        resolve_model("file:///nonexistent/m")


def test_file_uri_loads_a_model(tiny_llama):
    from llmserve import LLM, SamplingParams
    llm = LLM(f"file://{tiny_llama}", kv_cache_memory=8 << 20)
    out = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3


def test_pvc_uri_is_where_the_operator_mounts_the_claim(tiny_llama, monkeypatch):
    from llmserve.model_executor.model_loader import sources
    from llmserve.operator.builders import MODELS_DIR
    assert PVC_MOUNT == MODELS_DIR
    monkeypatch.setattr(sources, "PVC_MOUNT", str(tiny_llama.parent))
    assert resolve_model(f"pvc://models/{tiny_llama.name}") == tiny_llama
    with pytest.raises(ModelLoadError, match=r"the claim 'models' is expected mounted at .* "
                       r"\(as the operator mounts it\), but .*/absent does not exist"):
        resolve_model("pvc://models/absent")


def test_other_schemes_are_refused():
    with pytest.raises(ModelLoadError, match=r"model source 's3://b/m': unsupported scheme; a "
                       r"model is a built-in name, .* hf://ORG/REPO\[@REVISION\]"):
        resolve_model("s3://b/m")


def test_an_hf_lora_adapter_fetches_only_its_two_files(fake_hub, tiny_llama, tmp_path):
    """A LoRA adapter from the Hub (``--lora-modules NAME=hf://ORG/REPO``): its config
    and safetensors only, pinned to the commit; a repo without them is refused."""
    from llmserve.model_executor.lora.adapter import (
        LoRAError,
        load_adapter,
        resolve_adapter_source,
    )
    from llmserve.model_executor.model_loader.sources import load_config
    from tests.lora_adapters import write_peft_adapter
    adapter = write_peft_adapter(tiny_llama, tmp_path / "a", rank=4)
    files = {p.name: p.read_bytes() for p in adapter.iterdir() if p.is_file()}
    fake_hub.repos["org/lora"] = ("e" * 40, {**files, "training_args.bin": b"pickle"})
    path = resolve_adapter_source("hf://org/lora")
    assert path.name == "e" * 40
    assert sorted(fake_hub.downloads) == ["adapter_config.json", "adapter_model.safetensors"]
    assert load_adapter(path, load_config(tiny_llama), 16).rank == 4
    fake_hub.repos["org/model"] = ("f" * 40, {"config.json": b"{}", "model.safetensors": b"w"})
    with pytest.raises(LoRAError, match="not a PEFT LoRA adapter"):
        resolve_adapter_source("hf://org/model")
