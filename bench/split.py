"""Split serving vs one agent: decode tokens/s through the API, and aggregate tokens/s with
several concurrent requests.

Three agent processes on loopback, each offering too little memory to hold SmolLM2 alone, agree
on a three-stage split; one agent with enough memory serves it whole. Every agent runs llama.cpp
with one thread, so that the split (three processes) and the single agent use the same compute
per token and the difference is the cost of splitting. It also measures the CPU that one token
costs with several requests in flight (all agents and the client, which share this machine's
cores): the cores can give at most cores / that much tokens per second, which bounds what
concurrency can gain here. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import result_file
import trio

from meshagent.launch import AgentProcess, cpu_seconds, start_agent
from meshagent.sse_client import aiter_events, chunk_text

PROMPT = "1, 2, 3, 4, 5, 6,"  # a greedy model keeps counting: every request runs to max_tokens
SMALL = ["--max-memory", "80M", "--slots", "4", "--ctx-size", "512", "--threads", "1"]
BIG = ["--slots", "4", "--ctx-size", "512", "--threads", "1"]


async def one_stream(
    url: str, model: str, max_tokens: int, stage_ms: list[float] | None = None
) -> list[float]:
    """Arrival times of the streamed tokens; a split's compute milliseconds over all its stages
    (the receipt in the usage chunk) are appended to `stage_ms`."""
    body = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    arrivals = []
    async with (
        httpx.AsyncClient(timeout=300) as client,
        client.stream("POST", f"{url}/v1/completions", json=body) as r,
    ):
        async for event in aiter_events(r):
            if event.done:
                continue
            chunk = event.json()
            if chunk_text(chunk):
                arrivals.append(time.perf_counter())
            receipt = (chunk.get("usage") or {}).get("meshagent")
            if receipt and stage_ms is not None:
                stage_ms.append(sum(receipt["stage_ms"]))
    return arrivals


async def measure(
    url: str, model: str, max_tokens: int, concurrent: int, stage_ms: list[float] | None = None
) -> float:
    """Decode tokens/s: one request alone, or the aggregate of `concurrent` requests."""
    results: list[list[float]] = []

    async def run() -> None:
        results.append(await one_stream(url, model, max_tokens, stage_ms))

    async with trio.open_nursery() as n:
        for _ in range(concurrent):
            n.start_soon(run)
    first = min(r[0] for r in results)
    last = max(r[-1] for r in results)
    tokens = sum(len(r) for r in results) - concurrent
    return tokens / (last - first)


def cpu_per_token(agents, run) -> tuple[float, list[tuple[float, float]]]:
    """Run `run()` (returns tokens generated); CPU ms per token of each agent (main thread,
    other threads)."""
    before = [cpu_seconds(a.proc.pid) for a in agents]
    tokens = run()
    after = [cpu_seconds(a.proc.pid) for a in agents]
    return tokens, [
        ((m1 - m0) * 1000 / tokens, (o1 - o0) * 1000 / tokens)
        for (m0, o0), (m1, o1) in zip(before, after, strict=True)
    ]


def wait_routable(agents, model: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if all(
                httpx.get(f"{a.url}/control/status").json()["placement"][model]["routable"]
                for a in agents
            ):
                return
        except (httpx.HTTPError, KeyError, TypeError):
            pass
        time.sleep(0.5)
    why = httpx.get(f"{agents[0].url}/control/status").json()["placement"].get(model)
    raise RuntimeError(f"the split did not become routable: {why}")


def start_split(
    root: Path,
    agents: contextlib.ExitStack,
    model: str,
    flags: list[str],
    first: list[str] = (),
    launcher: list[str] = (),
    timeout: float = 180,
) -> tuple[AgentProcess, list, list[AgentProcess]]:
    """Three agents with `flags` (the first also `first`) in one mesh, stopped with `agents`;
    once the model is routable, the split's entry, its stages and the three agents in the
    stages' order (which agent holds which stage follows from their random identities).
    `launcher`: as `start_agent` takes it; `timeout`: seconds to wait for the split."""
    a = start_agent(root / "a", *flags, *first, wait_model=False, launcher=launcher)
    agents.callback(a.stop)
    token = subprocess.run(
        [sys.executable, "-m", "meshagent", "invite", "--data-dir", str(root / "a")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    split = [a]
    for name in ("b", "c"):
        split.append(
            start_agent(root / name, *flags, "--join", token, wait_model=False, launcher=launcher)
        )
        agents.callback(split[-1].stop)
    wait_routable(split, model, timeout)
    stages = httpx.get(f"{a.url}/control/status").json()["placement"][model]["stages"]
    ids = {httpx.get(f"{x.url}/control/status").json()["peer_id"]: x for x in split}
    in_order = [ids[peer] for peer, *_ in stages]
    return in_order[0], stages, in_order


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrent", type=int, default=4)
    ap.add_argument("--out", type=Path, default=Path("bench/results/split.json"))
    ap.add_argument("--model", type=Path, help="a GGUF file (default: the embedded SmolLM2)")
    ap.add_argument(
        "--split-args",
        default=" ".join(SMALL),
        help=f"flags of the three split agents (default {' '.join(SMALL)!r})",
    )
    ap.add_argument(
        "--single-args",
        default=" ".join(BIG),
        help=f"flags of the single agent (default {' '.join(BIG)!r})",
    )
    args = ap.parse_args()
    model = "SmolLM2-135M-Instruct.Q4_1"
    small, big = args.split_args.split(), args.single_args.split()
    if args.model:
        model = args.model.name.removesuffix(".gguf")
        small, big = [*small, "--model", str(args.model)], [*big, "--model", str(args.model)]
    rows: dict[str, list[float]] = {"single 1": [], "single N": [], "split 1": [], "split N": []}
    compute_ms: list[float] = []  # the split's compute per decode token, all stages, per round
    with (
        tempfile.TemporaryDirectory(prefix="meshagent-bench-") as tmp,
        contextlib.ExitStack() as agents,  # stopped however the run ends
    ):
        root = Path(tmp)
        entry, stages, split = start_split(root, agents, model, small, ["--wire-dtype", "f16"])
        single = start_agent(root / "single", *big)  # a mesh of its own
        agents.callback(single.stop)
        trio.run(measure, entry.url, model, 8, 1)  # warm up both
        trio.run(measure, single.url, model, 8, 1)
        # The stages' compute for the prompt and first token alone, to take out of each
        # request's receipt: what is left is the compute of its decode steps.
        first: list[float] = []
        for _ in range(3):
            trio.run(one_stream, entry.url, model, 1, first)
        prefill_ms = statistics.median(first)

        # CPU per token, one request of max_tokens, on each side (less sensitive to what else
        # the machine runs than wall time).
        def tokens_of(url: str, concurrent: int = 1):
            """A run of `concurrent` requests of max_tokens; returns the tokens asked for."""

            def run() -> int:
                trio.run(measure, url, model, args.max_tokens, concurrent)
                return args.max_tokens * concurrent

            return run

        _, cpu_single = cpu_per_token([single], tokens_of(single.url))
        _, cpu_split = cpu_per_token(split, tokens_of(entry.url))
        # The same with N concurrent requests, this process (the client) included: what the
        # machine's cores allow the split's aggregate to reach at most.
        client0 = time.process_time()
        _, cpu_split_n = cpu_per_token(split, tokens_of(entry.url, args.concurrent))
        client_ms = (time.process_time() - client0) * 1000 / (args.max_tokens * args.concurrent)
        cpu_n_total = sum(m + o for m, o in cpu_split_n) + client_ms
        for _ in range(args.rounds):
            rows["single 1"].append(trio.run(measure, single.url, model, args.max_tokens, 1))
            receipt: list[float] = []
            rows["split 1"].append(trio.run(measure, entry.url, model, args.max_tokens, 1, receipt))
            compute_ms.append((receipt[0] - prefill_ms) / (args.max_tokens - 1))
            rows["single N"].append(
                trio.run(measure, single.url, model, args.max_tokens, args.concurrent)
            )
            rows["split N"].append(
                trio.run(measure, entry.url, model, args.max_tokens, args.concurrent)
            )
    med = {k: statistics.median(v) for k, v in rows.items()}
    overhead_ms = 1000 / med["split 1"] - 1000 / med["single 1"]
    # Each round measures its contenders back to back: the ratio within a round sees one
    # state of the machine, so the median of those ratios is the steadier figure.
    pairs = {
        "split_vs_single": [s / o for s, o in zip(rows["split 1"], rows["single 1"], strict=True)],
        "concurrency_gain": [n / o for n, o in zip(rows["split N"], rows["split 1"], strict=True)],
        # What the stages' compute allows one request: the single agent's time per token
        # over the split's compute per token (its three llama.cpp contexts, which on this
        # one machine also share caches and cores), i.e. a split with no cost of its own.
        "compute_ceiling": [
            (1000 / o) / c for o, c in zip(rows["single 1"], compute_ms, strict=True)
        ],
        # The split's time per token spent computing: how close it comes to that ceiling.
        "of_ceiling": [s * c / 1000 for s, c in zip(rows["split 1"], compute_ms, strict=True)],
    }
    print(f"{'run':<34}{'decode tok/s (median)':>22}")
    for k, v in med.items():
        label = k.replace(" N", f" x{args.concurrent} concurrent (aggregate)").replace(
            " 1", ", one request"
        )
        print(f"{label:<34}{v:>22.1f}")
    print(f"split / single, one request: {med['split 1'] / med['single 1']:.3f} (goal >= 0.90)")
    r = pairs["split_vs_single"]
    print(f"  per round: median {statistics.median(r):.3f}, range {min(r):.3f}-{max(r):.3f}")
    print(f"per-token overhead of the split: {overhead_ms:.2f} ms")
    cc, oc = pairs["compute_ceiling"], pairs["of_ceiling"]
    print(
        f"  what the stages' compute allows (ceiling): {statistics.median(cc):.3f} "
        f"(range {min(cc):.3f}-{max(cc):.3f}); the split's compute "
        f"{statistics.median(compute_ms):.2f} ms per token against the single agent's "
        f"{1000 / med['single 1']:.2f} ms in all"
    )
    print(
        f"  measured / ceiling: {statistics.median(oc):.0%} (range {min(oc):.0%}-{max(oc):.0%}; "
        f"goal >= 90%); the rest, "
        f"{1000 / med['split 1'] - statistics.median(compute_ms):.2f} ms per token, is the "
        "hops between stages"
    )
    print(
        f"split, {args.concurrent} concurrent vs 1: {med['split N'] / med['split 1']:.2f}x "
        "(goal: >= 90% of what the cores allow, below)"
    )
    r = pairs["concurrency_gain"]
    print(f"  per round: median {statistics.median(r):.2f}x, range {min(r):.2f}-{max(r):.2f}x")
    cores = os.cpu_count() or 1
    ceiling = cores * 1000 / cpu_n_total
    print(
        f"  CPU per token at {args.concurrent} concurrent: {cpu_n_total:.2f} ms (agents and "
        f"client); {cores} cores allow at most {ceiling:.0f} tok/s, "
        f"{ceiling / med['split 1']:.2f}x one request; measured "
        f"{med['split N'] / ceiling:.0%} of that"
    )
    print("CPU ms per token, one request (trio/Python thread + other threads, mostly llama.cpp):")
    for name, rows_ in (("single", cpu_single), ("split", cpu_split)):
        parts = ", ".join(f"{m:.2f} + {o:.2f}" for m, o in rows_)
        total = sum(m + o for m, o in rows_)
        print(f"  {name:<8}{parts}  (total {total:.2f})")
    result = {
        "benchmark": "split",
        "model": model,
        "agent_args": {"split": small, "single": big},
        "stages": stages,
        "max_tokens": args.max_tokens,
        "rounds": rows,
        "median_tok_s": med,
        "split_vs_single": med["split 1"] / med["single 1"],
        "overhead_ms_per_token": overhead_ms,
        "split_compute_ms_per_token": compute_ms,
        "prefill_compute_ms": prefill_ms,
        "compute_ceiling": statistics.median(pairs["compute_ceiling"]),
        "of_compute_ceiling": statistics.median(pairs["of_ceiling"]),
        "concurrency_gain": med["split N"] / med["split 1"],
        "concurrent_cpu_ms_per_token": {
            "split_by_agent": cpu_split_n,
            "client": client_ms,
            "total": cpu_n_total,
            "cores": cores,
            "ceiling_tok_s": ceiling,
            "ceiling_gain": ceiling / med["split 1"],
        },
        "per_round": {k: [round(x, 4) for x in v] for k, v in pairs.items()},
        "cpu_ms_per_token": {
            "single": cpu_single,
            "split_by_agent": cpu_split,
            "note": "(main thread, other threads) per agent; split agents in the stages' order",
        },
        "machine": result_file.machine(),
    }
    result_file.write(args.out, result)


if __name__ == "__main__":
    main()
