"""A model file on the hub of which only some byte ranges are here: a stage host downloads its
stage's tensors, not the whole file.

The local copy is a sparse file of the remote file's size: its header (read first, so the
model's layout is known before any placement) and the tensor ranges fetched since sit at
their own offsets, the rest is a hole. Where a peer that read the whole header says where the
tokenizer's entries lie in it (a `HeaderMap`), the header is fetched around them: a stage
between the first and the last needs no tokenizer, and for a small model it is most of the
header. They are fetched before an artifact that carries the tokenizer is cut. The slicer
cuts stage artifacts from it as from the whole file, reading only the tensors the artifact
copies, so an artifact cut here is byte-identical to one cut from the whole file. A sidecar
(`<file>.ranges.json`) says where the file comes from (URL, size, the hub's sha256), which
ranges are here and which header entries are not; it is rewritten after every MiB, so an
interrupted download resumes where it stopped.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import sys
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from meshagent import wording
from meshagent.errors import ModelError
from meshagent.models.files import file_sha256, write_atomic
from meshagent.models.gguf_file import Gap, Header, HeaderTruncated, parse_header, tensor_bytes
from meshagent.models.header_map import HeaderMap

log = structlog.get_logger(__name__)

SIDECAR_SUFFIX = ".ranges.json"
SIDECAR_VERSION = 1
# Bytes asked first for the header; half as many again each time until it parses, so what is
# fetched past its end (tensor bytes, kept) is at most a third of what was fetched.
HEADER_PROBE = 256 << 10
MAX_HEADER = 1 << 30  # a header larger than this is not a model's
COALESCE_GAP = 4096  # tensors this close are fetched in one request (alignment padding)
RECORD_EVERY = 1 << 20  # the sidecar is rewritten after each MiB written
_lock = threading.RLock()  # one download into the partial files at a time

Ranges = list[tuple[int, int]]  # sorted, disjoint [start, end) byte ranges
Progress = Callable[[int, int], None]


class HashMismatch(ModelError):
    """A copy completed whole does not hash to the hub's sha256."""


@dataclass(frozen=True)
class RemoteFile:
    """A file on the hub: where to ask for its bytes, and what they must hash to."""

    repo: str
    filename: str
    size: int
    sha256: str
    url: str


def header_gaps(path: Path) -> tuple[Gap, ...]:
    """The metadata entries of the file at `path` that are not here: a partial copy's header
    fetched around its tokenizer; none for any other file."""
    if not is_partial(path):
        return ()
    return PartialModel(path).gaps


def sidecar(path: Path) -> Path:
    return path.with_name(path.name + SIDECAR_SUFFIX)


def is_partial(path: Path) -> bool:
    """Whether `path` is a partial copy (its sidecar is there), complete or not."""
    return sidecar(Path(path)).is_file()


def add_range(ranges: Ranges, start: int, end: int) -> Ranges:
    """`ranges` with [start, end) added, merged with what it touches."""
    return coalesce([*ranges, (start, end)], gap=0)


def missing(want: Iterable[tuple[int, int]], have: Ranges) -> Ranges:
    """The parts of `want` not in `have`."""
    out: Ranges = []
    for a, b in want:
        at = a
        for c, d in have:
            if d <= at or c >= b:
                continue
            if c > at:
                out.append((at, c))
            at = max(at, d)
        if at < b:
            out.append((at, b))
    return out


def coalesce(ranges: Iterable[tuple[int, int]], gap: int = COALESCE_GAP) -> Ranges:
    """Sorted `ranges` with those at most `gap` bytes apart joined (fewer requests)."""
    out: Ranges = []
    for a, b in sorted(ranges):
        if out and a <= out[-1][1] + gap:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


class PartialModel:
    """The partial copy at `path` and its sidecar."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._load()

    def _load(self) -> None:
        """Read the sidecar: each change starts from it, so that two objects for the same
        copy (a cut's, a status read's) never write back an old view."""
        try:
            meta = json.loads(sidecar(self.path).read_text())
            if meta.get("version") != SIDECAR_VERSION:
                raise ValueError(f"version {meta.get('version')!r}")
            self.remote = RemoteFile(**meta["remote"])
            self.done: Ranges = [(int(a), int(b)) for a, b in meta["done"]]
            self.fetched = int(meta.get("fetched", 0))  # bytes downloaded from the hub
            self.from_peers = int(meta.get("from_peers", 0))  # artifact bytes from peers
            self.header_bytes = int(meta.get("header_bytes", 0))
            # Bytes fetched to read the header (it, and what the last probe took past it).
            self.header_fetched = int(meta.get("header_fetched", 0))
            # Metadata entries of the header not fetched (the tokenizer's, `HeaderMap`).
            self.gaps: tuple[Gap, ...] = tuple(
                (int(a), int(b), int(n)) for a, b, n in meta.get("gaps", [])
            )
            self.complete = bool(meta.get("complete", False))  # whole, matching the sha256
            self.commit = str(meta.get("commit", ""))  # the repository's, as the hub said
            self.artifacts: dict[str, str] = dict(meta.get("artifacts", {}))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ModelError(f"{sidecar(self.path)} is unreadable ({e}); delete both files") from e

    @classmethod
    def begin(
        cls,
        path: Path,
        remote: RemoteFile,
        *,
        probe: int = HEADER_PROBE,
        header: bool = True,
        header_map: HeaderMap | None = None,
    ) -> PartialModel:
        """The partial copy of `remote` at `path`, started if it is not: a sparse file of its
        size and (unless `header` is false: a whole download) its header, downloaded now,
        around the gaps of `header_map` where one is given."""
        with _lock:
            if is_partial(path):
                part = cls(path)
                if part.remote.sha256 == remote.sha256:
                    if header:
                        part.fetch_header(probe, header_map)
                    return part
                log.info("partial.replaced", path=str(path), sha256=remote.sha256)
                part.discard()
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("wb") as f:
                f.truncate(remote.size)
            meta = {"version": SIDECAR_VERSION, "remote": remote.__dict__, "done": []}
            write_atomic(sidecar(path), json.dumps(meta).encode())
            part = cls(path)
            if header:
                part.fetch_header(probe, header_map)
            return part

    @property
    def sha256(self) -> str:
        return self.remote.sha256

    @property
    def held(self) -> int:
        return sum(b - a for a, b in self.done)

    def status(self) -> dict[str, Any]:
        return {
            "file": self.remote.filename,
            "repo": self.remote.repo,
            "size_bytes": self.remote.size,
            "held_bytes": self.held,
            # What the sparse file takes on disk (a stage's bytes, once cut into its
            # artifact, are given back: `release`).
            "disk_bytes": _allocated(self.path),
            "fetched_from_hub_bytes": self.fetched,
            "fetched_from_peers_bytes": self.from_peers,
            "header_bytes": self.header_bytes,
            "header_fetched_bytes": self.header_fetched,
            "complete": self.complete,
            "artifacts": dict(self.artifacts),
        }

    # ----- what is fetched -----

    def fetch_header(self, probe: int = HEADER_PROBE, header_map: HeaderMap | None = None) -> None:
        """Download the header (and whatever tensor bytes the last request took with it):
        around the gaps of `header_map` where one is given (a map that does not fit the file
        is set aside, and the header fetched whole)."""
        if self.header_bytes > 0:  # read before: only what is not here (nothing, offline)
            self.ensure(missing([(0, self.header_bytes)], [(a, b) for a, b, _ in self.gaps]))
            return
        if header_map is not None and header_map.sha256 == self.remote.sha256:
            try:
                self._fetch_mapped(header_map)
                return
            except ValueError as e:
                log.warning("partial.header_map_refused", file=self.remote.filename, error=str(e))
        while True:
            self.ensure([(0, min(probe, self.remote.size))])
            with self.path.open("rb") as f:
                head = f.read(probe)
            try:
                header = parse_header(head)
            except HeaderTruncated as e:
                if probe >= min(self.remote.size, MAX_HEADER):
                    raise ModelError(f"{self.remote.filename}: the GGUF header does not end") from e
                probe = max(probe * 3 // 2, probe + 4096)
                continue
            except ValueError as e:
                raise ModelError(f"{self.remote.filename} is not a GGUF model file: {e}") from e
            break
        end = max((b for _, b in _spans(header).values()), default=header.data_offset)
        if end > self.remote.size:
            raise ModelError(f"{self.remote.filename}: its tensors run past its size")
        if self.header_bytes != header.data_offset:
            self.header_bytes = header.data_offset
            self.header_fetched = self.fetched
            self._save()

    def _fetch_mapped(self, header_map: HeaderMap) -> None:
        """Fetch the header but its gaps and read it around them: ValueError if it does not
        parse so, or says another end than the map."""
        if not 0 < header_map.end <= min(self.remote.size, MAX_HEADER):
            raise ValueError(f"a header ending at {header_map.end}")
        gaps = [(a, b) for a, b, _ in header_map.gaps]
        self.ensure(missing([(0, header_map.end)], coalesce(gaps, 0)))
        with self.path.open("rb") as f:
            head = f.read(header_map.end)
        header = parse_header(head, header_map.gaps)
        if header.data_offset != header_map.end:
            raise ValueError(f"the header ends at {header.data_offset}, not {header_map.end}")
        end = max((b for _, b in _spans(header).values()), default=header.data_offset)
        if end > self.remote.size:
            raise ValueError("its tensors run past the file's size")
        self.gaps = header.gaps
        self.header_bytes = header.data_offset
        self.header_fetched = self.fetched
        self._save()
        log.info(
            "partial.header_mapped",
            file=self.remote.filename,
            fetched=self.fetched,
            left_out=header_map.gap_bytes,
        )

    def fill_gaps(self, progress: Progress | None = None) -> None:
        """Fetch the header's gaps (an artifact that carries the tokenizer is cut next): the
        header is whole here from then on."""
        with _lock:
            self._load()
            if not self.gaps:
                return
            self.ensure([(a, b) for a, b, _ in self.gaps], progress)
            parse_header(self._head())  # whole now: it must read so
            self.gaps = ()
            self._save()

    def ensure_tensors(self, names: Iterable[str], progress: Progress | None = None) -> None:
        """Download the bytes of the tensors `names` that are not here yet."""
        self.ensure(coalesce(self.tensor_ranges(names)), progress)

    def ensure_whole(self, progress: Progress | None = None) -> None:
        """Download every byte not here yet, then check the whole file against the hub's
        sha256: a mismatch drops what was fetched and raises."""
        with _lock:
            self._load()
            if self.complete:
                return
            self.ensure([(0, self.remote.size)], progress)
            if file_sha256(self.path) != self.remote.sha256:
                self.done = []
                self._save()
                raise HashMismatch(
                    f"{self.remote.filename} does not match the hub's sha256 once whole; "
                    "what was fetched is dropped: start again to download it afresh"
                )
            self.complete = True
            self.gaps = ()
            self._save()
            log.info("partial.complete", file=self.remote.filename, fetched=self.fetched)

    def note_artifact(self, key: str, verdict: str, from_peer: int = 0) -> None:
        """Remember how an artifact of this model came: "from peer" (`from_peer` bytes over
        the overlay, checked chunk by chunk), or cut from this copy and "verified" (its
        sha256 matched one a peer published) or "unverified" (no peer had published one)."""
        with _lock:
            self._load()
            self.artifacts[key] = verdict
            self.from_peers += from_peer
            self._save()

    def forget(self, ranges: Iterable[tuple[int, int]]) -> None:
        """Mark `ranges` as not here (their bytes proved wrong): the next ensure fetches them."""
        with _lock:
            self._load()
            self.done = missing(self.done, sorted(ranges))
            self.complete = False
            self._save()

    def release(self, ranges: Iterable[tuple[int, int]]) -> int:
        """Give back the disk under `ranges` once their bytes live in a stage artifact: they
        are punched out of the sparse file and marked not here (the header stays). Returns
        the bytes released; 0 where the filesystem cannot punch holes (they stay here)."""
        with _lock:
            self._load()
            if self.complete:
                return 0  # a whole copy stays whole
            drop = [(max(a, self.header_bytes), b) for a, b in ranges if b > self.header_bytes]
            punched = [(a, b) for a, b in drop if a < b and _punch_hole(self.path, a, b - a)]
            if not punched:
                return 0
            self.done = missing(self.done, sorted(punched))
            self._save()
            return sum(b - a for a, b in punched)

    def tensor_ranges(self, names: Iterable[str]) -> Ranges:
        """Where in the file the tensors `names` lie."""
        where = _spans(parse_header(self._head(), self.gaps))
        wanted = sorted(set(names))
        unknown = [n for n in wanted if n not in where]
        if unknown:
            raise ModelError(f"{self.remote.filename} has no tensor {unknown[0]}")
        return sorted(where[n] for n in wanted)

    def ensure(self, ranges: Iterable[tuple[int, int]], progress: Progress | None = None) -> None:
        """Download whichever of `ranges` are not here, recording each MiB as it lands."""
        with _lock:
            self._load()
            todo = missing(coalesce(ranges, 0), self.done)
            total = sum(b - a for a, b in todo)
            if not todo:
                return
            from huggingface_hub import constants

            if constants.HF_HUB_OFFLINE:
                raise ModelError(
                    f"{total} bytes of {self.remote.filename} are not here and HF_HUB_OFFLINE "
                    "is set: start once with the network on"
                )
            check_room(
                total,
                self.path.parent,
                f"{self.remote.filename} ({len(todo)} ranges)",
                "start the agent with a data dir on a disk with room",
            )
            log.info("partial.fetching", file=self.remote.filename, ranges=len(todo), bytes=total)
            if progress is None:
                progress = logging_progress("partial.progress", file=self.remote.filename)
            got = 0
            for a, b in todo:
                got = self._fetch(a, b, got, total, progress)

    def discard(self) -> None:
        with _lock:
            self.path.unlink(missing_ok=True)
            sidecar(self.path).unlink(missing_ok=True)

    # ----- the edges -----

    def _head(self) -> bytes:
        if self.header_bytes <= 0:
            raise ModelError(f"{self.remote.filename}: its header was never fetched")
        with self.path.open("rb") as f:
            return f.read(self.header_bytes)

    def _fetch(self, a: int, b: int, got: int, total: int, progress: Progress | None) -> int:
        from huggingface_hub import get_session
        from huggingface_hub.utils import build_hf_headers

        session = get_session()
        headers = {**build_hf_headers(), "Range": f"bytes={a}-{b - 1}"}
        at = a
        written = 0
        try:
            with (
                session.stream("GET", self.remote.url, headers=headers, follow_redirects=True) as r,
                self.path.open("r+b") as f,
            ):
                self._check_response(r, a, b)
                f.seek(a)
                for block in r.iter_bytes():  # as it arrives: a cut response keeps its part
                    block = block[: b - at]
                    f.write(block)
                    at += len(block)
                    written += len(block)
                    got += len(block)
                    if written >= RECORD_EVERY or at >= b:
                        f.flush()
                        os.fsync(f.fileno())
                        self._landed(at - written, at)
                        written = 0
                        if progress is not None:
                            progress(got, total)
                    if at >= b:
                        break
                f.flush()
                if written:
                    self._landed(at - written, at)
        except OSError as e:
            if written:
                # If the sidecar cannot be written, it keeps its last word: those bytes are
                # fetched again.
                with contextlib.suppress(OSError):
                    self._landed(at - written, at)
            if e.errno == errno.ENOSPC:
                raise ModelError(
                    f"the disk under {self.path.parent} is full while downloading "
                    f"{self.remote.filename}: free some space; what was fetched is kept"
                ) from e
            raise self._broken(at, b, e) from e
        except transport_errors() as e:  # connection refused or lost, protocol, timeout
            if written:
                self._landed(at - written, at)
            raise self._broken(at, b, e) from e
        if at < b:
            raise self._broken(at, b, "the server ended the response early")
        return got

    def _check_response(self, r: Any, a: int, b: int) -> None:
        if r.status_code in (401, 403):
            raise ModelError(
                f"the hub refused {self.remote.repo} ({r.status_code}): if it is gated, accept "
                "its terms on the Hugging Face website and set HF_TOKEN"
            )
        if r.status_code != 206:
            raise ModelError(
                f"the hub answered {r.status_code} to a range request for "
                f"{self.remote.filename}; it must serve byte ranges for stage-only downloads"
            )
        expect = f"bytes {a}-{b - 1}/{self.remote.size}"
        if r.headers.get("content-range", "").strip() != expect:
            raise ModelError(
                f"the hub sent {r.headers.get('content-range')!r} for {expect}: "
                f"{self.remote.filename} changed size or the server ignores ranges"
            )
        for hop in [*getattr(r, "history", []), r]:
            commit = hop.headers.get("x-repo-commit", "")
            if len(commit) == 40 and not self.commit:
                self.commit = commit  # saved with the bytes that follow
            tag = hop.headers.get("x-linked-etag", "").strip('"')
            if len(tag) == 64 and tag != self.remote.sha256:
                raise ModelError(
                    f"{self.remote.filename} changed on the hub since its header was read "
                    "(another sha256): delete the partial copy and start again"
                )

    def _broken(self, at: int, end: int, why: object) -> ModelError:
        return ModelError(
            f"downloading {self.remote.filename} stopped at byte {at} of the range "
            f"ending {end} ({why}); what was fetched is kept and the next try resumes there"
        )

    def _landed(self, a: int, b: int) -> None:
        self.done = add_range(self.done, a, b)
        self.fetched += b - a
        self._save()

    def _save(self) -> None:
        meta = {
            "version": SIDECAR_VERSION,
            "remote": self.remote.__dict__,
            "done": [list(r) for r in self.done],
            "fetched": self.fetched,
            "from_peers": self.from_peers,
            "header_bytes": self.header_bytes,
            "header_fetched": self.header_fetched,
            "gaps": [list(g) for g in self.gaps],
            "complete": self.complete,
            "commit": self.commit,
            "artifacts": self.artifacts,
        }
        write_atomic(sidecar(self.path), json.dumps(meta).encode())


def _spans(header: Header) -> dict[str, tuple[int, int]]:
    """Each tensor's [start, end) byte range in the file."""
    out = {}
    for name, dims, kind, offset in header.infos:
        start = header.data_offset + offset
        out[name] = (start, start + tensor_bytes(dims, kind))
    return out


def _allocated(path: Path) -> int:
    try:
        return path.stat().st_blocks * 512
    except (OSError, AttributeError):
        return 0


_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02


def _punch_hole(path: Path, offset: int, length: int) -> bool:
    """Deallocate [offset, offset + length) of `path`, which then reads as zeros (Linux
    fallocate); False where that is not available."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if not sys.platform.startswith("linux") or name is None:
        return False
    libc = ctypes.CDLL(name, use_errno=True)
    fallocate = libc.fallocate
    fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    fd = os.open(path, os.O_RDWR)
    try:
        mode = _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE
        return fallocate(fd, mode, offset, length) == 0
    finally:
        os.close(fd)


def logging_progress(event: str, **what: str) -> Progress:
    """Progress as a log line per tenth (`event`, with `what`), for downloads no one watches
    on a terminal: a stage's ranges or artifact fetched while the agent runs."""
    said = [0]

    def report(done: int, total: int) -> None:
        tenth = 10 * done // max(total, 1)
        if tenth > said[0]:
            said[0] = tenth
            log.info(event, **what, percent=10 * tenth, bytes=done, of=total)

    return report


def transport_errors() -> tuple[type[BaseException], ...]:
    """The HTTP client's errors for a connection refused or lost, a broken response or a
    timeout: httpx's, or its successor's, by the version of huggingface_hub."""
    from huggingface_hub import get_session

    http = sys.modules[type(get_session()).__module__.split(".")[0]]
    return (getattr(http, "TransportError", OSError),)


def check_room(size: int, where: Path, what: str, remedy: str) -> None:
    """ModelError naming `what` and `remedy` unless `where`'s disk has `size` bytes free."""
    where.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(where).free
    if size > free:
        raise ModelError(
            f"{what} needs {wording.size(size)} and {where} has {wording.size(free)} free: "
            f"free some space, or {remedy}"
        )
