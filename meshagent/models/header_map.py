"""Where a GGUF file's tokenizer lies in its header: what a stage host that needs no
tokenizer may leave unread when it fetches the header (`models/ranged.py`), as a peer that
read the header whole tells it (`models/header_share.py`)."""

from __future__ import annotations

from dataclasses import dataclass

from meshagent.models.gguf_file import TOKENIZER_PREFIX, Gap, Header


@dataclass(frozen=True)
class HeaderMap:
    """Where the header of the model file `sha256` ends (its data section's offset) and the
    metadata entries a stage without the tokenizer may leave unread (`gaps`)."""

    sha256: str
    end: int
    gaps: tuple[Gap, ...]

    @property
    def gap_bytes(self) -> int:
        return sum(b - a for a, b, _ in self.gaps)


def header_map(header: Header, sha256: str) -> HeaderMap:
    """The map of a header read whole: its `tokenizer.*` entries, adjacent ones as one gap."""
    gaps: list[Gap] = []
    for key, (a, b) in header.spans.items():
        if not key.startswith(TOKENIZER_PREFIX):
            continue
        if gaps and gaps[-1][1] == a:
            gaps[-1] = (gaps[-1][0], b, gaps[-1][2] + 1)
        else:
            gaps.append((a, b, 1))
    return HeaderMap(sha256, header.data_offset, tuple(gaps))
