"""A mesh of hundreds of agents serving three models of 70B shape under churn, on a virtual
clock (`meshagent/testing/scale_sim.py`: membership on the signed SWIM bus, every agent's
assignment from its own view, negotiation, loads and requests modelled). Never asserts;
prints a table and writes JSON (default bench/results/scale.json).

Per run: when every view is full and every model first routable; gossip bytes each agent
sends per second while the mesh forms and under churn (membership and the records that carry
placement claims); each churn event (one a minute, in turn: a join, a crash of an agent
serving a model, a crash of any agent, a partition of a tenth of the mesh for 45 s and its
heal) with the time until every view took it in and until every model it touched was
routable again; the requests served, replayed and failed, each failure with its reason; the
chains each model had (demand adds chains of a split); every request's tokens decoded on
fake splits of its chain's stages, and how many served requests, replayed ones included, came
out exactly as the whole model decodes them.

    .venv/bin/python bench/scale.py [--agents 300] [--minutes 30] [--claims plan,all]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import result_file

from meshagent.testing import scale_churn


def _kind_of(reason: str) -> str:
    """A failure's reason without its agents, layers and seconds: what kind it is."""
    return re.sub(r"\(\d+ s left\)|stage \d+-\d+ on \w{8}:? ?", "", reason).strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--agents", type=int, default=300)
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--claims",
        default="plan",
        help="who publishes placement claims, comma-separated runs: plan (the plan's peers "
        "and its proposer, as the agent does) or all (every agent, as it did before)",
    )
    ap.add_argument("--out", type=Path, default=Path("bench/results/scale.json"))
    args = ap.parse_args()
    rows = []
    for claims in args.claims.split(","):
        t0 = time.perf_counter()

        def log(e: dict) -> None:
            print(f"  {json.dumps(scale_churn.plain(e))}", file=sys.stderr, flush=True)

        got = scale_churn.run(
            args.agents, minutes=args.minutes, seed=args.seed, claims_by=claims, log=log
        )
        got["claims_by"] = claims
        got["wall_s"] = round(time.perf_counter() - t0, 1)
        kinds: dict[str, int] = {}
        for reason, count in got["failures"].items():
            kinds[_kind_of(reason)] = kinds.get(_kind_of(reason), 0) + count
        got["failure_kinds"] = kinds
        rows.append(got)
        print(json.dumps({k: v for k, v in got.items() if k != "events"}), file=sys.stderr)
    table = [
        {
            "claims_by": r["claims_by"],
            "agents": r["agents"],
            "views_full_s": r["views_full_s"],
            "formed_s": r["formed_s"],
            "B/s/agent forming": r["formation_bytes_per_agent_s"],
            "B/s/agent churn": r["churn_bytes_per_agent_s"],
            "requests": r["requests"],
            "served": r["served"],
            "replayed": r["replayed"],
            "failed": r["failed"],
            "as whole model": r["served_as_the_whole_model"],
            "chains (most)": ", ".join(str(n) for n in r["chains_most"].values()),
            "replan_s": ", ".join(
                f"{k} {v['median']}/{v['max']}" for k, v in r["replan_s_by_event"].items()
            ),
        }
        for r in rows
    ]
    result_file.print_table(table)
    for r in rows:
        print(f"failures ({r['claims_by']}):", json.dumps(r["failure_kinds"], indent=1))
    result_file.write(args.out, {"machine": result_file.machine(), "results": rows})


if __name__ == "__main__":
    main()
