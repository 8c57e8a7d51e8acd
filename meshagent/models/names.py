"""What `--model` names: a local GGUF file, or a file of a Hugging Face Hub repository
(`ORG/REPO`, `ORG/REPO:QUANT`, or `ORG/REPO/FILE.gguf`), and which of a repository's files
that is. No I/O: the repository's file list comes from the caller.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from meshagent.errors import ModelError

_REPO = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
# A split GGUF's later parts (`-00002-of-00003.gguf`): the first part names the model.
_PART = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)


@dataclass(frozen=True)
class HubName:
    """A model on the hub: its repository, and the quantisation or file asked for (if any)."""

    repo: str
    quant: str | None = None
    file: str | None = None

    def __str__(self) -> str:
        if self.file:
            return f"{self.repo}/{self.file}"
        return self.repo + (f":{self.quant}" if self.quant else "")


def parse_model_name(spec: str) -> Path | HubName:
    """A local path if `spec` names a file that exists or looks like a path; otherwise a hub
    name. ModelError for what is neither."""
    path = Path(spec).expanduser()
    if path.exists() or spec.startswith((".", "/", "~")) or "\\" in spec:
        return path
    if spec.lower().endswith(".gguf") and spec.count("/") < 2:
        return path  # a file that does not exist (yet): the caller says it is missing
    repo, _, quant = spec.partition(":")
    parts = repo.split("/")
    if len(parts) > 2 and parts[-1].lower().endswith(".gguf") and not quant:
        name = HubName("/".join(parts[:2]), file="/".join(parts[2:]))
    else:
        name = HubName(repo, quant or None)
    if not _REPO.match(name.repo) or (quant is not None and ":" in quant):
        raise ModelError(
            f"'{spec}' is neither a GGUF file here nor a Hugging Face model name "
            "(ORG/REPO, ORG/REPO:QUANT or ORG/REPO/FILE.gguf)"
        )
    return name


def choose_file(name: HubName, files: Iterable[str]) -> str:
    """The GGUF file of the repository that `name` asks for, among `files` (the repo's
    paths). ModelError naming the choices when there are none, or several."""
    ggufs = sorted(f for f in files if f.lower().endswith(".gguf") and not _later_part(f))
    if name.file is not None:
        if name.file in ggufs:
            return name.file
        raise ModelError(f"{name.repo} has no file {name.file}; its GGUF files: {_list(ggufs)}")
    if not ggufs:
        raise ModelError(f"{name.repo} holds no GGUF file (meshagent serves GGUF models)")
    candidates = ggufs
    if name.quant is not None:
        candidates = [f for f in ggufs if _has_quant(f, name.quant)]
        if not candidates:
            raise ModelError(
                f"{name.repo} has no {name.quant} file; its quantisations: "
                f"{_list(sorted(_quants(ggufs)))}"
            )
    if len(candidates) > 1:
        raise ModelError(
            f"{name} is ambiguous: name one of {_list(sorted(_quants(candidates)))} as "
            f"{name.repo}:QUANT (or a file as {name.repo}/FILE.gguf)"
        )
    return candidates[0]


def _later_part(path: str) -> bool:
    m = _PART.search(path)
    return m is not None and int(m.group(1)) > 1


def _stem(path: str) -> str:
    """The file's name without its folder, part number and `.gguf`."""
    base = _PART.sub(".gguf", path.rsplit("/", 1)[-1])
    return base[: -len(".gguf")]


def _has_quant(path: str, quant: str) -> bool:
    """Whether the file's name ends with the quantisation (`-Q4_K_M.gguf`, `.q4_k_m.gguf`),
    in any case."""
    stem = _stem(path).lower()
    q = quant.lower()
    return stem == q or stem.endswith(("-" + q, "." + q, "_" + q))


def _quants(paths: list[str]) -> list[str]:
    """What tells the files apart: the last dash- or dot-separated part of each name."""
    out = []
    for p in paths:
        stem = _stem(p)
        cut = max(stem.rfind("-"), stem.rfind("."))
        out.append(stem[cut + 1 :] if cut >= 0 else stem)
    return out


def _list(items: list[str]) -> str:
    return ", ".join(items) if items else "none"
