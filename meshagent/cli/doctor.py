"""`meshagent doctor`: check what an agent needs on this host and say how to fix what is
wrong (`meshagent/doctor.py`)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from meshagent import doctor
from meshagent.cli.common import add_data_dir, auth_headers, data_dir_from
from meshagent.config import AgentConfig
from meshagent.errors import MeshError
from meshagent.models.default import local_file

MARK = {doctor.OK: "ok  ", doctor.WARN: "warn", doctor.FAIL: "FAIL"}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "doctor",
        help="check ports, keys, mDNS, relays, the llama.cpp build and memory; say how to fix",
    )
    add_data_dir(p)
    p.add_argument("--json", action="store_true", help="print the findings as JSON")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    dd = data_dir_from(args)
    findings: list[doctor.Finding] = []
    try:
        config = AgentConfig().merged(dd.load_config())
    except MeshError as e:
        findings.append(doctor.Finding(doctor.FAIL, "config", str(e), f"edit {dd.config_path}"))
        config = AgentConfig()
    # The model as it is on this machine now: doctor changes nothing, so a hub model not in
    # the cache is not downloaded here (`up` does that).
    spec = config.models[0] if config.models else ""
    try:
        model_path = local_file(spec)
    except MeshError as e:
        findings.append(doctor.Finding(doctor.FAIL, "model", str(e), "see the message"))
        model_path = None
    else:
        if model_path is None:
            said = f"{spec or 'the embedded model'} is not on this machine yet"
            findings.append(doctor.Finding(doctor.WARN, "model", said, "`meshagent up` fetches it"))
    situation = doctor.Situation(
        dd, config, doctor.running_status(dd, auth_headers(dd)), doctor.agent_command(dd)
    )
    findings += doctor.diagnose(situation, model_path)
    failed = sum(f.level == doctor.FAIL for f in findings)
    if args.json:
        print(json.dumps([asdict(f) for f in findings], indent=2))
        return 1 if failed else 0
    agent = "an agent runs" if situation.status is not None else "no agent runs"
    print(f"meshagent doctor: data dir {dd.root} ({agent})")
    for f in findings:
        print(f"{MARK[f.level]}  {f.check:10} {f.said}")
        if f.fix:
            print(f"      {'':10} fix: {f.fix}")
        if f.level != doctor.OK and f.more:
            print(f"      {'':10} more: {f.more}")
    warned = sum(f.level == doctor.WARN for f in findings)
    if failed:
        print(f"{failed} problem(s), {warned} warning(s)", file=sys.stderr)
        return 1
    print(f"no problem found ({warned} warning(s))")
    return 0
