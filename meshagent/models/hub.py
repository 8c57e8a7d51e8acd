"""Models by name from the Hugging Face Hub (`ORG/REPO[:QUANT]`, `models/names.py`), through
`huggingface_hub`: its cache layout, token (`HF_TOKEN`), endpoint (`HF_ENDPOINT`) and offline
mode (`HF_HUB_OFFLINE=1`).

A file already in the cache is used without asking the hub. Otherwise the repository's
files are listed, the one the name asks for is chosen, the disk is checked for room, and the
file is downloaded through a partial copy under the cache (`models/ranged.py`: an
interrupted download resumes where it stopped, in this run or the next) and checked against
the sha256 the hub lists for it before it takes its place in the cache's layout; a file that
does not match is deleted, never left as if whole. An agent that cannot hold a model whole
downloads its header alone (`model_for_agent`), and later only the layers placement gives it.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from meshagent.errors import ModelError
from meshagent.models.header_map import HeaderMap
from meshagent.models.names import HubName, choose_file
from meshagent.models.ranged import (
    HashMismatch,
    PartialModel,
    RemoteFile,
    check_room,
    is_partial,
    transport_errors,
)
from meshagent.wording import size

PARTIAL_DIR = ".meshagent-partial"  # under the cache: whole downloads under way
Progress = Callable[[int, int], None]  # (bytes done, bytes in all)


def _hub():  # imported when a name is used: a local file needs none of it
    import huggingface_hub
    from huggingface_hub import constants, errors, hf_api

    return huggingface_hub, constants, errors, hf_api


def _repo_dir(root: Path, repo: str) -> Path:
    """A repository's folder in the cache's layout (and in an agent's `models/`)."""
    return root / ("models--" + repo.replace("/", "--"))


def cached_file(name: HubName, cache_dir: Path | None = None) -> Path | None:
    """The file `name` asks for if the cache holds it (no request to the hub)."""
    _, constants, _, _ = _hub()
    root = Path(cache_dir or constants.HF_HUB_CACHE)
    snapshots = _repo_dir(root, name.repo) / "snapshots"
    if not snapshots.is_dir():
        return None
    for snapshot in sorted(snapshots.iterdir(), key=lambda p: p.stat().st_mtime, reverse=True):
        files = [str(p.relative_to(snapshot)) for p in snapshot.rglob("*.gguf")]
        try:
            chosen = choose_file(name, files)
        except ModelError:
            continue
        path = snapshot / chosen
        if path.is_file():
            return path
    return None


def cached_models(cache_dir: Path | None = None) -> list[tuple[str, Path]]:
    """Every GGUF file the cache holds, as (ORG/REPO/FILE, path), newest snapshot of each
    repository first."""
    _, constants, _, _ = _hub()
    root = Path(cache_dir or constants.HF_HUB_CACHE)
    out: list[tuple[str, Path]] = []
    for repo_dir in sorted(root.glob("models--*--*")):
        repo = repo_dir.name.removeprefix("models--").replace("--", "/", 1)
        snapshots = sorted(
            (repo_dir / "snapshots").glob("*"), key=lambda p: p.stat().st_mtime, reverse=True
        )
        seen: set[str] = set()
        for snapshot in snapshots:
            for path in sorted(snapshot.rglob("*.gguf")):
                rel = str(path.relative_to(snapshot))
                if rel not in seen and path.is_file():
                    seen.add(rel)
                    out.append((f"{repo}/{rel}", path))
    return out


def locate(name: HubName, endpoint: str | None = None) -> RemoteFile:
    """The file `name` asks for, as the hub lists it: its size, sha256 and download URL.
    ModelError with what to do when there is none, or the hub cannot be asked."""
    hub, constants, _, hf_api = _hub()
    endpoint = endpoint or os.environ.get("HF_ENDPOINT")  # as set now, not at import
    if constants.HF_HUB_OFFLINE:
        raise ModelError(
            f"{name} is not in the Hugging Face cache and HF_HUB_OFFLINE is set: "
            "download it once with the network on (`meshagent models pull`)"
        )
    api = hub.HfApi(endpoint=endpoint)
    with _hub_errors(name):
        entries = [
            e
            for e in api.list_repo_tree(name.repo, recursive=True)
            if isinstance(e, hf_api.RepoFile)
        ]
    chosen = choose_file(name, [e.path for e in entries])
    entry = next(e for e in entries if e.path == chosen)
    return RemoteFile(
        repo=name.repo,
        filename=chosen,
        size=int(entry.size),
        sha256=entry.lfs.sha256 if entry.lfs is not None else "",
        url=hub.hf_hub_url(name.repo, chosen, endpoint=endpoint),
    )


def fetch(
    name: HubName,
    cache_dir: Path | None = None,
    endpoint: str | None = None,
    *,
    progress: Progress | None = None,
    remote: RemoteFile | None = None,
) -> Path:
    """The local path of the GGUF file `name` asks for, downloaded whole if the cache lacks
    it (`progress(done, total)` in bytes as it comes; `remote`: what `locate` said, if asked
    already). ModelError with what to do when it cannot be had."""
    found = cached_file(name, cache_dir)
    if found is not None:
        return found
    hub, constants, _, _ = _hub()
    endpoint = endpoint or os.environ.get("HF_ENDPOINT")
    remote = remote or locate(name, endpoint)
    root = Path(cache_dir or constants.HF_HUB_CACHE)
    check_room(remote.size, root, "the model", "set HF_HUB_CACHE to a disk with room")
    if remote.sha256:
        return _fetch_resumable(remote, root, progress)
    bars = None if progress is None else _reporting(progress)  # not LFS: small, no hash
    with _hub_errors(name):
        return Path(
            hub.hf_hub_download(
                name.repo, remote.filename, cache_dir=cache_dir, endpoint=endpoint, tqdm_class=bars
            )
        )


def _fetch_resumable(remote: RemoteFile, root: Path, progress: Progress | None) -> Path:
    """Download `remote` whole through a partial copy (`models/ranged.py`: it resumes where
    an earlier run stopped, which huggingface_hub's own download does not), check it against
    the hub's sha256, then move it into the cache's layout (blob, snapshot link, ref) where
    `cached_file` and huggingface_hub itself find it."""
    work = root / PARTIAL_DIR / f"{remote.sha256}.part"
    part = PartialModel.begin(work, remote, header=False)
    try:
        part.ensure_whole(progress)
    except HashMismatch as e:
        part.discard()
        raise ModelError(
            f"the download of {remote.repo}/{remote.filename} does not match the hub's "
            "sha256; it was deleted: run the command again"
        ) from e
    repo_dir = _repo_dir(root, remote.repo)
    blob = repo_dir / "blobs" / remote.sha256
    commit = PartialModel(work).commit or "0" * 40
    link = repo_dir / "snapshots" / commit / remote.filename
    blob.parent.mkdir(parents=True, exist_ok=True)
    link.parent.mkdir(parents=True, exist_ok=True)
    os.replace(work, blob)
    part.discard()
    if os.path.lexists(link):
        link.unlink()
    link.symlink_to(os.path.relpath(blob, link.parent))
    (repo_dir / "refs").mkdir(exist_ok=True)
    (repo_dir / "refs" / "main").write_text(commit)
    return link


def partial_path(root: Path, remote: RemoteFile) -> Path:
    """Where a partial copy (`models/ranged.py`) of `remote` lives under `root`."""
    return _repo_dir(root, remote.repo) / remote.filename


def partial_file(name: HubName, root: Path) -> Path | None:
    """A partial copy of the file `name` asks for under `root`, if one was started (no
    request to the hub)."""
    folder = _repo_dir(root, name.repo)
    files = [p.name for p in folder.glob("*.gguf") if is_partial(p)]
    try:
        return folder / choose_file(name, files) if files else None
    except ModelError:
        return None


def partial_models(root: Path) -> list[tuple[Path, PartialModel]]:
    """Every partial copy under `root` (an agent's data dir `models/`)."""
    out = []
    for path in sorted(root.glob("models--*/*.gguf")):
        if is_partial(path):
            try:
                out.append((path, PartialModel(path)))
            except ModelError:
                continue  # an unreadable sidecar: `up` says so when it meets it
    return out


def begin_partial_of(
    remote: RemoteFile, root: Path, name: HubName | str, header_map: HeaderMap | None = None
) -> Path:
    """A partial copy of `remote` under `root`, with its header (the one started before, if
    it is of the same file): around the tokenizer where a peer gave its `header_map`."""
    if not remote.sha256:
        raise ModelError(
            f"the hub lists no sha256 for {remote.filename} (not an LFS file), so its ranges "
            f"cannot be checked: download {name} whole (`meshagent models pull`)"
        )
    path = partial_path(root, remote)
    PartialModel.begin(path, remote, header_map=header_map)
    return path


def model_for_agent(
    name: HubName,
    root: Path,
    weights_offer: int,
    *,
    progress: Progress | None = None,
    say: Callable[[str], None] | None = None,
    header_map: Callable[[str], HeaderMap | None] | None = None,
) -> Path:
    """The file an agent serving `name` starts with: the whole file if the cache holds it,
    the partial copy under `root` it started before, else (asking the hub) the whole file
    downloaded when this agent could hold the model whole (`weights_offer` bytes), or a
    partial copy, its header only, when it cannot: it will download the layers placement
    gives it, and only those. `header_map` asks peers where the header's tokenizer lies (by
    the file's sha256), so that the header is fetched without it."""
    found = cached_file(name) or partial_file(name, root)
    if found is not None:
        return found
    remote = locate(name)
    if weights_offer >= remote.size:
        return fetch(name, progress=progress, remote=remote)
    if say is not None:
        say(
            f"{remote.filename} is {size(remote.size)}, more than the "
            f"{size(weights_offer)} this agent offers for weights: it downloads the "
            "header now, and only the layers the mesh gives it once placed"
        )
    found = header_map(remote.sha256) if header_map is not None and remote.sha256 else None
    return begin_partial_of(remote, root, name, found)


@contextmanager
def _hub_errors(name: HubName) -> Iterator[None]:
    """The hub's errors as one-line ModelErrors that say what to do."""
    _, _, errors, _ = _hub()
    try:
        yield
    except errors.GatedRepoError as e:
        raise ModelError(
            f"{name.repo} is gated: accept its terms on the Hugging Face website, then set "
            "HF_TOKEN to a token of that account"
        ) from e
    except errors.RepositoryNotFoundError as e:
        raise ModelError(
            f"no model {name.repo} on the Hugging Face Hub (or it is private: set HF_TOKEN)"
        ) from e
    except (OSError, errors.HfHubHTTPError, *transport_errors()) as e:
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            raise ModelError(
                f"the disk filled while downloading {name}: free some space (or set "
                "HF_HUB_CACHE to a disk with room), then run the command again to resume"
            ) from e
        raise ModelError(f"downloading {name} failed: {e}; run the command again to resume") from e


def _reporting(progress: Progress) -> type:
    """A tqdm class that draws nothing itself and tells `progress` how far it is."""
    from tqdm.auto import tqdm

    class Reporting(tqdm):  # type: ignore[misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self._done = int(kwargs.get("initial") or 0)
            self._total = int(kwargs.get("total") or 0)
            super().__init__(*args, **{**kwargs, "disable": True})

        def update(self, n: float | None = 1) -> bool | None:
            self._done += int(n or 0)
            progress(self._done, self._total)
            return None

    return Reporting
