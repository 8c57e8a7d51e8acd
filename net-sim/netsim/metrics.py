"""Figures from a run's records, without I/O: spreads, per-token latency against its floor,
bytes on the wire per token, and what requests saw around a fault.

Request records are the load driver's (`netsim/workload.py`) with `t0` added: the send time in
seconds since the run began. Times inside a record (`t_first`, `t_end`, `chunks`) are seconds
since its own send.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

GOAL_RATIO = 1.10  # per-token latency goal: at most 1.10 x floor + 2 ms
GOAL_SLACK_MS = 2.0


def _q(ordered: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile of sorted values."""
    if len(ordered) == 1:
        return ordered[0]
    pos = q * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def spread(values: Iterable[float], digits: int = 3) -> dict[str, float] | None:
    """n, median, mean, p10, p90, p99, min and max of `values`; None if there are none."""
    v = sorted(float(x) for x in values)
    if not v:
        return None
    out = {
        "n": len(v),
        "median": statistics.median(v),
        "mean": statistics.fmean(v),
        "p10": _q(v, 0.10),
        "p90": _q(v, 0.90),
        "p99": _q(v, 0.99),
        "min": v[0],
        "max": v[-1],
    }
    return {k: (x if k == "n" else round(x, digits)) for k, x in out.items()}


# ----- one request -----


def gaps_ms(rec: Mapping[str, Any]) -> list[float]:
    """Times between consecutive streamed content chunks (each usually one token), in ms."""
    c = rec.get("chunks") or []
    return [(b - a) * 1000 for a, b in itertools.pairwise(c)]


def per_token_ms(rec: Mapping[str, Any]) -> float | None:
    """A stream's mean time per token after the first: (last chunk - first) / (tokens - 1)."""
    c = rec.get("chunks") or []
    n = rec.get("completion_tokens") or 0
    if not rec.get("stream") or len(c) < 2 or n < 2:
        return None
    return (c[-1] - c[0]) * 1000 / (n - 1)


def tokens_per_s(rec: Mapping[str, Any]) -> float | None:
    """Completion tokens over the request's whole time (its TTFT included)."""
    n = rec.get("completion_tokens") or 0
    if not rec.get("ok") or not n or not rec.get("t_end"):
        return None
    return n / rec["t_end"]


def ttft_ms(rec: Mapping[str, Any]) -> float | None:
    if not rec.get("stream") or rec.get("t_first") is None:
        return None
    return rec["t_first"] * 1000


# ----- a set of requests -----


def summarise(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Counts, completeness, speed and latency of a set of requests."""
    ok = [r for r in records if r["ok"]]
    streams = [r for r in records if r["stream"]]
    gaps = [g for r in ok for g in gaps_ms(r)]
    by_kind: dict[str, dict[str, Any]] = {}
    for r in records:
        kind = f"{r['shape']}/{'stream' if r['stream'] else 'whole'}"
        k = by_kind.setdefault(kind, {"requests": 0, "ok": 0, "tokens": 0})
        k["requests"] += 1
        k["ok"] += int(r["ok"])
        k["tokens"] += r.get("completion_tokens") or 0
    for kind, k in by_kind.items():
        rs = [r for r in ok if f"{r['shape']}/{'stream' if r['stream'] else 'whole'}" == kind]
        k["tokens_per_s"] = spread(t for r in rs if (t := tokens_per_s(r)) is not None)
        k["ttft_ms"] = spread(t for r in rs if (t := ttft_ms(r)) is not None)
    span = 0.0
    if records:
        span = max(r["t0"] + (r["t_end"] or 0) for r in records) - min(r["t0"] for r in records)
    tokens = sum(r.get("completion_tokens") or 0 for r in ok)
    return {
        "requests": len(records),
        "ok": len(ok),
        "failed": len(records) - len(ok),
        "streams": len(streams),
        "streams_complete": sum(1 for r in streams if r["complete"]),
        "streams_incomplete": [r["i"] for r in streams if not r["complete"]],
        "completion_tokens": tokens,
        "prompt_tokens": sum(r.get("prompt_tokens") or 0 for r in ok),
        "seconds": round(span, 3),
        "throughput_tok_s": round(tokens / span, 3) if span > 0 else None,
        "tokens_per_s": spread(t for r in ok if (t := tokens_per_s(r)) is not None),
        "ttft_ms": spread(t for r in ok if (t := ttft_ms(r)) is not None),
        "per_token_ms": spread(gaps),
        "per_token_request_mean_ms": spread(t for r in ok if (t := per_token_ms(r)) is not None),
        "by_kind": dict(sorted(by_kind.items())),
        "failures": failures(records),
    }


def failures(records: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Every failed request: when, what it was, what the client saw and its class."""
    return [
        {
            "i": r["i"],
            "t": round(r["t0"], 3),
            "shape": r["shape"],
            "stream": r["stream"],
            "after_s": round(r["t_end"] or 0, 3),
            "status": r["status"],
            "tokens_received": len(r.get("chunks") or []),
            "cause": r["cause"] or "incomplete",
            "error": r["error"] or "the response was not complete",
        }
        for r in records
        if not r["ok"]
    ]


# ----- the floor -----


def decode_compute_ms(
    prefill: Sequence[Mapping[str, Any]], decode: Sequence[Mapping[str, Any]]
) -> list[float] | None:
    """Each stage's compute per decoded token, from split receipts (`stage_ms`) of requests
    run one at a time with the same prompt: `prefill` stop after one token (the prompt's
    prefill only), `decode` run on for n tokens (the prefill plus n - 1 decode steps). Per
    stage: median over decode requests of (stage_ms - median prefill stage_ms) / (n - 1)."""
    pre = [r["stage_ms"] for r in prefill if r["ok"] and r.get("stage_ms")]
    dec = [r for r in decode if r["ok"] and r.get("stage_ms") and r["completion_tokens"] > 1]
    if not pre or not dec:
        return None
    n_stages = len(pre[0])
    base = [statistics.median(p[i] for p in pre) for i in range(n_stages)]
    return [
        round(
            statistics.median(
                (r["stage_ms"][i] - base[i]) / (r["completion_tokens"] - 1) for r in dec
            ),
            3,
        )
        for i in range(n_stages)
    ]


def floor_ms(stage_compute_ms: Sequence[float], hop_delays_ms: Sequence[float]) -> dict[str, float]:
    """Per-token floor: the stages' compute plus one trip around the ring."""
    compute = sum(stage_compute_ms)
    ring = sum(hop_delays_ms)
    return {
        "compute_ms": round(compute, 3),
        "ring_ms": round(ring, 3),
        "floor_ms": round(compute + ring, 3),
    }


def against_floor(measured_ms: float, floor: float) -> dict[str, Any]:
    goal = GOAL_RATIO * floor + GOAL_SLACK_MS
    return {
        "measured_ms": round(measured_ms, 3),
        "floor_ms": round(floor, 3),
        "ratio": round(measured_ms / floor, 4) if floor > 0 else None,
        "gap_ms": round(measured_ms - floor, 3),
        "goal_ms": round(goal, 3),
        "goal_met": measured_ms <= goal,
    }


# ----- the wire -----


def link_key(src: str, dst: str) -> str:
    return f"{src}>{dst}"


def counters_window(before: Any, after: Any) -> dict[str, Any]:
    """What the emulator carried between two `Lab.counters()` readings."""
    links = {}
    for (src, dst), c in after.links.items():
        b = before.links.get((src, dst))
        dropped = dict(c.dropped)
        if b is not None:
            dropped = {k: v - b.dropped.get(k, 0) for k, v in c.dropped.items()}
        links[link_key(src, dst)] = {
            "packets": c.packets - (b.packets if b else 0),
            "bytes": c.bytes - (b.bytes if b else 0),
            "dropped": {k: v for k, v in dropped.items() if v},
        }
    delivered = after.delivered - before.delivered
    late = after.late_total_s - before.late_total_s
    return {
        "seconds": round(after.uptime_s - before.uptime_s, 3),
        "links": links,
        "delivered": delivered,
        "late_mean_ms": round(late / delivered * 1000, 4) if delivered else None,
        "late_max_ms_since_start": round(after.max_late_s * 1000, 3),
        "write_errors": after.write_errors - before.write_errors,
        "read_errors": after.read_errors - before.read_errors,
    }


def wire_per_token(
    window: Mapping[str, Any],
    tokens: int,
    idle: Mapping[str, Any] | None = None,
    processed: int | None = None,
) -> dict[str, dict[str, Any]]:
    """Bytes per completion token on each directed link that carried traffic in `window`;
    `net` subtracts the background (gossip, heartbeats) measured in an `idle` window, and
    `net_bytes_per_processed_token` divides that by prompt + completion tokens (`processed`):
    every token computed crosses each activation leg once."""
    out = {}
    for key, c in window["links"].items():
        if not c["bytes"]:
            continue
        row: dict[str, Any] = {
            "bytes": c["bytes"],
            "packets": c["packets"],
            "bytes_per_token": round(c["bytes"] / tokens, 1) if tokens else None,
            "dropped": c["dropped"],
        }
        if idle is not None and idle["seconds"] > 0:
            rate = idle["links"].get(key, {}).get("bytes", 0) / idle["seconds"]
            background = rate * window["seconds"]
            row["idle_bytes_per_s"] = round(rate, 1)
            net = max(0.0, c["bytes"] - background)
            row["net_bytes_per_token"] = round(net / tokens, 1) if tokens else None
            if processed:
                row["net_bytes_per_processed_token"] = round(net / processed, 1)
        out[key] = row
    return out


# ----- faults -----


def around_fault(
    records: Sequence[Mapping[str, Any]],
    fault_t: float,
    resumed_after: float | None = None,
    observed_until: float | None = None,
) -> dict[str, Any]:
    """What requests saw around a fault at run time `fault_t`: those in flight (sent before,
    ended after), those sent after it; the longest time no client received a token between
    the fault and `observed_until` (default: when the last request ended), and whether tokens
    flowed again after it; and the first request sent after `resumed_after` (default the
    fault) that completed."""
    in_flight, later = [], []
    for r in records:
        end = r["t0"] + (r["t_end"] or 0)
        if r["t0"] < fault_t < end:
            in_flight.append(r)
        elif r["t0"] >= fault_t:
            later.append(r)
    if observed_until is None:
        observed_until = max((r["t0"] + (r["t_end"] or 0) for r in records), default=fault_t)
    after = sorted(
        r["t0"] + c for r in records for c in r.get("chunks") or [] if r["t0"] + c > fault_t
    )
    points = [fault_t, *after, max(observed_until, after[-1] if after else fault_t)]
    gap, end = max(((b - a, b) for a, b in itertools.pairwise(points)), default=(0.0, fault_t))
    never = end == points[-1] and end != (after[-1] if after else None)
    stall = {
        "longest_gap_s": round(gap, 3),
        "resumed_after_fault_s": None if never else round(end - fault_t, 3),
        "last_token_after_fault_s": round(after[-1] - fault_t, 3) if after else None,
        "tokens_after_fault": len(after),
        "observed_s": round(observed_until - fault_t, 3),
    }
    since = fault_t if resumed_after is None else resumed_after
    ok_after = (r for r in sorted(later, key=lambda r: r["t0"]) if r["ok"] and r["t0"] >= since)
    first_ok = next(ok_after, None)
    return {
        "fault_t": round(fault_t, 3),
        "in_flight": [_fate(r, fault_t) for r in in_flight],
        "in_flight_ok": sum(1 for r in in_flight if r["ok"]),
        "in_flight_failed": sum(1 for r in in_flight if not r["ok"]),
        "sent_after": len(later),
        "sent_after_failed": sum(1 for r in later if not r["ok"]),
        "sent_after_causes": _count(r["cause"] or "incomplete" for r in later if not r["ok"]),
        "token_stall": stall,
        "first_ok_request": None
        if first_ok is None
        else {
            "i": first_ok["i"],
            "sent_after_fault_s": round(first_ok["t0"] - fault_t, 3),
            "done_after_fault_s": round(first_ok["t0"] + first_ok["t_end"] - fault_t, 3),
        },
    }


def _fate(r: Mapping[str, Any], fault_t: float) -> dict[str, Any]:
    chunks = r.get("chunks") or []
    at = fault_t - r["t0"]
    return {
        "i": r["i"],
        "stream": r["stream"],
        "ok": r["ok"],
        "cause": r["cause"],
        "error": r["error"],
        "ended_after_fault_s": round(r["t0"] + (r["t_end"] or 0) - fault_t, 3),
        "tokens_before_fault": sum(1 for c in chunks if c <= at),
        "tokens_after_fault": sum(1 for c in chunks if c > at),
    }


def _count(items: Iterable[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for x in items:
        out[x] = out.get(x, 0) + 1
    return out


# ----- churn -----


def stall_s(r: Mapping[str, Any], fault_t: float) -> float | None:
    """For a streamed request in flight at `fault_t`: seconds from its last token before the
    fault (or its send, if none came yet) to its first token after it; None when it is not
    streamed or no token came after the fault."""
    if not r["stream"]:
        return None
    chunks = [r["t0"] + c for c in r.get("chunks") or []]
    after = [c for c in chunks if c > fault_t]
    if not after:
        return None
    before = [c for c in chunks if c <= fault_t]
    return after[0] - (before[-1] if before else r["t0"])


def churn_faults(
    records: Sequence[Mapping[str, Any]], faults: Sequence[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """Each fault with the requests in flight at it: how many failed, and for the streamed
    ones the stall (last token before the fault to first after) and the extra latency (the
    stall less the request's median gap between tokens)."""
    out = []
    for f in faults:
        t = f["t"]
        flight = [r for r in records if r["t0"] < t < r["t0"] + (r["t_end"] or 0)]
        stalls, extras = [], []
        for r in flight:
            s = stall_s(r, t)
            if s is None:
                continue
            gaps = gaps_ms(r)
            stalls.append(s)
            extras.append(max(0.0, s - (statistics.median(gaps) / 1000 if gaps else 0.0)))
        out.append(
            {
                **f,
                "in_flight": len(flight),
                "in_flight_failed": sum(1 for r in flight if not r["ok"]),
                "stalls_s": [round(s, 3) for s in stalls],
                "extra_s": round(max(extras), 3) if extras else None,
            }
        )
    return out


def churn_by_kind(rows: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per kind of fault: how many, requests in flight and failed, and the spread of the
    worst extra latency each fault caused a streamed request."""
    kinds: dict[str, list[Mapping[str, Any]]] = {}
    for row in rows:
        kinds.setdefault(row["kind"], []).append(row)
    return {
        kind: {
            "faults": len(rs),
            "skipped": sum(1 for r in rs if r.get("skipped")),
            "in_flight": sum(r["in_flight"] for r in rs),
            "in_flight_failed": sum(r["in_flight_failed"] for r in rs),
            "extra_s": spread([r["extra_s"] for r in rs if r["extra_s"] is not None]),
        }
        for kind, rs in kinds.items()
    }


def greedy_identity(
    records: Sequence[Mapping[str, Any]], references: Sequence[Mapping[str, Any]]
) -> dict[str, Any]:
    """Each completed greedy request against the reference for its prompt (made one at a
    time, undisturbed): identical or not, and whether it was replayed."""
    ref = {(r["shape"], r["prompt_no"]): r["text"] for r in references if r["ok"]}
    checked, mismatches = 0, []
    for r in records:
        key = (r["shape"], r.get("prompt_no"))
        if r.get("temperature") != 0.0 or not r["ok"] or key not in ref:
            continue
        checked += 1
        want, got = ref[key], r.get("text") or ""
        if got != want:
            at = next((k for k, (a, b) in enumerate(zip(want, got, strict=False)) if a != b), None)
            mismatches.append(
                {
                    "i": r["i"],
                    "shape": r["shape"],
                    "prompt_no": r.get("prompt_no"),
                    "replayed": bool(r.get("replays")),
                    "first_difference_at_char": min(len(want), len(got)) if at is None else at,
                }
            )
    return {
        "checked": checked,
        "identical": checked - len(mismatches),
        "replayed_checked": sum(
            1
            for r in records
            if r.get("temperature") == 0.0
            and r["ok"]
            and r.get("replays")
            and (r["shape"], r.get("prompt_no")) in ref
        ),
        "mismatches": mismatches,
    }


def churn_detection(
    faults: Sequence[Mapping[str, Any]],
    log_events: Sequence[Mapping[str, Any]],
    entry: str,
    within_s: float = 15.0,
) -> list[float | None]:
    """For each fault, seconds until the entry's pipeline broke after it (`pipeline.broken`
    in the entry's log, within `within_s`), or None when it did not (the fault touched no
    leg of the chain in use, or a later fault came first)."""
    broke = sorted(
        e["t"]
        for e in log_events
        if e.get("host") == entry and e.get("event") == "pipeline.broken" and e.get("t") is not None
    )
    out: list[float | None] = []
    for f in faults:
        t = f["t"]
        first = next((b for b in broke if t <= b <= t + within_s), None)
        out.append(None if first is None else round(first - t, 3))
    return out


def replay_times(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """From the receipts of replayed requests: how long each waited for a chain that serves
    (`wait_ms`) and how long the replay itself took (the rest of `ms`), in seconds."""
    replays = [x for r in records for x in (r.get("replays") or [])]
    return {
        "replays": len(replays),
        "wait_s": spread([x.get("wait_ms", 0.0) / 1000 for x in replays]),
        "replay_s": spread([(x["ms"] - x.get("wait_ms", 0.0)) / 1000 for x in replays]),
    }


def churn_back(
    faults: Sequence[Mapping[str, Any]],
    entry_events: Sequence[Mapping[str, Any]],
    within_s: float = 15.0,
) -> list[float | None]:
    """For each fault that broke the entry's chain (within `within_s`), seconds from the fault
    until the entry opened a chain again (`pipeline.reconnected`): the chain serves again
    from there, and what follows is the replay itself. None for the others."""
    broke = sorted(e["t"] for e in entry_events if e["event"] == "pipeline.broken" and e["t"])
    back = sorted(e["t"] for e in entry_events if e["event"] == "pipeline.reconnected" and e["t"])
    out: list[float | None] = []
    for f in faults:
        t = f["t"]
        b = next((x for x in broke if t <= x <= t + within_s), None)
        r = None if b is None else next((x for x in back if x >= b), None)
        out.append(None if r is None or r - t > 2 * within_s else round(r - t, 3))
    return out


def speculation(phases: Mapping[str, Sequence[Mapping[str, Any]]]) -> dict[str, Any]:
    """Per workload ("copy", "prose"), one request at a time with drafts off and with `auto`:
    the median decode tokens/s of each (streamed: first to last chunk), their ratio, the
    drafts' acceptance, the most windows in flight, and whether the greedy texts were the
    same."""
    out: dict[str, Any] = {}
    for mix in dict.fromkeys(name.rsplit("-", 1)[0] for name in phases):
        off, auto = phases.get(f"{mix}-off", ()), phases.get(f"{mix}-auto", ())
        rates = {}
        for mode, recs in (("off", off), ("auto", auto)):
            # Decode rate: tokens after the first over the time from the first to the last.
            r = sorted(1000 / t for rec in recs if rec["ok"] and (t := per_token_ms(rec)))
            rates[mode] = round(_q(r, 0.5), 2) if r else None
        receipts = [rec["speculation"] for rec in auto if rec.get("speculation")]
        drafted = sum(s["drafted"] for s in receipts)
        accepted = sum(s["accepted"] for s in receipts)
        by_model = [s["draft_model"] for s in receipts if s.get("draft_model")]
        texts_off = {rec["prompt_no"]: rec["text"] for rec in off if rec["ok"]}
        same = [texts_off.get(rec["prompt_no"]) == rec["text"] for rec in auto if rec["ok"]]
        out[mix] = {
            "tok_s_off": rates["off"],
            "tok_s_auto": rates["auto"],
            "ratio": round(rates["auto"] / rates["off"], 3)
            if rates["off"] and rates["auto"]
            else None,
            "windows": sum(s["windows"] for s in receipts),
            # The most windows of one request in flight at once (sent before the verdicts).
            "peak_in_flight": max(
                (s.get("peak_windows_in_flight", 0) for s in receipts), default=0
            ),
            "drafted": drafted,
            "accepted": accepted,
            "acceptance": round(accepted / drafted, 3) if drafted else None,
            # Of those, the draft model's (`--draft-model`): its windows, drafts and right ones.
            "model_windows": sum(m["windows"] for m in by_model),
            "model_drafted": sum(m["drafted"] for m in by_model),
            "model_accepted": sum(m["accepted"] for m in by_model),
            # Their chance of being right given those before them were (`per_token_acceptance`).
            "model_p": per_token_acceptance(
                sum(m["drafted"] for m in by_model),
                sum(m["accepted"] for m in by_model),
                sum(m["windows"] for m in by_model),
            ),
            "requests": len(off) + len(auto),
            "ok": sum(rec["ok"] for rec in (*off, *auto)),
            "same_text": f"{sum(same)}/{len(same)}",
        }
    return out


def prefix(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Conversations of two turns (kept prefixes): per conversation the time to first token
    of each turn and the prompt tokens the second found cached; the median of the second
    turn's TTFT over the first's."""
    convs: dict[int, dict[int, Mapping[str, Any]]] = {}
    for rec in records:
        if rec.get("turn"):
            convs.setdefault(rec["prompt_no"], {})[rec["turn"]] = rec
    rows = []
    for c, turns in sorted(convs.items()):
        first, second = turns.get(1), turns.get(2)
        if first is None or second is None:
            continue
        t1, t2 = ttft_ms(first), ttft_ms(second)
        rows.append(
            {
                "conversation": c,
                "ok": bool(first["ok"] and second["ok"]),
                "prompt_tokens": [first.get("prompt_tokens"), second.get("prompt_tokens")],
                "cached_tokens": [first.get("cached_tokens"), second.get("cached_tokens")],
                "ttft_ms": [
                    None if t1 is None else round(t1, 1),
                    None if t2 is None else round(t2, 1),
                ],
                "ratio": round(t2 / t1, 4) if t1 and t2 else None,
            }
        )
    ratios = sorted(r["ratio"] for r in rows if r["ratio"] is not None)
    return {
        "conversations": rows,
        "median_ratio": round(_q(ratios, 0.5), 4) if ratios else None,
        "goal": "<= 0.2",
        "goal_met": bool(ratios) and _q(ratios, 0.5) <= 0.2 and all(r["ok"] for r in rows),
    }


def per_token_acceptance(drafted: int, accepted: int, windows: int) -> float | None:
    """The chance p that a draft token is right given that those before it were, from a
    workload's totals: windows of mean length k keep on average sum(p^i, i=1..k) tokens (a
    window ends at its first wrong token), so accepted / drafted = that sum / k."""
    if not drafted or not windows:
        return None
    k = max(1, round(drafted / windows))
    want = min(1.0, accepted / drafted)
    lo, hi = 0.0, 1.0
    for _ in range(50):
        p = (lo + hi) / 2
        if sum(p**i for i in range(1, k + 1)) / k < want:
            lo = p
        else:
            hi = p
    return round((lo + hi) / 2, 4)


def window_ms(cost: Mapping[str, Any], tokens: int) -> float | None:
    """What a window of `tokens` tokens took at the entry, from its status's `window_cost`:
    the mean of those timed, else the line fitted through them."""
    steps = cost.get("steps") or {}
    if str(tokens) in steps:
        return float(steps[str(tokens)]["mean_ms"])
    one = steps.get("1")
    if one is None:
        return None
    return float(one["mean_ms"]) * (1 + cost["jump"] + cost["slope"] * (tokens - 1))


# The draft model's tokens judged (decayed) before its record stands for its p where it sent
# no window (`unsent_p`).
UNSENT_JUDGED = 20


def unsent_p(right: Mapping[str, Any] | None) -> float | None:
    """The draft model's p from the entry's record of it (status `draft_model.right`: its
    windows and the proposals "auto" did not send, checked against the tokens that came),
    where it was judged on at least `UNSENT_JUDGED` tokens; else None."""
    if not right or right.get("p") is None or (right.get("judged") or 0) < UNSENT_JUDGED:
        return None
    return float(right["p"])


def draft_ceiling(
    p: float | None, cost: Mapping[str, Any] | None, forward_ms: float | None, most: int = 15
) -> dict[str, Any] | None:
    """The gain over plain decoding that drafts right with per-token chance `p` allow at the
    window costs the entry measured (`cost`: its status's `window_cost`, one window verified
    at a time) and the draft model's forward pass (`forward_ms`, each drafted token paid
    before its window goes): max over k of E(k) * t(1) / (t(k + 1) + k * forward_ms), where a
    window of k drafts yields E(k) = sum(p^i, i=0..k) tokens, k up to `most` (a window holds
    at most 16 tokens: `serving/drafting.py`'s MAX_DRAFT). None where not measured."""
    if p is None or not cost:
        return None
    one = window_ms(cost, 1)
    if not one:
        return None
    best_k, best = 0, 1.0
    for k in range(1, most + 1):
        t = window_ms(cost, k + 1)
        if t is None:
            break
        gain = sum(p**i for i in range(k + 1)) * one / (t + k * (forward_ms or 0.0))
        if gain > best:
            best_k, best = k, gain
    return {"ceiling": round(best, 3), "at_draft_tokens": best_k, "p": p, "step_ms": one}
