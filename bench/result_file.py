"""What every benchmark writes: its result as JSON, with the machine it ran on."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any


def machine() -> dict[str, Any]:
    """The machine a result comes from: cores and platform."""
    return {"cpus": os.cpu_count(), "platform": platform.platform()}


def write(out: Path, result: dict[str, Any], note: str = "") -> None:
    """Write `result` to `out` (its folder made if need be) and say so."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}{note}")


def print_table(rows: list[dict[str, Any]]) -> None:
    """Rows of one shape as a table: a header of their keys, then one line each."""
    cols = list(rows[0])
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(str(r[c]) for c in cols))
