"""The certification report of a run: `report.md`, `report.json`, `requests.jsonl` and PNG
plots, in the run's folder.

`report.json` holds every figure of `report.md` (and the timeline, the agents' warnings and
errors, and the emulator's counters); `requests.jsonl` holds one record per request, with the
arrival time of every streamed chunk.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from netsim import metrics

REPORTS = Path(__file__).resolve().parent.parent / "reports"


def run_dir(scenario: str, label: str, base: Path = REPORTS) -> Path:
    """A new folder `<scenario>-<label>-<UTC time>` under `base`."""
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    path = base / f"{scenario}-{label}-{stamp}"
    path.mkdir(parents=True, exist_ok=False)
    return path


def git_revision(repo: Path) -> str:
    def git(*args: str) -> str:
        r = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True)
        return r.stdout.strip()

    rev = git("rev-parse", "--short=12", "HEAD") or "unknown"
    return rev + ("+changes" if git("status", "--porcelain", "--untracked-files=no") else "")


# ----- formatting -----


def _f(x: Any, digits: int = 1, unit: str = "") -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        return f"{x:.{digits}f}{unit}"
    return f"{x}{unit}"


def _spread(s: Mapping[str, Any] | None, digits: int = 1) -> str:
    if not s:
        return "-"
    return (
        f"{s['median']:.{digits}f} (p10 {s['p10']:.{digits}f}, p90 {s['p90']:.{digits}f}, "
        f"max {s['max']:.{digits}f}; n={s['n']})"
    )


def _table(head: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        out.append("| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |")
    return out


def _short(detail: Any, n: int = 160) -> str:
    text = detail if isinstance(detail, str) else json.dumps(detail, default=str)
    text = text.replace("\n", " ")
    return text if len(text) <= n else text[: n - 3] + "..."


def _link_rows(links: Mapping[str, Any]) -> list[list[Any]]:
    rows = []
    for key, spec in sorted(links.items()):
        rate = spec.get("rate_bps")
        rows.append(
            [
                key,
                _f(spec["delay_s"] * 1000, 2, " ms"),
                _f(spec.get("jitter_s", 0) * 1000, 2, " ms"),
                _f(spec.get("loss", 0) * 100, 2, " %"),
                "unlimited" if not rate else f"{rate / 1e6:g} Mbit/s",
            ]
        )
    return rows


def _links_md(links: Mapping[str, Any]) -> list[str]:
    """Links grouped by identical spec, so a regime reads in a line or two."""
    groups: dict[str, list[str]] = {}
    specs: dict[str, Any] = {}
    for key, spec in links.items():
        sig = json.dumps(spec, sort_keys=True)
        groups.setdefault(sig, []).append(key)
        specs[sig] = spec
    rows = []
    for sig, keys in groups.items():
        row = _link_rows({"x": specs[sig]})[0]
        row[0] = ", ".join(sorted(keys))
        rows.append(row)
    return _table(["directed links", "one-way delay", "jitter (±)", "loss", "rate"], rows)


def _errors_md(section: Mapping[str, Any]) -> list[str]:
    return [
        "#### Failed requests",
        "",
        *_failures_md(section.get("failures") or []),
        "",
        "#### Warnings and errors in the agents' and relay's logs",
        "",
        *_log_events_md(section.get("log_events") or []),
    ]


def _failures_md(fails: Sequence[Mapping[str, Any]], limit: int = 60) -> list[str]:
    if not fails:
        return ["None: every request completed."]
    note = []
    if len(fails) > limit:
        note = [f"The first {limit} of {len(fails)}; all are in report.json (`failures`).", ""]
        fails = fails[:limit]
    return note + _table(
        ["#", "t (s)", "kind", "after (s)", "tokens received", "cause", "what the client saw"],
        (
            [
                f["i"],
                _f(f["t"], 2),
                f"{f['shape']}/{'stream' if f['stream'] else 'whole'}",
                _f(f["after_s"], 2),
                f["tokens_received"],
                f["cause"],
                _short(f["error"], 200),
            ]
            for f in fails
        ),
    )


def _log_events_md(events: Sequence[Mapping[str, Any]]) -> list[str]:
    """Grouped by host, level and event, in order of first appearance (all of them are in
    report.json)."""
    if not events:
        return ["None."]
    groups: dict[tuple[str, str, str], list[Mapping[str, Any]]] = {}
    for e in events:
        groups.setdefault((e["host"], e["level"], e["event"][:80]), []).append(e)
    rows = []
    for (host, level, event), es in sorted(groups.items(), key=lambda kv: kv[1][0]["t"] or 0):
        first = es[0]
        rows.append(
            [host, level, event, len(es), _f(first["t"], 2), _short(first.get("detail", ""), 220)]
        )
    return _table(["host", "level", "event", "count", "first at (s)", "first one's detail"], rows)


def _timeline_md(
    events: Sequence[Mapping[str, Any]], keep: Iterable[str] | None = None
) -> list[str]:
    rows = []
    for e in events:
        if keep is not None and not any(e["what"].startswith(k) for k in keep):
            continue
        detail = {k: v for k, v in e.items() if k not in ("t", "what")}
        rows.append([_f(e["t"], 2), e["what"], _short(detail, 200)])
    return _table(["t (s)", "event", "detail"], rows)


# ----- split serving -----


def _split_summary_rows(regimes: Mapping[str, Any]) -> list[list[Any]]:
    rows = []
    for name, r in regimes.items():
        t = r.get("totals", {})
        soak = r.get("soak") or {}
        iso = r.get("isolation") or {}
        vs = iso.get("median_vs_floor") or {}
        mean = (iso.get("mean_vs_floor") or {}).get("measured_ms")
        d = r.get("discovery") or {}
        rows.append(
            [
                name,
                f"{t.get('ok', '-')} / {t.get('failed', '-')}",
                f"{t.get('streams_complete', '-')} of {t.get('streams', '-')}",
                _spread(soak.get("tokens_per_s")),
                f"{_f(vs.get('measured_ms'))} (mean {_f(mean)}) vs {_f(vs.get('floor_ms'))} ms: "
                f"{_f(vs.get('ratio'), 3)}x, goal {'met' if vs.get('goal_met') else 'not met'}",
                _f((soak.get("ttft_ms") or {}).get("median"), 0, " ms"),
                f"{_f(d.get('membership_after_last_start_s'))} / "
                f"{_f(d.get('routable_after_last_start_s'))} s",
            ]
        )
    return rows


def _speculation_md(spec: Mapping[str, Any] | None, floor_ms: float | None) -> list[str]:
    if not spec:
        return []
    out = [
        "",
        "### Speculation: drafts off and auto, one request at a time",
        "",
        "Greedy, streamed; decode tokens/s from the first streamed chunk to the last, median "
        "of the requests. Goals (issue 16): copy-shaped >= 3.0x, novel prose >= 0.95x."
        + (
            f" One token per trip around the ring (the floor, {floor_ms:.1f} ms) caps decoding "
            f"without drafts at {1000 / floor_ms:.1f} tok/s."
            if floor_ms
            else ""
        )
        + (
            " With a draft model: p is the chance that its next drafted token is right given "
            "those before it were; the ceiling is the gain such drafts allow at the window "
            "costs the entry measured, one window at a time, each drafted token's forward "
            "pass paid (with the draft length that gives it). Where it sent no window, p is "
            'the entry\'s record of the proposals "auto" did not send (unsent), and a '
            "ceiling of 1.00x means no draft of that p pays at those costs."
            if any(m.get("ceiling") for m in spec.values())
            else ""
        ),
        "",
    ]
    out += _table(
        ["workload", "off tok/s", "auto tok/s", "auto / off", "windows", "accepted / drafted",
         "draft model: windows, accepted / drafted", "its p", "ceiling p allows (drafts)",
         "peak windows in flight", "same text", "ok"],
        (
            [
                mix,
                _f(m["tok_s_off"], 1),
                _f(m["tok_s_auto"], 1),
                _f(m["ratio"], 2, "x"),
                m["windows"],
                f"{m['accepted']} / {m['drafted']}",
                f"{m.get('model_windows', 0)}, {m.get('model_accepted', 0)} / "
                f"{m.get('model_drafted', 0)}",
                _f(m.get("model_p"), 2) + (" (unsent)" if m.get("model_p_unsent") else ""),
                _ceiling(m.get("ceiling")),
                m.get("peak_in_flight", 0),
                m["same_text"],
                f"{m['ok']}/{m['requests']}",
            ]
            for mix, m in spec.items()
        ),
    )  # fmt: skip
    return out


def _ceiling(c: Mapping[str, Any] | None) -> str:
    if not c:
        return "-"
    return f"{c['ceiling']:.2f}x ({c['at_draft_tokens']})"


def _split_md(name: str, r: Mapping[str, Any]) -> list[str]:
    out = [f"## Regime `{name}`", "", "### Network", ""]
    m = r.get("machine", {})
    out += _links_md(r.get("links", {}))
    out += [
        "",
        f"TCP congestion control in the hosts: **{m.get('congestion_control')}**. "
        f"Machine: {m.get('cpus')} CPUs shared by everything (agents, relay, emulator, driver), "
        f"kernel {m.get('kernel')}, Python {m.get('python')}, load average at start "
        f"{m.get('load_average')}.",
        "",
        "### Mesh: discovery and convergence",
        "",
    ]
    d = r.get("discovery") or {}
    out += _table(
        ["step", "seconds since the run began"],
        [
            ["first agent ready (it created the mesh)", _f(d.get("first_agent_ready_s"), 2)],
            ["last agent started (with the invite)", _f(d.get("last_agent_started_s"), 2)],
            ["all agents ready", _f(d.get("all_agents_ready_s"), 2)],
            [
                "every agent sees all 3 alive (membership)",
                f"{_f(d.get('membership_s'), 2)} "
                f"({_f(d.get('membership_after_last_start_s'), 2)} after the last start, "
                f"{_f(d.get('membership_after_all_ready_s'), 2)} after all were ready)",
            ],
            [
                "every agent holds the same routable 3-stage plan (convergence)",
                f"{_f(d.get('routable_s'), 2)} "
                f"({_f(d.get('routable_after_last_start_s'), 2)} after the last start)",
            ],
        ],
    )
    plan = r.get("plan")
    if plan:
        stages = ", ".join(f"{h} layers {a}-{b}" for h, a, b in plan["stages"])
        out += [
            "",
            f"Plan (epoch {plan['epoch']}): entry **{plan['entry']}**; {stages}; "
            f"activations as {plan.get('wire_dtype')}; the planner's own estimate "
            f"{plan.get('est_token_ms')} ms per token.",
            "",
        ]
        out += _table(
            ["ring leg", "path", "configured one-way delay", "rate"],
            (
                [
                    f"{h['src']} → {h['dst']}",
                    h["path"],
                    _f(h["delay_ms"], 2, " ms"),
                    f"{h['rate_bps'] / 1e6:g} Mbit/s" if h["rate_bps"] else "-",
                ]
                for h in r.get("ring", [])
            ),
        )
    iso = r.get("isolation") or {}
    out += _speculation_md(r.get("speculation"), (iso.get("floor") or {}).get("floor_ms"))
    out += ["", "### Per-token latency against its floor", ""]
    floor = iso.get("floor")
    if floor:
        compute = iso["stage_compute_ms"]
        vs, mean_vs = iso["median_vs_floor"], iso["mean_vs_floor"]
        b = iso["breakdown"]
        out += [
            f"Measured on {iso['ok']} of {iso['requests']} streamed requests run one at a time "
            f"(greedy, {r['settings']['decode_tokens']} tokens each), at the entry's API.",
            "",
            "The floor is the stages' compute per token plus one trip around the ring. Compute "
            "comes from the split's receipts (`usage.meshagent.stage_ms`: each stage's own "
            "time, no network in it) of the same requests run one at a time: per stage, "
            f"(stage_ms of a {r['settings']['decode_tokens']}-token request − stage_ms of a "
            "1-token request with the same prompt) / (tokens − 1). The trip is the sum of "
            "the configured one-way delays of the ring's legs.",
            "",
        ]
        out += _table(
            ["", "ms per token"],
            [
                ["compute, per stage", " + ".join(f"{c:.2f}" for c in compute)],
                ["compute, all stages", _f(floor["compute_ms"], 2)],
                ["one trip around the ring", _f(floor["ring_ms"], 2)],
                ["**floor**", f"**{floor['floor_ms']:.2f}**"],
                ["measured, median gap between tokens", f"**{vs['measured_ms']:.2f}**"],
                ["measured, median of each request's mean", _f(mean_vs["measured_ms"], 2)],
                ["ratio (median / floor)", _f(vs["ratio"], 3)],
                ["gap (median − floor)", _f(vs["gap_ms"], 2)],
                ["goal: 1.10 × floor + 2 ms", _f(vs["goal_ms"], 2)],
                ["goal met (median)", "yes" if vs["goal_met"] else "**no**"],
                ["goal met (mean)", "yes" if mean_vs["goal_met"] else "**no**"],
            ],
        )
        out += [
            "",
            "Where the median goes:",
            "",
        ]
        out += _table(
            ["part", "ms per token", "how it is known"],
            [
                ["stage compute", _f(b["compute_ms"], 2), "receipts"],
                ["propagation", _f(b["propagation_ms"], 2), "configured delays"],
                [
                    "serialisation at the link rate",
                    _f(b["serialisation_ms"], 3),
                    "bytes per token on each leg (emulator counters) / rate",
                ],
                [
                    "emulator lateness",
                    _f(b["emulator_late_ms"], 3),
                    "mean lateness per delivered packet × legs",
                ],
                [
                    "the rest: software hand-offs",
                    _f(b["software_ms"], 2),
                    "measured − all of the above: framing, encryption, event loops and "
                    "threads in three agents, the HTTP stream; 2 shared cores",
                ],
            ],
        )
        st = iso["stalls"]
        out += [
            "",
            f"Spread of the gaps: {_spread(iso['per_token_ms'], 2)} ms. "
            f"{st['gaps_over']} gaps exceeded floor + 10 ms (worst {st['worst_ms']:.1f} ms); "
            f"the emulator dropped {st['loss_drops_in_window']} packets to random loss in "
            "that window (a lost packet stalls the stream until TCP retransmits it). "
            f"Time to first token (one at a time): {_spread(iso['ttft_ms'], 0)} ms.",
            "",
            f"![per-token latency](per_token_{name}.png)",
        ]
    else:
        out.append("Not measured: the calibration requests did not complete (see errors).")
    soak = r.get("soak") or {}
    s = r.get("settings", {})
    out += [
        "",
        f"### Soak: {soak.get('requests', 0)} requests, {s.get('concurrency')} at a time",
        "",
        f"Requests ok / failed: **{soak.get('ok')} / {soak.get('failed')}**; streamed "
        f"responses complete (finish_reason and `[DONE]`): **{soak.get('streams_complete')} "
        f"of {soak.get('streams')}**. {soak.get('completion_tokens')} completion tokens in "
        f"{_f(soak.get('seconds'))} s: {_f(soak.get('throughput_tok_s'))} tokens/s through the "
        "mesh.",
        "",
    ]
    out += _table(
        ["kind", "requests", "ok", "tokens/s per request", "TTFT ms (streams)"],
        (
            [
                kind,
                k["requests"],
                k["ok"],
                _spread(k["tokens_per_s"]),
                _spread(k["ttft_ms"], 0),
            ]
            for kind, k in (soak.get("by_kind") or {}).items()
        ),
    )
    out += [
        "",
        "Tokens/s per request counts completion tokens over the request's whole time (time "
        "to first token included). Per-token gaps under load: "
        f"{_spread(soak.get('per_token_ms'), 1)} ms.",
        "",
        "#### Bytes on the wire per token",
        "",
        "Every directed link that carried traffic during the soak: whole IP packets as the "
        "emulator forwarded them, per completion token (prefill activations included); "
        "`net` subtracts the link's background rate (gossip, heartbeats, RTT probes) "
        f"measured over {s.get('idle_s')} s of silence before the load. Each token computed "
        "(prompt or completion) crosses each activation leg once, as "
        f"{r.get('plan', {}).get('wire_dtype')} hidden states; the last leg carries sampled "
        "tokens back to the entry.",
        "",
    ]
    out += _table(
        [
            "link",
            "bytes",
            "packets",
            "bytes/token",
            "background B/s",
            "net bytes/token",
            "net bytes per prompt + completion token",
            "dropped",
        ],
        (
            [
                k,
                w["bytes"],
                w["packets"],
                _f(w["bytes_per_token"]),
                _f(w.get("idle_bytes_per_s")),
                _f(w.get("net_bytes_per_token")),
                _f(w.get("net_bytes_per_processed_token")),
                _short(w["dropped"]) if w["dropped"] else "-",
            ]
            for k, w in sorted((soak.get("wire") or {}).items())
        ),
    )
    fw = r.get("forwarded")
    if fw:
        out += [
            "",
            "### Requests to the other agents",
            "",
            f"{fw['requests']} streamed requests sent to the agents that are not the entry "
            f"(carried to the entry over the overlay): {fw['ok']} ok, {fw['failed']} failed; "
            f"TTFT {_spread(fw['ttft_ms'], 0)} ms, per-token {_spread(fw['per_token_ms'], 1)} ms.",
        ]
    out += ["", "### Errors", ""]
    out += _errors_md(r)
    out += ["", "### Emulator", ""]
    out += _emulator_md(r.get("emulator"))
    return out


def _emulator_md(e: Mapping[str, Any] | None) -> list[str]:
    if not e:
        return ["-"]
    drops: dict[str, int] = {}
    for c in e["links"].values():
        for k, v in c["dropped"].items():
            drops[k] = drops.get(k, 0) + v
    return [
        f"{e['delivered']} packets delivered over {_f(e['seconds'])} s, written on average "
        f"{_f(e['late_mean_ms'], 3)} ms behind their due time (worst "
        f"{_f(e['late_max_ms_since_start'], 2)} ms); dropped by reason: "
        f"{_short(drops) if drops else 'none'}; write errors {e['write_errors']}.",
    ]


def _plot_per_token(path: Path, r: Mapping[str, Any]) -> None:
    iso = r.get("isolation") or {}
    gaps = iso.get("gaps_ms") or []
    soak_gaps = [
        (b - a) * 1000
        for rec in r.get("requests", [])
        if rec.get("phase") == "soak" and rec["ok"]
        for a, b in zip(rec["chunks"], rec["chunks"][1:], strict=False)
    ]
    if not gaps:
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    floor = iso.get("floor", {}).get("floor_ms")
    goal = (iso.get("median_vs_floor") or {}).get("goal_ms")
    hi = max(60.0, (floor or 0) * 1.6)
    clipped = [min(g, hi) for g in gaps]
    ax1.hist(clipped, bins=60, color="tab:blue", alpha=0.8, label="one at a time")
    if soak_gaps:
        ax1.hist(
            [min(g, hi) for g in soak_gaps], bins=60, color="tab:orange", alpha=0.5, label="soak"
        )
    for x, label, style in ((floor, "floor", "k-"), (goal, "goal", "r--")):
        if x:
            ax1.axvline(x, color=style[0], linestyle=style[1:], label=f"{label} {x:.1f} ms")
            ax2.axvline(x, color=style[0], linestyle=style[1:], label=f"{label} {x:.1f} ms")
    ax1.set_xlabel(f"time between tokens, ms (clipped at {hi:.0f})")
    ax1.set_ylabel("gaps")
    ax1.legend()
    for values, label in ((gaps, "one at a time"), (soak_gaps, "soak")):
        if values:
            v = sorted(values)
            ax2.plot(v, [(i + 1) / len(v) for i in range(len(v))], label=label)
    ax2.set_xscale("log")
    ax2.set_xlabel("time between tokens, ms (log)")
    ax2.set_ylabel("fraction of gaps ≤ x")
    ax2.legend()
    fig.suptitle(f"{r['regime']}: per-token latency against its floor")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _plot_boxes(path: Path, regimes: Mapping[str, Any], what: str, title: str, unit: str) -> None:
    data, labels = [], []
    for name, r in regimes.items():
        values = []
        for rec in r.get("requests", []):
            if rec.get("phase") != "soak" or not rec["ok"]:
                continue
            if what == "tokens_per_s" and rec.get("completion_tokens") and rec.get("t_end"):
                values.append(rec["completion_tokens"] / rec["t_end"])
            elif what == "ttft" and rec["stream"] and rec.get("t_first") is not None:
                values.append(rec["t_first"] * 1000)
        if values:
            data.append(values)
            labels.append(name)
    if not data:
        return
    fig, ax = plt.subplots(figsize=(max(4, 2 * len(data) + 2), 4))
    ax.boxplot(data, showfliers=True)
    ax.set_xticks(range(1, len(labels) + 1), labels)
    ax.set_ylabel(unit)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def split_report(out: Path, report: dict[str, Any]) -> None:
    regimes = report["regimes"]
    _write_data(out, report, (r.get("requests", []) for r in regimes.values()))
    md = _opening(out, report, f"{report['scenario']} ({', '.join(regimes)})")
    md += _table(
        [
            "regime",
            "requests ok / failed",
            "streams complete",
            "soak tokens/s per request, median (spread)",
            "per-token ms, one at a time: median gap (request mean) vs floor",
            "soak TTFT median",
            "membership / convergence",
        ],
        _split_summary_rows(regimes),
    )
    md += ["", "![tokens/s per regime](tokens_per_s.png) ![TTFT](ttft.png)", ""]
    md += _tested_md(report)
    for name, r in regimes.items():
        md += ["", *_split_md(name, r)]
        _plot_per_token(out / f"per_token_{name}.png", r)
    _plot_boxes(
        out / "tokens_per_s.png", regimes, "tokens_per_s", "soak: tokens/s per request", "tokens/s"
    )
    _plot_boxes(out / "ttft.png", regimes, "ttft", "soak: time to first token (streams)", "ms")
    (out / "report.md").write_text("\n".join(md) + "\n")


def _opening(out: Path, report: Mapping[str, Any], title: str) -> list[str]:
    """A report's title, which run it is and how it was made, and the Result heading."""
    return [
        f"# net-sim certification: {title}",
        "",
        f"Run `{out.name}`, {report['created']}, commit {report['git']}, command "
        f"`{report['command']}`.",
        "",
        "## Result",
        "",
    ]


def _tested_md(report: Mapping[str, Any]) -> list[str]:
    out = ["## What was tested", ""]
    out += [f"- {t}" for t in report.get("tested", [])]
    out += ["", "## What was not tested", ""]
    out += [f"- {t}" for t in report.get("not_tested", [])]
    return out


def _write_data(out: Path, report: Mapping[str, Any], requests: Iterable[Iterable[Any]]) -> None:
    """report.json and requests.jsonl first: a failure while drawing loses no measurement."""
    with open(out / "requests.jsonl", "w") as f:
        for recs in requests:
            for rec in recs:
                f.write(json.dumps(rec) + "\n")
    (out / "report.json").write_text(json.dumps(_strip(report), indent=1, default=str) + "\n")


def _strip(x: Any) -> Any:
    """The report without the raw request records (they are in requests.jsonl)."""
    if isinstance(x, dict):
        return {k: _strip(v) for k, v in x.items() if not (k == "requests" and isinstance(v, list))}
    if isinstance(x, list):
        return [_strip(v) for v in x]
    return x


# ----- faults -----


def _plot_faults(path: Path, f: Mapping[str, Any]) -> None:
    phases = f.get("phases") or {}
    if not phases:
        return
    fig, axes = plt.subplots(len(phases), 1, figsize=(11, 3.2 * len(phases)), squeeze=False)
    for ax, (name, ph) in zip(axes[:, 0], phases.items(), strict=False):
        recs = [r for r in f.get("requests", []) if r.get("phase") == name]
        for row, r in enumerate(recs):
            end = r["t0"] + (r["t_end"] or 0)
            color = "tab:green" if r["ok"] else "tab:red"
            ax.plot([r["t0"], end], [row, row], color=color, lw=2)
            if not r["ok"]:
                ax.plot([end], [row], "x", color=color, ms=4)
            ticks = [r["t0"] + c for c in r["chunks"]]
            ax.plot(ticks, [row] * len(ticks), "|", color="k", ms=3, alpha=0.4)
        lo = min((r["t0"] for r in recs), default=0)
        hi = max((r["t0"] + (r["t_end"] or 0) for r in recs), default=1)
        for e in ph.get("timeline", []):
            if not lo <= e["t"] <= hi:
                continue
            label, color = None, None
            if e["what"].startswith("fault."):
                label, color = e["what"][6:], "r"
            elif e["what"] == "routable":
                label, color = "routable", "tab:blue"
            if label:
                ax.axvline(e["t"], color=color, ls="--")
                ax.text(e["t"], len(recs), label, color=color, fontsize=8, rotation=90, va="top")
        ax.set_title(f"{name}: {ph.get('fault')}", fontsize=10)
        ax.set_ylabel("request")
        ax.set_xlabel(
            "seconds since the phase began (green ok, red failed, x where it failed; ticks: tokens)"
        )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _stall(ph: Mapping[str, Any]) -> str:
    st = ph.get("token_stall")
    if not st:
        return "-"
    if st["resumed_after_fault_s"] is None:
        last = st["last_token_after_fault_s"]
        stopped = "at the fault" if last is None else f"{last:.2f} s after the fault"
        return f"**stopped {stopped}, never resumed** (watched {st['observed_s']:.0f} s)"
    return (
        f"{st['longest_gap_s']:.2f} s without a token, flowing again "
        f"{st['resumed_after_fault_s']:.2f} s after the fault"
    )


def _resumed(ph: Mapping[str, Any]) -> str:
    first_ok = ph.get("first_ok_request")
    if first_ok:
        return f"{first_ok['done_after_fault_s']:.2f} s"
    last = max((e["t"] for e in ph.get("timeline", [])), default=ph["fault_t"])
    return f"**never** (watched {last - ph['fault_t']:.0f} s)"


def faults_report(out: Path, report: dict[str, Any]) -> None:
    f = report["faults"]
    _write_data(out, report, [f.get("requests", [])])
    t = f.get("totals", {})
    phases = f.get("phases") or {}
    md = [
        *_opening(out, report, f"faults ({f['regime']})"),
        f"Each fault ran in a mesh of its own, started from nothing: {len(phases)} meshes, "
        f"{t.get('requests')} streamed requests in all, {f['settings']['concurrency']} at a "
        f"time at the entry agent's API (ok / failed: {t.get('ok')} / {t.get('failed')}). A "
        f"worker pauses {f['settings'].get('fail_pause_s', 0.5):g} s after a failed request "
        "before its next.",
        "",
    ]
    rows = []
    for name, ph in phases.items():
        rs = ph.get("restart") or {}
        fates = ph.get("in_flight") or []
        causes = sorted({x["cause"] or "ok" for x in fates})
        rows.append(
            [
                name,
                ph.get("fault"),
                f"{ph['in_flight_ok']} ok, {ph['in_flight_failed']} failed ({', '.join(causes)})",
                _f(max((x["ended_after_fault_s"] for x in fates), default=None), 2, " s"),
                f"{ph['sent_after_failed']} of {ph['sent_after']}",
                _stall(ph),
                _f(rs.get("routable_s"), 2, " s")
                if rs
                else ("**did not recover**" if ph.get("recovery_error") else "-"),
                _resumed(ph),
            ]
        )
    md += _table(
        [
            "phase",
            "fault",
            "requests in flight at the fault",
            "last in-flight ended after",
            "later requests failed",
            "tokens (any client)",
            "restart → routable plan",
            "first later request completed, after the fault",
        ],
        rows,
    )
    md += ["", "![faults](faults.png)", ""]
    md += _tested_md(report)
    first = next(iter(phases.values()), {})
    md += ["", "## Network", ""]
    md += _links_md(first.get("links", {}))
    m = first.get("machine", {})
    md += ["", f"TCP congestion control: **{m.get('congestion_control')}**.", ""]
    for name, ph in phases.items():
        plan = ph.get("plan") or {}
        md += [f"## Phase `{name}`: {ph.get('fault')}", ""]
        md += [
            f"Plan: entry **{plan.get('entry')}**, stages {plan.get('stages')}; membership "
            f"{_f((ph.get('discovery') or {}).get('membership_s'), 2)} s and a routable plan "
            f"{_f((ph.get('discovery') or {}).get('routable_s'), 2)} s after the phase began. "
            f"Fault at t = {ph['fault_t']:.2f} s.",
            "",
        ]
        if ph.get("restart"):
            rs = ph["restart"]
            md += [
                f"Restarted (same data dir, same command line) at t = {ph['restart_t']:.2f} s: "
                f"ready after {rs['agent_ready_s']:.2f} s, membership after "
                f"{rs['membership_s']:.2f} s, routable 3-stage plan after "
                f"{rs['routable_s']:.2f} s ({rs['stages']}).",
                "",
            ]
        if ph.get("recovery_error"):
            md += [
                f"Restarted (same data dir, same command line) at t = {ph['restart_t']:.2f} s; "
                f"the mesh did not recover: {_short(ph['recovery_error'], 400)}",
                "",
            ]
        if ph.get("healed_t") is not None:
            md += [f"Healed at t = {ph['healed_t']:.2f} s.", ""]
        md += ["Requests in flight at the fault:", ""]
        md += _table(
            [
                "#",
                "ok",
                "tokens before / after the fault",
                "ended after the fault",
                "cause",
                "what the client saw",
            ],
            (
                [
                    x["i"],
                    _f(x["ok"]),
                    f"{x['tokens_before_fault']} / {x['tokens_after_fault']}",
                    _f(x["ended_after_fault_s"], 2, " s"),
                    x["cause"] or "-",
                    _short(x["error"] or "-", 200),
                ]
                for x in ph.get("in_flight") or []
            ),
        )
        first_ok = ph.get("first_ok_request")
        md += [
            "",
            f"Requests sent after the fault: {ph['sent_after']}, failed "
            f"{ph['sent_after_failed']} "
            f"{_short(ph['sent_after_causes']) if ph['sent_after_causes'] else ''}. Tokens "
            f"(any client): {_stall(ph)}. First request sent after "
            + ("the restart" if ph.get("restart") else "the heal" if ph.get("healed_t") else "it")
            + " that completed: "
            + (
                f"#{first_ok['i']}, sent {first_ok['sent_after_fault_s']:.2f} s and done "
                f"{first_ok['done_after_fault_s']:.2f} s after the fault."
                if first_ok
                else "none."
            ),
            "",
            "Distinct errors of the requests sent after the fault:",
            "",
        ]
        later = {}
        for r in f.get("requests", []):
            if r.get("phase") == name and not r["ok"] and r["t0"] >= ph["fault_t"]:
                key = _short(r["error"] or "incomplete", 240)
                later.setdefault(key, []).append(r["t0"] - ph["fault_t"])
        md += _table(
            ["count", "first / last sent after the fault", "error"],
            (
                [len(ts), f"{min(ts):.2f} / {max(ts):.2f} s", err]
                for err, ts in sorted(later.items(), key=lambda kv: min(kv[1]))
            ),
        )
        md += [
            "",
            "What the agents reported (placement as each agent's API showed it, polled every "
            "0.5 s; membership and readiness of a restarted agent):",
            "",
        ]
        md += _timeline_md(
            [e for e in ph.get("timeline", []) if e["t"] >= ph["fault_t"] - 1],
            keep=("fault.", "placement", "routable", "membership", "agent.", "recovery."),
        )
        md += ["", "Warnings and errors in the agents' and relay's logs:", ""]
        md += _log_events_md(ph.get("log_events") or [])
        md += ["", "Emulator: " + _emulator_md(ph.get("emulator"))[0], ""]
    md += ["## Failed requests", ""]
    md += _failures_md(f.get("failures") or [])
    _plot_faults(out / "faults.png", f)
    (out / "report.md").write_text("\n".join(md) + "\n")


# ----- discovery -----


def _plot_discovery(path: Path, d: Mapping[str, Any]) -> None:
    parts = d.get("parts") or {}
    if not parts:
        return
    fig, ax = plt.subplots(figsize=(7, 3.5))
    names = list(parts)
    mem = [parts[n].get("times", {}).get("membership_after_last_start_s") or 0 for n in names]
    rt = [parts[n].get("times", {}).get("routable_after_last_start_s") or 0 for n in names]
    x = range(len(names))
    ax.bar([i - 0.2 for i in x], mem, width=0.4, label="full membership")
    ax.bar([i + 0.2 for i in x], rt, width=0.4, label="routable plan")
    ax.set_xticks(list(x), names)
    ax.set_ylabel("seconds after the last agent started")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def discovery_report(out: Path, report: dict[str, Any]) -> None:
    d = report["discovery"]
    _write_data(out, report, [d.get("requests", [])])
    md = _opening(out, report, "discovery")
    rows = []
    for name, p in (d.get("parts") or {}).items():
        t = p.get("times") or {}
        paths = sorted({v for view in (p.get("paths") or {}).values() for v in view.values()})
        serve = p.get("serve") or {}
        rows.append(
            [
                name,
                _f(t.get("all_agents_ready_s", 0) - t.get("last_agent_started_s", 0), 2, " s"),
                _f(t.get("membership_after_all_ready_s"), 2, " s"),
                _f(t.get("membership_after_last_start_s"), 2, " s"),
                _f(t.get("routable_after_last_start_s"), 2, " s"),
                ", ".join(paths) or "-",
                f"{serve.get('ok', '-')} / {serve.get('failed', '-')}",
                _f((serve.get("per_token_ms") or {}).get("median"), 1, " ms"),
            ]
        )
    md += _table(
        [
            "how agents met",
            "last start → all agents ready",
            "all ready → full membership",
            "full membership (after the last start)",
            "routable 3-stage plan",
            "paths",
            "requests ok / failed",
            "per-token median",
        ],
        rows,
    )
    md += ["", "![discovery](discovery.png)", ""]
    md += _tested_md(report)
    for name, p in (d.get("parts") or {}).items():
        md += ["", f"## `{name}`", ""]
        md += _links_md(p.get("links", {}))
        md += [
            "",
            "Per agent, full membership after the last start (s): "
            f"{_short(p.get('times', {}).get('per_agent_membership_s'))}.",
            "",
        ]
        md += [
            f"How each agent found the others (log events): {_short(p.get('found_by'), 400)}.",
            "",
        ]
        ring = [(h["src"], h["dst"], h["path"], h["delay_ms"]) for h in p.get("ring", [])]
        md += [
            f"Plan: {_short(p.get('plan'))}; ring (from, to, path, ms): {_short(ring, 300)}.",
            "",
        ]
        md += _timeline_md(p.get("timeline", []))
        md += ["", "### Warnings and errors in the agents' and relay's logs", ""]
        md += _log_events_md(p.get("log_events") or [])
    md += ["", "## Failed requests (all parts)", ""]
    md += _failures_md(d.get("failures") or [])
    _plot_discovery(out / "discovery.png", d)
    (out / "report.md").write_text("\n".join(md) + "\n")


# ----- churn -----


def churn_report(out: Path, report: dict[str, Any]) -> None:
    c = report["churn"]
    _write_data(out, report, [c.get("requests", [])])
    t = c.get("totals", {})
    g = c.get("greedy") or {}
    form = c.get("formation") or {}
    st = c["settings"]
    md = [
        *_opening(out, report, f"churn ({c['regime']})"),
        f"{t.get('requests')} requests, {st['concurrency']} at a time at {c.get('client')}'s "
        f"API, while a fault hit a stage host every {st['period_s']:g} s "
        f"({', '.join(st['kinds'])} in turn): **{t.get('ok')} ok, {t.get('failed')} failed**; "
        f"streams complete (finish_reason and `[DONE]`) {t.get('streams_complete')} of "
        f"{t.get('streams')}; {t.get('replayed')} requests replayed (their receipts say so).",
        "",
        f"Greedy outputs identical to their references (each prompt run alone on the "
        f"undisturbed mesh first): **{g.get('identical')} of {g.get('checked')}** "
        f"({g.get('replayed_checked')} of them replayed).",
        "",
        f"Formation: membership {_f(form.get('membership_after_last_start_s'), 2, ' s')} and "
        f"a routable plan {_f(form.get('routable_after_last_start_s'), 2, ' s')} after the "
        f"last agent started; first plan {form.get('stages')}.",
        "",
        "Per kind of fault (extra latency: for each fault, the worst stall of a streamed request "
        "in flight at it, from its last token before the fault to its first after, less that "
        "request's median gap between tokens):",
        "",
    ]
    faults = c.get("faults") or []
    # The client's agent is the entry the mesh formed with (and keeps, unless it moves).
    detect = metrics.churn_detection(faults, c.get("log_events") or [], c.get("client", ""))
    back = metrics.churn_back(faults, c.get("entry_events") or [])
    rows = []

    def of_kind(kind: str, values: list[float | None]) -> dict[str, Any]:
        mine = [v for f, v in zip(faults, values, strict=True) if f["kind"] == kind]
        return metrics.spread(v for v in mine if v is not None) or {}

    for kind, k in (c.get("by_kind") or {}).items():
        ex = k.get("extra_s") or {}
        seen, up = of_kind(kind, detect), of_kind(kind, back)
        rows.append(
            [
                kind,
                f"{k['faults'] - k['skipped']} (+{k['skipped']} skipped)",
                k["in_flight"],
                k["in_flight_failed"],
                f"{_f(seen.get('median'), 2, ' s')} / {_f(seen.get('max'), 2, ' s')}"
                f" ({seen.get('n', 0)})",
                f"{_f(up.get('median'), 2, ' s')} / {_f(up.get('p90'), 2, ' s')} / "
                f"{_f(up.get('max'), 2, ' s')}",
                _f(ex.get("median"), 2, " s"),
                _f(ex.get("max"), 2, " s"),
            ]
        )
    md += _table(
        [
            "fault",
            "injected",
            "requests in flight",
            "of them failed",
            "entry's chain broke after, median / worst (faults)",
            "a chain serves again after, median / p90 / worst",
            "extra latency, median",
            "worst",
        ],
        rows,
    )
    rt = metrics.replay_times(c.get("requests") or [])
    wait, replay = rt["wait_s"] or {}, rt["replay_s"] or {}
    md += [
        "",
        f"Replays, from the receipts ({rt['replays']} in all): waiting for a chain that serves "
        f"{_f(wait.get('median'), 2, ' s')} median (p90 {_f(wait.get('p90'), 2, ' s')}, worst "
        f"{_f(wait.get('max'), 2, ' s')}); the replay itself (prefilling the prompt and the "
        f"tokens so far again) {_f(replay.get('median'), 2, ' s')} median (worst "
        f"{_f(replay.get('max'), 2, ' s')}).",
    ]
    md += ["", "## Every fault", ""]
    md += _table(
        ["t (s)", "kind", "host", "in flight", "failed", "stalls (s)", "stopped host exited"],
        [
            [
                f["t"],
                f["kind"] + (" (skipped: no candidate)" if f.get("skipped") else ""),
                f.get("host", "-") + (f" / {f['with']}" if f.get("with") else ""),
                f["in_flight"],
                f["in_flight_failed"],
                ", ".join(f"{x:.2f}" for x in f["stalls_s"]) or "-",
                (
                    f"code {f['exit_code']} after {f['exit_s']} s"
                    if "exit_code" in f
                    else f.get("exit", "-")
                ),
            ]
            for f in c.get("faults") or []
        ],
    )
    if g.get("mismatches"):
        md += ["", "## Greedy outputs that differ from their reference", ""]
        md += _table(
            ["request", "shape", "prompt", "replayed", "first difference at char"],
            [
                [m["i"], m["shape"], m["prompt_no"], m["replayed"], m["first_difference_at_char"]]
                for m in g["mismatches"]
            ],
        )
    md += ["", *_tested_md(report), "", "## Network", ""]
    md += _links_md(c.get("links", {}))
    md += ["", "## Failed requests", ""]
    md += _failures_md(c.get("failures") or [])
    md += ["", "## Warnings and errors in the agents' and relay's logs", ""]
    md += _log_events_md(c.get("log_events") or [])
    md += ["", "## Timeline", ""]
    md += _timeline_md(c.get("timeline", []))
    (out / "report.md").write_text("\n".join(md) + "\n")


# ----- writing, and writing again -----

WRITERS = {
    "split": split_report,
    "soak": split_report,
    "faults": faults_report,
    "discovery": discovery_report,
    "churn": churn_report,
}


def write(out: Path, report: dict[str, Any]) -> None:
    WRITERS[report["scenario"]](out, report)


def load(out: Path) -> dict[str, Any]:
    """A written report with its request records put back where the writers want them."""
    rep = json.loads((out / "report.json").read_text())
    recs = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    if rep["scenario"] in ("split", "soak"):
        for name, r in rep["regimes"].items():
            r["requests"] = [x for x in recs if x.get("regime") == name]
    elif rep["scenario"] == "faults":
        rep["faults"]["requests"] = recs
    elif rep["scenario"] == "churn":
        rep["churn"]["requests"] = recs
    else:
        rep["discovery"]["requests"] = recs
    return rep


# ----- kept prefixes -----


def prefix_report(out: Path, report: dict[str, Any]) -> None:
    regimes = report["regimes"]
    _write_data(out, report, (r.get("requests", []) for r in regimes.values()))
    md = _opening(out, report, f"kept prefixes ({', '.join(regimes)})")
    for name, r in regimes.items():
        p = r.get("prefix") or {}
        t = r.get("totals", {})
        stages = ", ".join(f"{h}:{a}-{b}" for h, a, b in (r.get("plan") or {}).get("stages", []))
        cache = r.get("prefix_cache") or {}
        budget = cache.get("budget_bytes")
        kept = (
            f"the entry's prefix budget {budget / 1e6:.1f} MB ({cache.get('reason')})"
            if budget is not None
            else "the entry's prefix budget unknown"
        )
        md += [
            f"### `{name}`: second turn / cold first turn, median {p.get('median_ratio')} "
            f"(goal {p.get('goal')}: {'met' if p.get('goal_met') else 'NOT met'})",
            "",
            f"Requests {t.get('ok')} ok / {t.get('failed')} failed; stages {stages}; {kept}.",
            "",
        ]
        md += _table(
            [
                "conversation",
                "prompt tokens (1st, 2nd)",
                "cached tokens (1st, 2nd)",
                "TTFT ms (1st, 2nd)",
                "2nd / 1st",
                "ok",
            ],
            (
                [
                    c["conversation"],
                    "{}, {}".format(*c["prompt_tokens"]),
                    "{}, {}".format(*c["cached_tokens"]),
                    "{}, {}".format(*c["ttft_ms"]),
                    c["ratio"],
                    "yes" if c["ok"] else "NO",
                ]
                for c in p.get("conversations", [])
            ),
        )
        md += ["", *_links_md(r.get("links", {})), *_failures_md(r.get("failures", []))]
    md += ["", *_tested_md(report)]
    (out / "report.md").write_text("\n".join(md) + "\n")
