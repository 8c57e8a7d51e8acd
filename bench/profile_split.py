"""Where a split's event-loop CPU goes: three agents on loopback as `bench/split.py` starts
them, each under `bench/profiled_agent.py`, their main threads profiled over an idle phase and
over a phase of requests. Prints, for each agent in the stages' order, its event loop's CPU
per second idle, per token, and per token net of what the same seconds cost idle (the token
path's own share), then the functions that took most of that agent's token phase. The
profiles stay in `--keep` (pstats files, `<pid>.1.prof` the requests, `<pid>.2.prof` idle) for
comparing trees: `python -m pstats FILE`. Writes JSON.

    .venv/bin/python bench/profile_split.py [--requests 3] [--max-tokens 128] [--keep DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pstats
import signal
import sys
import tempfile
import time
from pathlib import Path

import result_file
import trio
from split import SMALL, measure, start_split

from meshagent.launch import cpu_seconds

HERE = Path(__file__).resolve().parent
MODEL = "SmolLM2-135M-Instruct.Q4_1"


def phase(agents, run) -> tuple[float, list[float]]:
    """Run `run()` with every agent's profiler on: (seconds, main-thread CPU s of each)."""
    for a in agents:
        os.kill(a.proc.pid, signal.SIGUSR1)
    time.sleep(0.2)
    before = [cpu_seconds(a.proc.pid)[0] for a in agents]
    began = time.monotonic()
    run()
    took = time.monotonic() - began
    cpu = [cpu_seconds(a.proc.pid)[0] - b for a, b in zip(agents, before, strict=True)]
    for a in agents:
        os.kill(a.proc.pid, signal.SIGUSR2)
    return took, cpu


def top(path: Path, n: int) -> list[tuple[str, int, float]]:
    """The `n` functions with the most time of their own: (name, calls, seconds)."""
    if not path.exists():
        return [("(no profile written)", 0, 0.0)]
    stats = pstats.Stats(str(path)).stats  # type: ignore[attr-defined]
    rows = []
    for (file, line, name), (_, calls, own, _, _) in stats.items():
        short = file.split("site-packages/")[-1].split(str(HERE.parent) + "/")[-1]
        rows.append((f"{short}:{line}({name})", calls, own))
    return sorted(rows, key=lambda r: -r[2])[:n]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--idle", type=float, default=15.0, help="seconds of the idle phase")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument(
        "--keep", type=Path, help="write the profiles and agents' logs here (default: a temp dir)"
    )
    ap.add_argument("--out", type=Path, default=Path("bench/results/profile_split.json"))
    args = ap.parse_args()
    with (
        tempfile.TemporaryDirectory(prefix="meshagent-profile-") as tmp,
        contextlib.ExitStack() as stack,
    ):
        profiles = args.keep or Path(tmp) / "profiles"
        profiles.mkdir(parents=True, exist_ok=True)
        os.environ["MESHAGENT_PROFILE_DIR"] = str(profiles)
        launcher = [sys.executable, str(HERE / "profiled_agent.py")]
        root = Path(tmp) if args.keep is None else args.keep / "agents"
        entry, _, agents = start_split(
            root, stack, MODEL, SMALL, ["--wire-dtype", "f16"], launcher=launcher
        )
        trio.run(measure, entry.url, MODEL, 8, 1)  # warm up
        time.sleep(2)
        tokens = args.requests * args.max_tokens

        def requests() -> None:
            for _ in range(args.requests):
                trio.run(measure, entry.url, MODEL, args.max_tokens, 1)

        busy_s, busy_cpu = phase(agents, requests)
        time.sleep(2)
        idle_s, idle_cpu = phase(agents, lambda: time.sleep(args.idle))
        wanted = [profiles / f"{a.proc.pid}.1.prof" for a in agents]
        deadline = time.monotonic() + 30
        while not all(w.exists() for w in wanted) and time.monotonic() < deadline:
            time.sleep(0.2)  # each agent writes its profile from its event loop's thread
        time.sleep(0.5)
        rows = []
        for i, a in enumerate(agents):
            per_s = idle_cpu[i] * 1000 / idle_s
            per_token = busy_cpu[i] * 1000 / tokens
            net = (busy_cpu[i] * 1000 - per_s * busy_s) / tokens
            rows.append(
                {
                    "stage": i + 1,
                    "idle_ms_per_s": per_s,
                    "ms_per_token": per_token,
                    "net_ms_per_token": net,
                    "top": top(profiles / f"{a.proc.pid}.1.prof", args.top),
                }
            )
    print(f"{tokens} tokens in {busy_s:.1f} s ({tokens / busy_s:.1f} tok/s); idle {idle_s:.0f} s")
    print(f"{'stage':<7}{'idle ms/s':>10}{'ms/token':>10}{'net of idle':>13}")
    for r in rows:
        print(
            f"{r['stage']:<7}{r['idle_ms_per_s']:>10.1f}{r['ms_per_token']:>10.2f}"
            f"{r['net_ms_per_token']:>13.2f}"
        )
    for r in rows:
        print(f"\nstage {r['stage']}, the token phase's own time by function (profiled):")
        for name, calls, own in r["top"]:
            print(f"  {own * 1000:8.1f} ms {calls:>8} calls  {name}")
    result_file.write(
        args.out,
        {
            "benchmark": "profile_split",
            "tokens": tokens,
            "seconds": busy_s,
            "stages": rows,
            "machine": result_file.machine(),
        },
    )


if __name__ == "__main__":
    main()
