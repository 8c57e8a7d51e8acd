"""Placement benchmark: how close the planner's splits come to the best possible, and how long
it takes on big meshes. Never asserts; prints tables and writes JSON (default
bench/results/placement.json).

1. Small meshes: random heterogeneous meshes of 4-12 peers (memory 2-12 GB, speeds over a
   factor of 6, peers in one to three cities of `meshagent/testing/city_rtts.py`), each
   needing a split of a 13B-shaped model. The planner's estimated time per token against the
   exhaustive optimum under the same cost model (`meshagent/testing/placement_optimum.py`):
   the distribution of the ratio.
2. Big meshes: 20, 100 and 1,000 peers of laptops (2-16 GB) and a few GPU-less workstations,
   spread over the cities, with a 70B and a 405B shape: whether a plan exists where memory
   allows, its stages, its estimate, the time to compute it, and whether the same snapshot in
   other orders gives the same plan (what every agent computes).

    .venv/bin/python bench/placement.py [--meshes 1000] [--sizes 20,100,1000] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import result_file

from meshagent.placement.planner import ModelCost, PeerCapacity, PlanError, plan, unknown_rtt
from meshagent.testing.city_rtts import CITIES, rtt
from meshagent.testing.placement_optimum import optimum

GB = 10**9
CTX = 4096
HEADROOM = 0.1


def shape(name: str) -> ModelCost:
    """Layer bytes at Q4_K_M, KV cache at f16 (GQA, 8 KV heads of 128), flops of a token."""
    layers, width, vocab, params_per_layer, kv_heads = {
        "13b": (40, 5120, 32000, 0.32e9, 40),
        "70b": (80, 8192, 128256, 0.86e9, 8),
        "405b": (126, 16384, 128256, 3.2e9, 8),
    }[name]
    q4 = 4.85 / 8  # bytes per weight at Q4_K_M
    return ModelCost(
        model_id=name,
        n_layers=layers,
        layer_bytes=(int(params_per_layer * q4),) * layers,
        embedding_bytes=int(vocab * width * q4),
        head_bytes=int(vocab * width * 6.56 / 8),
        other_bytes=int(width * 4),
        kv_bytes_per_token_per_layer=2 * kv_heads * 128 * 2,
        flops_per_layer=2.0 * params_per_layer,
        n_embd=width,
        n_vocab=vocab,
    )


def mesh(rng: random.Random, n: int, model: ModelCost, *, cities: int, small: bool) -> list:
    """n peers over `cities` cities: memory offered, CPU speed in layers per second of the
    model (from 60-360 GFLOP/s), measured RTTs to every other peer."""
    where = rng.sample(CITIES, cities)
    city = [rng.choice(where) for _ in range(n)]
    ids = [f"p{rng.getrandbits(40):010x}" for _ in range(n)]
    table = {}
    for i in range(n):
        for j in range(i + 1, n):
            table[i, j] = table[j, i] = rtt(city[i], city[j], rng)
    peers = []
    for i in range(n):
        gb = rng.choice([2, 3, 4, 4, 6, 8, 12]) if small else rng.choice([2, 4, 8, 8, 16])
        gflops = rng.uniform(60, 360)
        rtts = {ids[j]: table[i, j] for j in range(n) if j != i}
        peers.append(PeerCapacity(ids[i], gb * GB, gflops * 1e9 / model.flops_per_layer, rtts))
    return peers


def small_meshes(count: int, seed: int) -> dict:
    rng = random.Random(seed)
    model = shape("13b")
    whole = model.stage_bytes(0, model.n_layers, CTX)
    ratios, stages, plan_ms, opt_ms = [], [], [], []
    while len(ratios) < count:
        peers = mesh(rng, rng.randint(4, 12), model, cities=rng.randint(1, 3), small=True)
        total = sum(p.memory_bytes for p in peers) * (1 - HEADROOM)
        if max(p.memory_bytes for p in peers) * (1 - HEADROOM) >= whole or total < whole * 1.2:
            continue  # one peer holds it whole, or hardly any split fits: not a split's case
        t = time.perf_counter()
        try:
            got = plan(model, peers, context_tokens=CTX, headroom=HEADROOM)
        except PlanError:
            got = None
        plan_ms.append((time.perf_counter() - t) * 1000)
        t = time.perf_counter()
        best = optimum(
            model, peers, context_tokens=CTX, headroom=HEADROOM, unknown_rtt=unknown_rtt(peers)
        )
        opt_ms.append((time.perf_counter() - t) * 1000)
        if got is None:
            ratios.append(float("inf"))
            continue
        ratios.append(got.est_token_ms / best)
        stages.append(len(got.stages))
    finite = sorted(r for r in ratios if r != float("inf"))
    q = statistics.quantiles(finite, n=100) if len(finite) > 1 else finite * 99
    return {
        "meshes": count,
        "no_plan_where_one_exists": len(ratios) - len(finite),
        "within_1pct": sum(r <= 1.01 for r in ratios) / count,
        "within_5pct": sum(r <= 1.05 for r in ratios) / count,
        "ratio_min": round(min(finite), 4),  # below 1 would be a bug in the optimum
        "ratio_median": round(statistics.median(finite), 4),
        "ratio_p90": round(q[89], 4),
        "ratio_p99": round(q[98], 4),
        "ratio_max": round(max(finite), 4),
        "stages_median": statistics.median(stages),
        "stages_max": max(stages),
        "plan_ms_median": round(statistics.median(plan_ms), 1),
        "plan_ms_max": round(max(plan_ms), 1),
        "optimum_ms_median": round(statistics.median(opt_ms), 1),
    }


def big_meshes(sizes: list[int], seed: int) -> list[dict]:
    rows = []
    for name in ("70b", "405b"):
        model = shape(name)
        whole = model.stage_bytes(0, model.n_layers, CTX)
        for n in sizes:
            rng = random.Random(seed + n)
            peers = mesh(rng, n, model, cities=3, small=False)
            room = sum(p.memory_bytes for p in peers) * (1 - HEADROOM)
            t = time.perf_counter()
            try:
                got = plan(model, peers, context_tokens=CTX, headroom=HEADROOM)
                error = ""
            except PlanError as e:
                got, error = None, str(e)
            took = time.perf_counter() - t
            same = True
            for k in range(2):
                shuffled = peers[:]
                random.Random(k).shuffle(shuffled)
                try:
                    again = plan(model, shuffled, context_tokens=CTX, headroom=HEADROOM)
                except PlanError:
                    again = None
                same &= again == got
            rows.append(
                {
                    "model": name,
                    "peers": n,
                    "mesh_memory_gb": round(room / GB, 1),
                    "model_needs_gb": round(whole / GB, 1),
                    "planned": got is not None,
                    "stages": len(got.stages) if got else 0,
                    "est_token_ms": round(got.est_token_ms, 1) if got else None,
                    "plan_s": round(took, 3),
                    "same_in_other_orders": same,
                    "error": error[:120],
                }
            )
            print(json.dumps(rows[-1]), file=sys.stderr)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--meshes", type=int, default=1000)
    ap.add_argument("--sizes", default="20,100,1000")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--out", type=Path, default=Path("bench/results/placement.json"))
    args = ap.parse_args()
    t = time.perf_counter()
    small = small_meshes(args.meshes, args.seed)
    small["wall_s"] = round(time.perf_counter() - t, 1)
    print("small meshes (4-12 peers, 13B shape): the plan's estimate / the exhaustive optimum")
    result_file.print_table([small])
    big = big_meshes([int(x) for x in args.sizes.split(",")], args.seed)
    print("big meshes")
    result_file.print_table(big)
    result = {"machine": result_file.machine(), "context_tokens": CTX, "small": small, "big": big}
    result_file.write(args.out, result)


if __name__ == "__main__":
    main()
