"""A hostile member against a 3-agent split: the split keeps serving an authorised client.

Three agent processes on loopback, each offering too little memory to hold SmolLM2 alone, agree
on a three-stage split (`start_split`, as in bench/split.py). An authorised client asks each
of a fixed set of prompts once, greedy, undisturbed, and keeps the texts. Then a fourth member
of the mesh (`meshagent.testing.hostile.HostileMember`: the mesh secret, identities of its
own) sends generated messages on every overlay label to all three agents, `--rate` a second
for `--minutes`, while the client keeps asking the same prompts in turn of the three agents'
APIs (the entry's own, and two that carry the request to it over `gen/1`).

It records the messages sent by label and what came of them (refusals by reason), the requests
served and failed, whether each text is the undisturbed one, each agent's resident memory
(VmRSS) before the attack, at most during it and at its end, and whether each agent is still
alive. It prints a table, writes JSON (and the agents' warnings next to it), and exits
non-zero when an acceptance criterion fails: a failed request, a text that differs, an agent
that died, an agent whose memory grew by more than 64 MiB, or fewer than 50 messages a second.
`--minutes 0.5` is a short trial.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import result_file
import trio
from split import SMALL, start_split

from meshagent.launch import AgentProcess, cpu_seconds
from meshagent.logs import configure
from meshagent.testing.hostile import OUTCOMES, HostileMember, Knowledge, Tally
from meshagent.testing.member import AgentAddress

MODEL = "SmolLM2-135M-Instruct.Q4_1"
PROMPTS = [
    "Name three colours.",
    "What is the capital of France?",
    "Write one sentence about the sea.",
    "Count from one to five.",
    "What do bees make?",
    "Give a synonym for happy.",
]
RSS_LIMIT_MIB = 64
MIN_RATE = 50.0


@dataclass
class Client:
    """What the authorised client saw during the attack."""

    undisturbed: dict[str, str]
    served: int = 0
    failed: list[dict[str, Any]] = field(default_factory=list)
    differed: list[dict[str, Any]] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)


def chat(prompt: str, max_tokens: int) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }


def ask(url: str, prompt: str, max_tokens: int, seconds: list[float] | None = None) -> str:
    t0 = time.monotonic()
    r = httpx.post(f"{url}/v1/chat/completions", json=chat(prompt, max_tokens), timeout=120)
    r.raise_for_status()
    if seconds is not None:
        seconds.append(time.monotonic() - t0)
    return r.json()["choices"][0]["message"]["content"]


def cpu(agents: list[AgentProcess]) -> list[float]:
    """CPU seconds each agent has used so far (0 for one that is gone)."""
    out = []
    for a in agents:
        try:
            out.append(sum(cpu_seconds(a.proc.pid)))
        except OSError:
            out.append(0.0)
    return out


def median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2] if xs else float("nan")


# Info lines kept with the agents' warnings: what gossip made of the member's items.
_KEPT_INFO = ("gossip.peer_dead", "gossip.peer_back", "gossip.refuted", "pipeline.")


async def keep_asking(
    urls: list[str], out: Client, max_tokens: int, stop: trio.Event, t0: float
) -> None:
    """The prompts in turn, each of the next agent's API, until `stop` is set."""
    i = 0
    async with httpx.AsyncClient(timeout=120) as client:
        while not stop.is_set():
            prompt, url = PROMPTS[i % len(PROMPTS)], urls[i % len(urls)]
            i += 1
            at = round(trio.current_time() - t0, 1)
            began = trio.current_time()
            try:
                r = await client.post(f"{url}/v1/chat/completions", json=chat(prompt, max_tokens))
                r.raise_for_status()
                text = r.json()["choices"][0]["message"]["content"]
            except (httpx.HTTPError, KeyError, ValueError) as e:
                body = e.response.text[:300] if isinstance(e, httpx.HTTPStatusError) else ""
                error = f"{type(e).__name__}: {e}"[:300]
                out.failed.append({"at_s": at, "url": url, "error": error, "body": body})
                await trio.sleep(0.5)  # an agent that is gone refuses at once: not a flood
                continue
            out.served += 1
            out.seconds.append(trio.current_time() - began)
            if text != out.undisturbed[prompt]:
                out.differed.append({"at_s": at, "url": url, "prompt": prompt, "text": text})


def rss_mib(pid: int) -> float | None:
    """Resident memory of process `pid` in MiB; None once it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return None


async def watch(agents: list[AgentProcess], peak: list[float], died: dict[int, float]) -> None:
    """Each agent's largest resident memory, and when it was first seen gone."""
    t0 = trio.current_time()
    while True:
        for i, a in enumerate(agents):
            mib = rss_mib(a.proc.pid)
            if mib is None or a.proc.poll() is not None:
                died.setdefault(i, round(trio.current_time() - t0, 1))
            else:
                peak[i] = max(peak[i], mib)
        await trio.sleep(1.0)


async def attack(
    args: argparse.Namespace, agents: list[AgentProcess], client: Client
) -> tuple[Tally, list[float], dict[int, float]]:
    """The hostile member's run, with the client asking and the memory watched meanwhile."""
    slots, ctx = _flag(args.split_args, "--slots", 4), _flag(args.split_args, "--ctx-size", 512)
    hostile = HostileMember(
        [AgentAddress.of(a.data_dir) for a in agents],
        Knowledge(model=MODEL, slots=slots, ctx=ctx),
        seed=args.seed,
        skip=args.skip,
    )
    peak = [rss_mib(a.proc.pid) or 0.0 for a in agents]
    died: dict[int, float] = {}
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch, agents, peak, died)
        async with trio.open_nursery() as asking:
            urls = [a.url for a in agents]
            asking.start_soon(keep_asking, urls, client, args.max_tokens, stop, trio.current_time())
            tally = await hostile.run(
                seconds=args.minutes * 60, rate=args.rate, concurrency=args.concurrency
            )
            stop.set()  # the request under way ends, then the client stops
        nursery.cancel_scope.cancel()
    return tally, peak, died


def _flag(flags: str, name: str, default: int) -> int:
    words = flags.split()
    return int(words[words.index(name) + 1]) if name in words[:-1] else default


def print_table(tally: Tally) -> None:
    short = {"answered": "answer", "refused": "refuse", "unreachable": "unreach"}
    print(
        f"{'label':<15}{'sent':>7}"
        + "".join(f"{short.get(o, o):>8}" for o in OUTCOMES)
        + f"{'breach':>8}"
    )
    for label in sorted(tally.sent):
        row = f"{label:<15}{tally.sent[label]:>7}"
        row += "".join(f"{tally.outcomes[label, o]:>8}" for o in OUTCOMES)
        print(row + f"{tally.breaches_by_label[label]:>8}")
    print(f"{'all':<15}{tally.total:>7}" + "".join(f"{tally.count(o):>8}" for o in OUTCOMES))
    print("most frequent refusals and resets (all of them in the JSON):")
    said = [(k, n) for k, n in tally.reasons.most_common() if k[1] in ("refused", "reset")]
    for (label, outcome, why), n in said[:25]:
        print(f"  {n:>6}  {label:<14} {outcome:<7} {why[:100]}")
    if tally.breaches:
        print("answered (or left unrefused) where a well-behaved agent refuses, by case:")
        for name, n in tally.breaches.most_common(12):
            print(f"  {n:>6}  {name}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--rate", type=float, default=60.0, help="hostile messages a second")
    ap.add_argument("--concurrency", type=int, default=64, help="hostile cases at once, at most")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument(
        "--skip",
        action="append",
        default=[],
        metavar="PREFIX",
        help="leave out the cases whose name starts with PREFIX (repeatable; names are "
        "listed in the JSON), e.g. gossip.obituary_plausible",
    )
    ap.add_argument("--out", type=Path, default=Path("bench/results/hostile.json"))
    ap.add_argument(
        "--split-args",
        default=" ".join(SMALL),
        help=f"flags of the three agents (default {' '.join(SMALL)!r})",
    )
    args = ap.parse_args()
    configure("error")  # the member's own overlay logs each connection it opens or loses
    logs = args.out.with_suffix("")  # bench/results/hostile/: the agents' warnings
    with (
        tempfile.TemporaryDirectory(prefix="meshagent-bench-") as tmp,
        contextlib.ExitStack() as stack,  # the agents stop however the run ends
    ):
        entry, stages, agents = start_split(Path(tmp), stack, MODEL, args.split_args.split())
        peers = [AgentAddress.of(a.data_dir).peer_id for a in agents]
        for _ in range(2):
            ask(entry.url, PROMPTS[0], args.max_tokens)  # warm up
        calm: list[float] = []  # seconds a request took, undisturbed
        undisturbed = {p: ask(entry.url, p, args.max_tokens, calm) for p in PROMPTS}
        carried = {p: ask(agents[1].url, p, args.max_tokens) for p in PROMPTS}
        before = [rss_mib(a.proc.pid) or 0.0 for a in agents]
        client = Client(undisturbed)
        t0, cpu0, own0 = time.monotonic(), cpu(agents), time.process_time()
        tally, peak, died = trio.run(attack, args, agents, client)
        wall, cpu1, own = time.monotonic() - t0, cpu(agents), time.process_time() - own0
        time.sleep(2.0)  # what the last cases left behind is freed
        end = [rss_mib(a.proc.pid) for a in agents]
        alive = [a.proc.poll() is None for a in agents]
        exits = [a.proc.poll() for a in agents]
        logs.mkdir(parents=True, exist_ok=True)
        for name, a in zip("abc", agents, strict=True):
            lines = a.log_text().splitlines()
            loud = [
                ln
                for ln in lines
                if not ('"level": "info"' in ln or '"level": "debug"' in ln)
                or any(f'"event": "{e}' in ln for e in _KEPT_INFO)
            ]
            (logs / f"agent-{name}.log").write_text("\n".join(loud[-5000:]) + "\n")
    roles = {
        peer: f"{'entry, ' if i == 0 else ''}layers {s}-{e}"
        for i, (peer, s, e) in enumerate(stages)
    }
    growth = [
        max(p, e) - b if ok and e is not None else None
        for ok, b, p, e in zip(alive, before, peak, end, strict=True)
    ]
    rate = tally.total / tally.seconds
    criteria = {
        "no failed request": not client.failed,
        "every text as undisturbed": client.served > 0 and not client.differed,
        "every agent alive": all(alive),
        f"memory within +{RSS_LIMIT_MIB} MiB": all(
            g is not None and g <= RSS_LIMIT_MIB for g in growth
        ),
        f"at least {MIN_RATE:g} messages/s": rate >= MIN_RATE,
    }

    print(
        f"hostile member: {tally.total} messages in {tally.seconds:.1f} s ({rate:.1f}/s), "
        f"seed {args.seed}; its own longest stall {tally.max_lag * 1000:.0f} ms"
    )
    print_table(tally)
    same = client.served - len(client.differed)
    print(
        f"authorised client: {client.served} served, {len(client.failed)} failed, "
        f"{same}/{client.served} texts as undisturbed; median {median(client.seconds):.2f} s "
        f"a request (undisturbed {median(calm):.2f} s)"
    )
    if carried != undisturbed:
        print("  note: undisturbed, the carried and the entry's texts already differed")
    for f in client.failed[:5]:
        print(f"  failed at {f['at_s']} s: {f['error'][:120]} {f['body'][:120]}")
    for d in client.differed[:3]:
        print(f"  differed at {d['at_s']} s ({d['prompt']!r}): {d['text'][:80]!r}")
    used = [b - a for a, b in zip(cpu0, cpu1, strict=True)]
    print(
        f"CPU during the attack: agents {', '.join(f'{u:.0f}' for u in used)} s, the member "
        f"{own:.0f} s, in {wall:.0f} s on {os.cpu_count()} cores"
    )
    print(f"{'agent':<8}{'part':<20}{'RSS before':>11}{'max':>8}{'end':>8}{'growth':>8}  alive")
    for i, name in enumerate("abc"):
        e, g = end[i], growth[i]
        print(
            f"{name:<8}{roles.get(peers[i], 'spare'):<20}{before[i]:>10.1f}M{peak[i]:>7.1f}M"
            f"{(f'{e:.1f}M' if e is not None else '-'):>8}"
            f"{(f'{g:+.1f}M' if g is not None else '-'):>8}  "
            + ("yes" if alive[i] else f"no (exit {exits[i]}, gone at {died.get(i, '?')} s)")
        )
    for name, ok in criteria.items():
        print(f"{'PASS' if ok else 'FAIL'}  {name}")

    result = {
        "benchmark": "hostile",
        "model": MODEL,
        "agent_args": args.split_args.split(),
        "minutes": args.minutes,
        "rate_asked": args.rate,
        "seed": args.seed,
        "skip": args.skip,
        "wall_s": round(wall, 1),
        "stages": stages,
        "agents": [
            {
                "name": name,
                "peer_id": peers[i],
                "part": roles.get(peers[i], "spare"),
                "rss_mib_before": round(before[i], 1),
                "rss_mib_max": round(peak[i], 1),
                "rss_mib_end": None if end[i] is None else round(end[i], 1),
                "rss_growth_mib": None if growth[i] is None else round(growth[i], 1),
                "cpu_s": round(used[i], 1),
                "alive": alive[i],
                "exit_code": exits[i],
                "gone_at_s": died.get(i),
            }
            for i, name in enumerate("abc")
        ],
        "client": {
            "max_tokens": args.max_tokens,
            "served": client.served,
            "failed": len(client.failed),
            "differed": len(client.differed),
            "median_s": median(client.seconds),
            "undisturbed_median_s": median(calm),
            "failures": client.failed[:50],
            "differences": client.differed[:50],
            "undisturbed": undisturbed,
            "carried_undisturbed_same": carried == undisturbed,
        },
        "hostile": tally.to_json(),
        "acceptance": criteria,
        "member_cpu_s": round(own, 1),
        "machine": result_file.machine(),
    }
    result_file.write(args.out, result, f" (the agents' warnings in {logs}/)")
    sys.exit(0 if all(criteria.values()) else 1)


if __name__ == "__main__":
    main()
