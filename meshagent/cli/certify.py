"""`meshagent models certify`: check a model split against the model whole, write a report and
a signed capability record into the data dir."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace

from meshagent.cli.common import add_data_dir, data_dir_from
from meshagent.errors import ConfigError


def register(msub: argparse._SubParsersAction) -> None:
    c = msub.add_parser(
        "certify",
        help="measure a split against the whole model per wire dtype; sign a capability record",
    )
    c.add_argument("model", nargs="?", default="", help="a GGUF file (default: embedded)")
    c.add_argument(
        "--tokens", metavar="N", type=int, default=24, help="greedy tokens per prompt (24)"
    )
    c.add_argument(
        "--ctx-size",
        metavar="TOKENS",
        type=int,
        default=1024,
        help="context length to certify: the long prompt fills it (1024)",
    )
    c.add_argument(
        "--threads", metavar="N", type=int, default=0, help="compute threads (one per core)"
    )
    c.add_argument(
        "--cut",
        action="append",
        default=[],
        metavar="A:B:...",
        help="stage boundaries to check, e.g. 0:15:30 (repeatable; default: 2 and 3 equal "
        "stages and every layer-type boundary)",
    )
    c.add_argument(
        "--wire-dtype",
        action="append",
        choices=("f32", "f16"),
        help="wire dtypes to check (repeatable; default: all)",
    )
    c.add_argument(
        "--no-soak",
        action="store_true",
        help="skip the soak: three agent processes on loopback serving the split against one "
        "serving it whole",
    )
    c.add_argument("--json", action="store_true", help="print the report as JSON")
    add_data_dir(c)
    c.set_defaults(run=run_certify)


def _parse_cut(text: str, n_layers: int) -> tuple[int, ...]:
    try:
        cut = tuple(int(x) for x in text.split(":"))
    except ValueError:
        raise ConfigError(f"--cut must look like 0:15:30, got {text!r}") from None
    if len(cut) < 3 or cut[0] != 0 or cut[-1] != n_layers or list(cut) != sorted(set(cut)):
        raise ConfigError(
            f"--cut {text}: boundaries must rise from 0 to {n_layers} with at least two stages"
        )
    return cut


SOAK_CTX = 1024


def _soak(layout, record, identity, settings, progress):
    """Soak the cheapest dtype the checks found exact (what `--wire-dtype auto` would send);
    None when no dtype is exact (nothing to serve split)."""
    from meshagent.certify.prompts import PROMPTS
    from meshagent.certify.soak import soak
    from meshagent.models.capability import choose_wire_dtype

    choice = choose_wire_dtype("auto", record)
    if not choice.certified_exact:
        progress("soak: skipped, no wire dtype is exact")
        return None
    prompts = [p for p in PROMPTS if not p.fill_to_ctx]
    name = record.model_name
    progress(f"soak: 3 agents split {name}, wire {choice.dtype}, against a whole agent")
    return soak(
        layout,
        record.sign(identity),
        prompts,
        wire_dtype=choice.dtype,
        tokens=settings.tokens,
        # Room for every soak prompt whole (a byte-level vocabulary spends one token a byte).
        ctx=max(settings.ctx, SOAK_CTX),
        threads=settings.threads,
        progress=progress,
    )


def run_certify(args: argparse.Namespace) -> int:
    from meshagent.certify.checks import Settings, certify_model
    from meshagent.certify.report import build_record, report_json, report_markdown
    from meshagent.identity.keys import NodeIdentity
    from meshagent.models.artifacts import ArtifactStore
    from meshagent.models.capability import CapabilityStore
    from meshagent.models.default import resolve_model
    from meshagent.models.family import family_traits
    from meshagent.models.layout import inspect_model

    model = resolve_model(args.model)
    layout = inspect_model(model)
    if args.tokens < 1 or args.ctx_size < 64:
        raise ConfigError("--tokens must be >= 1 and --ctx-size >= 64")
    if layout.stage_refusal is not None:
        raise ConfigError(f"cannot certify {model.name} for splitting: {layout.stage_refusal}")
    traits = family_traits(layout)
    dd = data_dir_from(args)
    dd.ensure()
    identity, _ = NodeIdentity.load_or_create(dd.identity_path)
    store = ArtifactStore(dd.artifacts_path)
    settings = Settings(
        tokens=args.tokens,
        ctx=args.ctx_size,
        threads=args.threads,
        dtypes=tuple(dict.fromkeys(args.wire_dtype or ("f32", "f16"))),
        cuts=tuple(_parse_cut(c, layout.n_layers) for c in args.cut),
    )
    t0 = time.monotonic()

    def progress(what: str) -> None:
        print(f"[{time.monotonic() - t0:6.1f} s] {what}", file=sys.stderr, flush=True)

    progress(f"hashing {model.name}")
    sha = store.source_sha256(model)
    cert = certify_model(
        layout, store, settings, type_boundaries=traits.type_boundaries, progress=progress
    )
    record = build_record(
        cert,
        model_sha256=sha,
        certifier=identity.peer_id,
        layer_types=traits.layer_types,
        state_kind=traits.state_kind,
        state_portable=traits.state_portable,
    )
    soaked = None
    if not args.no_soak:
        soaked = _soak(layout, record, identity, settings, progress)
        if soaked is not None:
            wire = tuple(
                replace(w, soak_identical=soaked.passed) if w.dtype == soaked.wire_dtype else w
                for w in record.wire
            )
            record = replace(record, wire=wire)
    record_path = CapabilityStore(store.capabilities_path).put(record.sign(identity))
    reports = dd.root / "certifications"
    reports.mkdir(parents=True, exist_ok=True)
    stem = f"{record.model_name}-{sha[:12]}"
    data = report_json(cert, record, soaked)
    (reports / f"{stem}.json").write_text(json.dumps(data, indent=2) + "\n")
    text = report_markdown(cert, record, soaked)
    (reports / f"{stem}.md").write_text(text)
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        print(text)
        print(f"report   {reports / stem}.md (and .json)")
        print(f"record   {record_path} (signed by {identity.peer_id})")
    return 0
