"""This tree's benchmarks against an earlier commit's, in one run.

    python bench/against.py --base REV [--benches serve,split,transport,wan] [--rounds 2]

The earlier commit is checked out beside this tree (a detached git worktree that borrows this
tree's virtual environment, native module and benchmark scripts, so that both sides are
measured by the same instruments); each benchmark then runs `--rounds` times on each side,
the two sides taking turns. What each run wrote is read back, and the figures that say "no
speed lost" are printed side by side with their ratio (this tree / the base), medians over
the rounds: decode speed through the API and the event loop's CPU per token (`serve.py`), a
split's share of its compute ceiling and each stage's agent's event-loop CPU per token, in
the stages' order (`split.py`), the overlay's p50 round trip (`transport.py`), and the
per-token latency of a split over an emulated WAN (`wan`: net-sim, needs root). Writes JSON
(`--out`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent.parent


def serve_figures(r: dict[str, Any]) -> dict[str, float]:
    return {
        "API decode tok/s": r["median_api_tok_s"],
        "API / llama.cpp direct": r["ratio"],
        "event loop CPU ms/token": statistics.median(r["event_loop_cpu_ms_per_token"]),
    }


def split_figures(r: dict[str, Any]) -> dict[str, float]:
    out = {
        "split: share of compute ceiling": r["of_compute_ceiling"],
        "split / single tok/s": r["split_vs_single"],
        "4 concurrent / 1": r["concurrency_gain"],
    }
    for i, (main, _) in enumerate(r["cpu_ms_per_token"]["split_by_agent"]):  # stages' order
        out[f"event loop CPU ms/token, stage {i + 1}"] = main
    out["event loop CPU ms/token, whole"] = r["cpu_ms_per_token"]["single"][0][0]
    return out


def transport_figures(r: dict[str, Any]) -> dict[str, float]:
    return {"overlay p50 round trip (us)": r["overlay"]["p50_us"]}


def wan_figures(r: dict[str, Any]) -> dict[str, float]:
    iso = r["regimes"]["wan"]["isolation"]
    return {"wan per-token ms (median)": iso["per_token_ms"]["median"]}


# name -> (the command after the interpreter, with {out} for the result's path, and whether
# {out} is a folder holding report.json; the figures)
BENCHES: dict[str, tuple[list[str], bool, Callable[[dict[str, Any]], dict[str, float]]]] = {
    "serve": (["bench/serve.py", "--out", "{out}"], False, serve_figures),
    "split": (["bench/split.py", "--out", "{out}"], False, split_figures),
    "transport": (["bench/transport.py", "--out", "{out}"], False, transport_figures),
    "wan": (
        ["net-sim/sim.py", "split", "--regime", "wan", "--requests", "10", "--out", "{out}"],
        True,
        wan_figures,
    ),
}


# What measures rather than what is measured: both sides run this tree's copy, so a figure
# means the same on both: the folders and `launch.py` (how benchmarks start agents) always, the
# other modules only where the base lacks them.
INSTRUMENTS = ("bench", "net-sim", "meshagent/launch.py")
INSTRUMENT_MODULES = ("meshagent/sse_client.py", "meshagent/testing/nat_rules.py")


def checkout(base: str, where: Path) -> Path:
    """The base commit in a detached worktree at `where`, with this tree's native module and
    this tree's benchmarks."""
    subprocess.run(
        ["git", "-C", str(HERE), "worktree", "add", "--detach", "-f", str(where), base],
        check=True,
        capture_output=True,
    )
    for so in (HERE / "meshagent" / "engine").glob("*.so"):
        shutil.copy2(so, where / "meshagent" / "engine" / so.name)
    for path in INSTRUMENTS:
        if (HERE / path).is_dir():
            shutil.copytree(HERE / path, where / path, dirs_exist_ok=True)
        else:
            shutil.copy2(HERE / path, where / path)
    for module in INSTRUMENT_MODULES:
        if not (where / module).exists():
            shutil.copy2(HERE / module, where / module)
    return where


def run_one(tree: Path, name: str, out: Path, extra: list[str]) -> dict[str, float]:
    argv, folder, figures = BENCHES[name]
    cmd = [sys.executable, *(a.replace("{out}", str(out)) for a in argv), *extra]
    env = {**os.environ, "PYTHONPATH": str(tree)}  # its own code, this venv's libraries
    print(f"  {tree.name}: {' '.join(cmd[1:])}", flush=True)
    subprocess.run(cmd, cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL)
    result = json.loads(((out / "report.json") if folder else out).read_text())
    return figures(result)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="the earlier commit")
    ap.add_argument(
        "--this",
        help="a later commit to measure instead of the working tree (which may then change "
        "while the runs go on)",
    )
    ap.add_argument("--benches", default="serve,split,transport,wan")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("bench/results/against.json"))
    ap.add_argument(
        "--max-tokens",
        type=int,
        help="serve's and split's tokens a request (longer runs: a finer CPU-per-token grain)",
    )
    args = ap.parse_args()
    names = [n.strip() for n in args.benches.split(",") if n.strip()]
    unknown = [n for n in names if n not in BENCHES]
    if unknown:
        ap.error(f"no benchmark {', '.join(unknown)}; there are {', '.join(BENCHES)}")
    runs: dict[str, dict[str, list[dict[str, float]]]] = {}
    failed: list[str] = []
    with tempfile.TemporaryDirectory(prefix="meshagent-against-") as tmp:
        base = checkout(args.base, Path(tmp) / "base")
        this = checkout(args.this, Path(tmp) / "this") if args.this else HERE
        try:
            for name in names:
                print(f"{name}:", flush=True)
                runs[name] = {"base": [], "this": []}
                for i in range(args.rounds):
                    for side, tree in (("base", base), ("this", this)):
                        out = Path(tmp) / f"{name}-{side}-{i}"
                        out = out if BENCHES[name][1] else out.with_suffix(".json")
                        extra = []
                        if args.max_tokens and name in ("serve", "split"):
                            extra = ["--max-tokens", str(args.max_tokens)]
                        try:
                            runs[name][side].append(run_one(tree, name, out, extra))
                        except subprocess.CalledProcessError as e:
                            # One benchmark that fails loses only its own figures.
                            print(f"  {side}: {name} failed ({e}); its figures are left out")
                            failed.append(f"{name} ({side}, round {i + 1})")
        finally:
            for tree in {base, this} - {HERE}:
                subprocess.run(
                    ["git", "-C", str(HERE), "worktree", "remove", "--force", str(tree)],
                    capture_output=True,
                )
    rows = []
    for name in names:
        if not runs[name]["base"] or not runs[name]["this"]:
            continue
        for figure in runs[name]["base"][0]:
            b = statistics.median(r[figure] for r in runs[name]["base"])
            t = statistics.median(r[figure] for r in runs[name]["this"])
            rows.append({"bench": name, "figure": figure, "base": b, "this": t, "ratio": t / b})
    print(f"\n{'figure':<42}{'base':>10}{'this':>10}{'this/base':>11}")
    for row in rows:
        print(f"{row['figure']:<42}{row['base']:>10.3f}{row['this']:>10.3f}{row['ratio']:>11.3f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "base": args.base,
        "this": args.this or "the working tree",
        "rounds": args.rounds,
        "max_tokens": args.max_tokens,
        "figures": rows,
        "runs": runs,
        "failed": failed,
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    if failed:
        print(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
