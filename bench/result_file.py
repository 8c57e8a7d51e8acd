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
