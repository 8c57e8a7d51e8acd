"""Run a net-sim certification scenario and write its report (markdown, JSON, PNG plots) into
a new folder under net-sim/reports/ (or --out). Needs root. See docs/net-sim.md.

    sudo .venv/bin/python net-sim/sim.py split --regime wan            # `just sim wan`
    sudo .venv/bin/python net-sim/sim.py split --regime all --requests 20
    sudo .venv/bin/python net-sim/sim.py soak --requests 200           # `just sim-soak`
    sudo .venv/bin/python net-sim/sim.py faults                        # `just sim-faults`
    sudo .venv/bin/python net-sim/sim.py discovery                     # `just sim-discovery`
    sudo .venv/bin/python net-sim/sim.py churn                         # `just sim-churn`
    sudo .venv/bin/python net-sim/sim.py prefix --regime wan           # `just sim-prefix`
    sudo .venv/bin/python net-sim/sim.py nat --runs 20                 # `just sim-nat`
    .venv/bin/python net-sim/sim.py render net-sim/reports/<run>       # report.md and plots again
"""

from __future__ import annotations

import argparse
import shlex
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from netsim import nat_matrix, nat_move, report, scenarios  # noqa: E402 - after the path is set
from netsim.errors import NeedsRoot  # noqa: E402
from netsim.lab import check_requirements  # noqa: E402
from netsim.regimes import REGIMES  # noqa: E402


def _regimes(text: str) -> list[str]:
    names = list(REGIMES) if text == "all" else [r.strip() for r in text.split(",") if r.strip()]
    bad = [r for r in names if r not in REGIMES]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"unknown regime {', '.join(bad) or text!r}; known: {', '.join(REGIMES)}, or all"
        )
    return names


SPECULATION_MIXES = ("copy", "code", "prose")


def _mixes(text: str) -> tuple[str, ...]:
    names = tuple(m.strip() for m in text.split(",") if m.strip())
    bad = [m for m in names if m not in SPECULATION_MIXES]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"unknown workload {', '.join(bad) or text!r}; known: {', '.join(SPECULATION_MIXES)}"
        )
    return names


def _header(scenario: str, argv: list[str]) -> dict[str, Any]:
    return {
        "scenario": scenario,
        "created": datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "git": report.git_revision(HERE.parent),
        "command": shlex.join(["net-sim/sim.py", *argv]),
    }


def run_split(
    scenario: str,
    regimes: list[str],
    settings: scenarios.SplitSettings,
    out: Path,
    argv: list[str],
) -> dict[str, Any]:
    """Split serving (and its soak) in each regime, one after the other; the report."""
    results = {r: scenarios.split(r, out, settings) for r in regimes}
    rep = {**_header(scenario, argv), "regimes": results}
    rep.update(scenarios.split_scope(results, settings, scenario))
    report.split_report(out, rep)
    return rep


def run_prefix(
    regimes: list[str], settings: scenarios.PrefixSettings, out: Path, argv: list[str]
) -> dict[str, Any]:
    results = {r: scenarios.prefix(r, out, settings) for r in regimes}
    rep = {**_header("prefix", argv), "regimes": results}
    rep["tested"] = [
        f"regime `{n}`: three agents ({' '.join(scenarios.PREFIX_AGENT)}) split SmolLM2; "
        f"{settings.conversations} conversations of about 1,500 prompt tokens, each asked "
        "twice (the second turn adds the first answer and a question), greedy, streamed, one "
        "at a time at the entry's API"
        for n in results
    ]
    rep["not_tested"] = ["kept prefixes under load or eviction (tests/serving)", "other regimes"]
    report.prefix_report(out, rep)
    return rep


def run_faults(settings: scenarios.FaultSettings, out: Path, argv: list[str]) -> dict[str, Any]:
    f = scenarios.faults(out, settings)
    rep = {**_header("faults", argv), "faults": f, **scenarios.faults_scope(f, settings)}
    report.faults_report(out, rep)
    return rep


def run_churn(settings: scenarios.ChurnSettings, out: Path, argv: list[str]) -> dict[str, Any]:
    c = scenarios.churn(out, settings)
    rep = {**_header("churn", argv), "churn": c, **scenarios.churn_scope(c, settings)}
    report.churn_report(out, rep)
    return rep


def run_discovery(seed: int, serve: int, out: Path, argv: list[str]) -> dict[str, Any]:
    d = scenarios.discovery(out, seed=seed, serve=serve)
    rep = {**_header("discovery", argv), "discovery": d, **scenarios.discovery_scope(d)}
    report.discovery_report(out, rep)
    return rep


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="scenario", required=True)
    d = scenarios.SplitSettings()
    for name, requests, help_ in (
        ("split", d.requests, "split serving over 3 hosts per regime, with a short soak"),
        ("soak", 200, "split serving with a long soak (default wan, 200 requests)"),
    ):
        sp = sub.add_parser(name, help=help_)
        sp.add_argument("--regime", type=_regimes, default=["wan"], help="a regime, a,b or all")
        sp.add_argument("--requests", type=int, default=requests, help="soak requests")
        sp.add_argument("--concurrency", type=int, default=d.concurrency)
        sp.add_argument("--calibration", type=int, default=d.calibration)
        sp.add_argument(
            "--speculation",
            type=int,
            default=d.speculation,
            help="requests of each --mixes workload, drafts off then auto (0: none)",
        )
        sp.add_argument(
            "--mixes",
            type=_mixes,
            default=d.mixes,
            help="the speculation workloads, of copy, code and prose (default copy,prose)",
        )
        sp.add_argument("--forwarded", type=int, default=d.forwarded)
        sp.add_argument("--seed", type=int, default=d.seed)
        sp.add_argument("--wire-dtype", choices=("auto", "f16", "f32"), default=d.wire_dtype)
        sp.add_argument("--model", default=d.model, help="a GGUF to split (default: SmolLM2)")
        sp.add_argument(
            "--max-memory", default=d.max_memory, help="what each agent offers for the model"
        )
        sp.add_argument(
            "--draft-model",
            default=d.draft_model,
            help="a draft model each agent is given (a GGUF or auto); its memory is added",
        )
    x = scenarios.PrefixSettings()
    xp = sub.add_parser("prefix", help="a conversation's second turn against its first (split)")
    xp.add_argument("--regime", type=_regimes, default=["wan"], help="a regime, a,b or all")
    xp.add_argument("--conversations", type=int, default=x.conversations)
    xp.add_argument("--seed", type=int, default=x.seed)
    f = scenarios.FaultSettings()
    fp = sub.add_parser("faults", help="kill, partition and power-cut a stage host under load")
    fp.add_argument("--regime", choices=REGIMES, default=f.regime)
    fp.add_argument("--seed", type=int, default=f.seed)
    fp.add_argument("--partition-s", type=float, default=f.partition_s)
    fp.add_argument("--observe-s", type=float, default=f.observe_s)
    fp.add_argument("--no-power-cut", dest="power_cut", action="store_false")
    c = scenarios.ChurnSettings()
    cp = sub.add_parser("churn", help="a long mixed load over 4 agents while stage hosts fail")
    cp.add_argument("--regime", choices=REGIMES, default=c.regime)
    cp.add_argument("--seed", type=int, default=c.seed)
    cp.add_argument("--requests", type=int, default=c.requests)
    cp.add_argument("--concurrency", type=int, default=c.concurrency)
    cp.add_argument("--period-s", type=float, default=c.period_s, help="seconds between faults")
    cp.add_argument("--down-s", type=float, default=c.down_s, help="seconds a victim stays down")
    cp.add_argument(
        "--kinds",
        default=",".join(c.kinds),
        help="the faults, in turn (kill, sigint, power_cut, partition)",
    )
    dp = sub.add_parser("discovery", help="mDNS on a LAN, and the relay between isolated hosts")
    dp.add_argument("--seed", type=int, default=1)
    dp.add_argument("--serve", type=int, default=3, help="requests through each mesh formed")
    np_ = sub.add_parser("nat", help="every pair of NAT kinds: direct or relayed, how fast")
    np_.add_argument("--runs", type=int, default=20, help="runs a pair")
    np_.add_argument("--kinds", default=",".join(nat_matrix.KINDS), help="NAT kinds, a,b,...")
    np_.add_argument("--regime", choices=REGIMES, default="wan")
    np_.add_argument("--parallel", type=int, default=3, help="pairs run at once")
    np_.add_argument("--cap", type=float, default=20.0, help="seconds a run waits for direct")
    np_.add_argument("--seed", type=int, default=1)
    np_.add_argument(
        "--only",
        choices=("matrix", "split"),
        help="run only the matrix, or only the split moving from relayed to direct",
    )
    np_.add_argument("--tokens", type=int, default=600, help="the split's stream, in tokens")
    np_.add_argument(
        "--split-kinds",
        default="port-restricted,port-restricted,port-restricted",
        help="the split's three NATs, a,b,c",
    )
    for sp in sub.choices.values():
        sp.add_argument("--out", type=Path, help="the run's folder (default: a new one)")
    rp = sub.add_parser("render", help="write a run's report.md and plots again from its data")
    rp.add_argument("run", type=Path, help="the run's folder")
    args = p.parse_args(argv)
    if args.scenario == "render":
        report.write(args.run, report.load(args.run))
        print(args.run / "report.md")
        return 0
    try:
        check_requirements()
    except NeedsRoot as e:
        print(f"sim: {e}", file=sys.stderr)
        return 2
    if args.scenario in ("split", "soak", "prefix"):
        label = "-".join(args.regime) if len(args.regime) < len(REGIMES) else "all"
    elif args.scenario in ("faults", "churn", "nat"):
        label = args.regime
    else:
        label = "lan-relay"
    out = args.out or report.run_dir(args.scenario, label)
    out.mkdir(parents=True, exist_ok=True)
    print(f"sim: {args.scenario} → {out}", file=sys.stderr)
    if args.scenario == "nat":
        kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
        unknown = [k for k in kinds if k not in nat_matrix.KINDS]
        if unknown:
            p.error(f"no NAT kind {', '.join(unknown)}; there are {', '.join(nat_matrix.KINDS)}")
        split_kinds = tuple(k.strip() for k in args.split_kinds.split(","))
        wrong = [k for k in split_kinds if k not in nat_matrix.KINDS]
        if len(split_kinds) != 3 or wrong:
            p.error(f"--split-kinds takes three of {', '.join(nat_matrix.KINDS)}")
        rep = split = None
        if args.only != "split":
            rep = nat_matrix.matrix(
                out / "matrix",
                runs=args.runs,
                kinds=kinds,
                regime=args.regime,
                parallel=args.parallel,
                cap_s=args.cap,
                seed=args.seed,
            )
            print(nat_matrix.table(rep))
        if args.only != "matrix":
            split = nat_move.run(
                out / "split",
                regime=args.regime,
                tokens=args.tokens,
                seed=args.seed,
                kinds=split_kinds,  # type: ignore[arg-type]
            )
            print(nat_move.table(split))
        if rep is not None and split is not None:
            pairs = nat_move.by_pair(rep, split)
            (out / "report.md").write_text(
                nat_matrix.table(rep) + "\n" + nat_move.table(split) + "\n" + pairs
            )
            print(pairs)
        return 0
    if args.scenario in ("split", "soak"):
        settings = scenarios.SplitSettings(
            requests=args.requests,
            concurrency=args.concurrency,
            calibration=args.calibration,
            speculation=args.speculation,
            mixes=args.mixes,
            forwarded=args.forwarded,
            seed=args.seed,
            wire_dtype=args.wire_dtype,
            model=args.model,
            max_memory=args.max_memory,
            draft_model=args.draft_model,
        )
        rep = run_split(args.scenario, args.regime, settings, out, argv)
        for name, r in rep["regimes"].items():
            t = r["totals"]
            vs = (r.get("isolation") or {}).get("median_vs_floor") or {}
            print(
                f"{name}: {t['ok']} ok / {t['failed']} failed, streams complete "
                f"{t['streams_complete']}/{t['streams']}; per-token {vs.get('measured_ms')} ms "
                f"vs floor {vs.get('floor_ms')} ms (goal met: {vs.get('goal_met')})"
            )
            for mix, m in (r.get("speculation") or {}).items():
                print(
                    f"{name}: speculation {mix}: {m['tok_s_off']} -> {m['tok_s_auto']} tok/s "
                    f"({m['ratio']}x), accepted {m['accepted']}/{m['drafted']} (draft model "
                    f"{m['model_accepted']}/{m['model_drafted']}), same text {m['same_text']}"
                )
    elif args.scenario == "prefix":
        ps = scenarios.PrefixSettings(conversations=args.conversations, seed=args.seed)
        rep = run_prefix(args.regime, ps, out, argv)
        for name, r in rep["regimes"].items():
            p, t = r["prefix"], r["totals"]
            print(
                f"{name}: {t['ok']} ok / {t['failed']} failed; second turn / first, median "
                f"{p['median_ratio']} (goal <= 0.2, met: {p['goal_met']})"
            )
    elif args.scenario == "faults":
        fs = scenarios.FaultSettings(
            regime=args.regime,
            seed=args.seed,
            partition_s=args.partition_s,
            observe_s=args.observe_s,
            power_cut=args.power_cut,
        )
        rep = run_faults(fs, out, argv)
        t = rep["faults"]["totals"]
        print(f"faults: {t['ok']} ok / {t['failed']} failed requests")
    elif args.scenario == "churn":
        kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
        bad = [k for k in kinds if k not in ("kill", "sigint", "power_cut", "partition")]
        if bad or not kinds:
            p.error(f"unknown fault kind(s): {', '.join(bad) or args.kinds!r}")
        cs = scenarios.ChurnSettings(
            regime=args.regime,
            seed=args.seed,
            requests=args.requests,
            concurrency=args.concurrency,
            period_s=args.period_s,
            down_s=args.down_s,
            kinds=kinds,
        )
        rep = run_churn(cs, out, argv)
        t, g = rep["churn"]["totals"], rep["churn"]["greedy"]
        print(
            f"churn: {t['ok']} ok / {t['failed']} failed, streams complete "
            f"{t['streams_complete']}/{t['streams']}, replayed {t['replayed']}; greedy identical "
            f"{g['identical']}/{g['checked']}"
        )
    else:
        rep = run_discovery(args.seed, args.serve, out, argv)
        for name, part in rep["discovery"]["parts"].items():
            print(f"{name}: {part.get('times')}")
    print(out / "report.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
