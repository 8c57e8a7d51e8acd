"""Speculative decoding: decode speed with drafts from a request's own text against without.

One agent on loopback serves the embedded model, or `--model FILE` (SmolLM2 does not perform
the code rename; `bench/coder_model.py` fetches Qwen2.5-Coder-1.5B, which does). Each workload
is a greedy chat request, sent with `"meshagent": {"speculation": MODE}` for each mode in turn,
several rounds, interleaved so that the machine's other load touches every mode alike. Decode
tokens/s runs from the first streamed text to the end of the stream (the prompt's prefill is
left out), over the completion tokens after the first. Two workloads are copy-shaped (the
answer repeats much of the prompt: a JSON document with one field changed, a code block with a
variable renamed), one is novel prose, where drafts rarely fit. The texts of all modes must be
identical (greedy); the script says so per workload. It then takes what a window of n tokens
costs next to one token from the agent's own decode steps in the runs, timed by their tokens
(its status's `window_cost.steps`; the same minutes as the figures, since this machine's speed
drifts), with the part of each agent step beyond the engine's, from the agent's time per token
without drafts, paid once per window as a step pays it; it also measures the same in this
process after the runs, one sequence at a fixed position, and prints both. From those costs:
the most any draft length could gain on this machine (the ceiling), and,
from the model's greedy answer to each workload, the most drafts copied from the request's own
text could gain on that answer (the answer's ceiling: where the model does not copy, no drafter
from the text can help), and the same for drafts found by the last token, as an n-gram drafter
finds them; where the lower of the first two is below the goal, it is the target. What a
window costs against a step also drifts here from one minute to the next, so the agent's steps
are read after every round too, and each round's gain (its `auto` run against its base run) is
also set against the lower ceiling that round's own steps give; the median of those is printed
per copy workload. Prints a table and writes JSON (default bench/results/speculation.json).
Never asserts on time: compare the figures yourself.

    .venv/bin/python bench/speculation.py [--rounds 3] [--max-tokens 256] [--modes off,auto,on]
        [--model FILE] [--draft-model FILE]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import result_file
from chat_stream import stream_chat

from meshagent.launch import start_agent
from meshagent.models.default import default_model_path
from meshagent.testing.workloads import CODE_PROMPT, COPY_PROMPT

WORKLOADS = {
    "json": COPY_PROMPT,
    "code": CODE_PROMPT,
    "prose": "Write a long, detailed story about a lighthouse keeper who finds a map.",
}
COPY_SHAPED = ("json", "code")


def agent_steps(url: str) -> dict[str, dict]:
    """The agent's decode steps timed since it loaded, by size (its status's
    `window_cost.steps`)."""
    [served] = httpx.get(f"{url}/control/status").json()["models"]
    return served["speculation"]["window_cost"]["steps"]


def one(url: str, model: str, prompt: str, mode: str, max_tokens: int) -> dict:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "meshagent": {"speculation": mode},
    }
    got = stream_chat(url, body)
    text, usage, first, end = got.text, got.usage, got.first, got.end
    tokens = usage["completion_tokens"]
    spec = (usage.get("meshagent") or {}).get("speculation") or {}
    return {
        "text": text,
        "tokens": tokens,
        "tok_s": (tokens - 1) / (end - first) if tokens > 1 and end > first else 0.0,
        "drafted": spec.get("drafted", 0),
        "accepted": spec.get("accepted", 0),
        "windows": spec.get("windows", 0),
        # The draft model's share of them (`--draft-model`).
        "model_windows": (spec.get("draft_model") or {}).get("windows", 0),
        "model_drafted": (spec.get("draft_model") or {}).get("drafted", 0),
        "model_accepted": (spec.get("draft_model") or {}).get("accepted", 0),
    }


WINDOWS = (1, 2, 3, 5, 9, 15, 16, 17, 32, 33)


def window_costs(model: Path, threads: int, repeats: int = 12) -> tuple[dict[int, float], float]:
    """What a step of n tokens of one sequence costs here, relative to a step of one: the
    model in this process, with the agent's slots, context and threads, after a prompt as
    long as the workloads' (about 300 tokens), median of `repeats` rounds that take every
    size in turn (so that the machine's drift touches each size alike; each window's
    positions are cut from the cache again); and the seconds of a step of one."""
    from meshagent.engine.base import ForwardItem
    from meshagent.engine.llama import LlamaEngine

    engine = LlamaEngine(model, threads=threads)
    try:
        prompt = engine.tokenize("The quick brown fox jumps over the lazy dog. " * 30, add_bos=True)
        engine.forward([ForwardItem(0, 0, prompt, False)])
        at, times = len(prompt), {n: [] for n in WINDOWS}
        for _ in range(repeats):
            for n in WINDOWS:
                t = time.perf_counter()
                engine.forward([ForwardItem(0, at, prompt[1 : 1 + n], True, n)])
                times[n].append(time.perf_counter() - t)
                engine.trim_sequence(0, at)
        ms = {n: statistics.median(ts) for n, ts in times.items()}
    finally:
        engine.close()
    return {n: ms[n] / ms[1] for n in WINDOWS}, ms[1]


def timed_costs(steps: dict[str, dict], least: int = 10) -> tuple[dict[int, float], float] | None:
    """The same from the agent's own decode steps in the runs (`window_cost.steps` of its
    status: each size's count and mean time), so from the same minutes as the figures (this
    machine's speed drifts by 5-10% from one minute to the next): sizes timed at least
    `least` times, against the one-token step; None without one-token steps and a window."""
    means = {int(n): x["mean_ms"] / 1000 for n, x in steps.items() if x["count"] >= least}
    if 1 not in means or len(means) < 2:
        return None
    return {n: means[n] / means[1] for n in sorted(means)}, means[1]


def between(before: dict[str, dict], after: dict[str, dict]) -> dict[str, dict]:
    """The steps timed between two of the agent's `window_cost.steps` (each size's count and
    mean time since it loaded): each size's count and mean time in between."""
    out = {}
    for n, x in after.items():
        b = before.get(n, {"count": 0, "mean_ms": 0.0})
        count = x["count"] - b["count"]
        if count > 0:
            spent = x["count"] * x["mean_ms"] - b["count"] * b["mean_ms"]
            out[n] = {"count": count, "mean_ms": spent / count}
    return out


def with_overhead(costs: dict[int, float], step: float, agent_step: float) -> dict[int, float]:
    """The window costs as the agent pays them: each of its decode steps costs the engine's
    step and a fixed part besides (scheduling, sampling, streaming), measured as the agent's
    time per token without drafts less the engine's step; a window pays that part once."""
    extra = max(0.0, agent_step / step - 1)
    return {n: (c + extra) / (1 + extra) for n, c in costs.items()}


def window_cost(costs: dict[int, float], n: int) -> float:
    """What a window of n tokens costs against one (sizes between those measured:
    interpolated)."""
    sizes = sorted(costs)
    lo = max(s for s in sizes if s <= n)
    hi = min(s for s in sizes if s >= n)
    return costs[lo] if lo == hi else costs[lo] + (costs[hi] - costs[lo]) * (n - lo) / (hi - lo)


def tokenized(
    model: Path, pairs: dict[str, tuple[str, str]]
) -> dict[str, tuple[list[int], list[int]]]:
    """Each workload's prompt and answer as the model's tokens."""
    from meshagent.engine.llama import LlamaEngine

    engine = LlamaEngine(model, threads=1)
    try:
        return {
            w: (engine.tokenize(p, add_bos=False), engine.tokenize(a, add_bos=False))
            for w, (p, a) in pairs.items()
        }
    finally:
        engine.close()


def copy_runs(prompt: list[int], answer: list[int], context: int = 0) -> list[int]:
    """For each position i of `answer`: the most tokens from i on that a copy of some stretch
    of the text known then (the prompt and answer[:i]) gives, whichever stretch: what the
    best drafter that drafts from the request's own text could have had right there. With
    `context`, only stretches that follow the same `context` tokens as position i does: what
    a drafter that finds its stretch by the last tokens (an n-gram drafter, n >= `context`)
    could have had, choosing the best of the stretches that match."""
    text = prompt + answer
    runs = []
    for i in range(len(answer)):
        known = len(prompt) + i
        best = 0
        for j in range(context, known):
            if context and text[j - context : j] != text[known - context : known]:
                continue
            n = 0
            while n < known - j and i + n < len(answer) and text[j + n] == answer[i + n]:
                n += 1
            best = max(best, n)
        runs.append(best)
    return runs


def copy_ceiling(costs: dict[int, float], runs: list[int]) -> float:
    """The most any drafting from the request's own text could gain on this answer here:
    with the runs known in advance, the cheapest way through it in one-token steps and
    windows (a window of k drafts, all right, gives k + 1 tokens), against one-token steps
    alone."""
    longest = max(costs) - 1
    cheapest = [0.0] * (len(runs) + 2)
    for i in range(len(runs) - 1, -1, -1):
        best = 1 + cheapest[i + 1]
        for k in range(1, min(runs[i], longest) + 1):
            end = min(i + k + 1, len(runs))
            best = min(best, window_cost(costs, k + 1) + cheapest[end])
        cheapest[i] = best
    return len(runs) / cheapest[0] if runs else 1.0


def ceiling(costs: dict[int, float], acceptance: float) -> float:
    """The most a draft length could gain here with drafts right with this probability each
    (independently): max over k of the tokens a window of k drafts yields over what it costs
    (window sizes between those measured: interpolated)."""
    a = min(acceptance, 0.999)
    best = 1.0
    for k in range(1, max(costs)):
        best = max(best, (1 - a ** (k + 1)) / (1 - a) / window_cost(costs, k + 1))
    return best


def round_shares(
    per_round: list[dict[str, dict]],
    mode_runs: list[dict],
    base_runs: list[dict],
    all_base: list[list[dict]],
    copied: list[int],
) -> dict[str, object]:
    """A mode's gain round by round (its run of a workload against the base mode's run of it
    in the same round, minutes apart) over the lower ceiling that round's own decode steps
    give (sizes timed at least 3 times in it; each step's fixed part from that round's base
    runs of every workload, `all_base`): what a window costs against a step drifts here from
    one minute to the next, so each round's figure is set against its own minutes' ceiling.
    The median share, and each round's."""
    shares = []
    for r, steps in enumerate(per_round):
        timed = timed_costs(steps, least=3)
        bases = [runs[r]["tok_s"] for runs in all_base if runs[r]["tok_s"] > 0]
        if timed is None or not bases or mode_runs[r]["tok_s"] <= 0 or base_runs[r]["tok_s"] <= 0:
            continue
        costs = with_overhead(*timed, statistics.median(1 / b for b in bases))
        allowed = min(ceiling(costs, 1.0), copy_ceiling(costs, copied))
        shares.append(round(mode_runs[r]["tok_s"] / base_runs[r]["tok_s"] / allowed, 3))
    return {"median": statistics.median(shares) if shares else None, "rounds": shares}


def paired(runs: list[dict], base: list[dict]) -> float | None:
    """The median over rounds of a run's tokens/s over its round's base run's."""
    ratios = [x["tok_s"] / b["tok_s"] for x, b in zip(runs, base, strict=True) if b["tok_s"] > 0]
    return round(statistics.median(ratios), 3) if ratios else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--modes", default="off,auto", help="comma-separated; the first is the base")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument(
        "--model",
        type=Path,
        help="a GGUF file to serve instead of the embedded model (bench/coder_model.py "
        "fetches one that performs the code rename)",
    )
    ap.add_argument(
        "--draft-model",
        type=Path,
        help="a small model's GGUF the agent drafts with beside the request's own text "
        "(meshagent up --draft-model): the modes' gains then include its drafts, and what "
        "its proposals cost is the agent's to weigh",
    )
    ap.add_argument(
        "--workloads",
        default=",".join(WORKLOADS),
        help=f"comma-separated, of {', '.join(WORKLOADS)} (default: all)",
    )
    ap.add_argument("--out", type=Path, default=Path("bench/results/speculation.json"))
    args = ap.parse_args()
    model_path = args.model or default_model_path()
    modes = args.modes.split(",")
    chosen = args.workloads.split(",")
    if unknown := [w for w in chosen if w not in WORKLOADS]:
        ap.error(f"unknown workload(s) {', '.join(unknown)}: choose of {', '.join(WORKLOADS)}")
    workloads = {w: WORKLOADS[w] for w in chosen}
    runs: dict[str, dict[str, list[dict]]] = {w: {m: [] for m in modes} for w in workloads}
    with tempfile.TemporaryDirectory(prefix="meshagent-bench-") as tmp:
        draft = ["--draft-model", str(args.draft_model)] if args.draft_model else []
        agent = start_agent(
            Path(tmp),
            "--threads",
            str(args.threads),
            "--model",
            str(model_path),
            *draft,
            timeout=300,
        )
        try:
            url = agent.url
            model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
            one(url, model, "Hello", "off", 8)  # warm up
            steps, per_round = agent_steps(url), []
            for r in range(args.rounds):
                for w, prompt in workloads.items():
                    order = modes if r % 2 == 0 else modes[::-1]
                    for m in order:
                        runs[w][m].append(one(url, model, prompt, m, args.max_tokens))
                now = agent_steps(url)
                per_round.append(between(steps, now))
                steps = now
        finally:
            agent.stop()
    apart_costs, apart_step = window_costs(model_path, args.threads)
    timed = timed_costs(steps)
    engine_costs, step = timed or (apart_costs, apart_step)
    # The agent's time per token without drafts: what a one-token step costs it in full.
    agent_step = statistics.median(
        1 / x["tok_s"] for w in workloads for x in runs[w][modes[0]] if x["tok_s"] > 0
    )
    costs = with_overhead(engine_costs, step, agent_step)
    apart = with_overhead(apart_costs, apart_step, agent_step)
    answers = {w: (workloads[w], runs[w][modes[0]][0]["text"]) for w in workloads}
    tokens = tokenized(model_path, answers)

    base = modes[0]
    table = {}
    for w in workloads:
        row: dict = {"identical": True}
        base_rate = statistics.median(x["tok_s"] for x in runs[w][base])
        for m in modes:
            xs = runs[w][m]
            rate = statistics.median(x["tok_s"] for x in xs)
            drafted = sum(x["drafted"] for x in xs)
            accepted = sum(x["accepted"] for x in xs)
            row[m] = {
                "tok_s": round(rate, 1),
                "runs_tok_s": [round(x["tok_s"], 1) for x in xs],
                "tokens": xs[0]["tokens"],
                "vs_base": round(rate / base_rate, 3) if base_rate else None,
                # The same, pair by pair: each round's run against that round's base run
                # (the two back to back), the median of those ratios. Less moved by the
                # machine's drift from one minute to the next than a ratio of medians.
                "paired": paired(xs, runs[w][base]),
                "acceptance": round(accepted / drafted, 3) if drafted else None,
                "accepted_per_token": round(accepted / sum(x["tokens"] for x in xs), 3),
                "model_windows": sum(x["model_windows"] for x in xs),
                "model_drafted": sum(x["model_drafted"] for x in xs),
                "model_accepted": sum(x["model_accepted"] for x in xs),
            }
            row["identical"] &= all(x["text"] == runs[w][base][0]["text"] for x in xs)
        goal = 2.0 if w in COPY_SHAPED else 0.97
        row["goal"] = f">= {goal}x"
        # What this machine allows: every draft accepted, at the best length, given what
        # windows cost here. (Not at the workload's acceptance: a text's misses come in
        # bursts, not independently per token, so that estimate falls below what is measured.)
        row["ceiling"] = round(ceiling(costs, 1.0), 3)
        # What this answer allows: the model's greedy answer is what it is, and only the
        # parts of it that copy the request's text can be drafted from it.
        copied = copy_runs(*tokens[w])
        row["answer_copies"] = round(sum(1 for n in copied if n) / max(len(copied), 1), 3)
        row["copy_ceiling"] = round(copy_ceiling(costs, copied), 3)
        # The same for drafts found by the last token (any n-gram drafter's case), still
        # choosing the best matching stretch and its length with hindsight.
        row["context_ceiling"] = round(copy_ceiling(costs, copy_runs(*tokens[w], 1)), 3)
        # The answer's ceiling with the window costs measured apart, for every size measured
        # (windows longer than the agent's are in that measurement only).
        row["copy_ceiling_apart"] = round(copy_ceiling(apart, copied), 3)
        allowed = min(row["ceiling"], row["copy_ceiling"])
        row["target"] = round(min(goal, allowed) if goal > 1 else goal, 3)
        # What a user gets by default: `auto`'s gain, where it ran (else the best mode's).
        judged = "auto" if "auto" in modes and base != "auto" else None
        gain = row[judged]["vs_base"] if judged else max(row[m]["vs_base"] for m in modes[1:])
        row["of_target"] = round(gain / row["target"], 3)
        if judged and w in COPY_SHAPED:
            all_base = [runs[v][base] for v in workloads]
            row["of_round_ceiling"] = round_shares(
                per_round, runs[w][judged], runs[w][base], all_base, copied
            )
        table[w] = row

    result = {
        "benchmark": "speculation",
        "model": model_path.name,
        "draft_model": args.draft_model.name if args.draft_model else None,
        "threads": args.threads,
        "rounds": args.rounds,
        "max_tokens": args.max_tokens,
        "modes": modes,
        "machine": result_file.machine(),
        "workloads": table,
        "window_cost": {str(n): round(c, 3) for n, c in costs.items()},
        "engine_window_cost": {str(n): round(c, 3) for n, c in engine_costs.items()},
        "engine_step_ms": round(step * 1000, 2),
        "agent_step_ms": round(agent_step * 1000, 2),
        "ceiling_all_accepted": round(ceiling(costs, 1.0), 3),
        # Where the costs came from: the agent's decode steps in the runs ("runs"), or, where
        # it timed too few windows (no mode drafts), a measurement after them ("apart").
        "costs_from": "runs" if timed else "apart",
        "agent_steps": steps,
        "window_cost_apart": {str(n): round(c, 3) for n, c in apart.items()},
        "engine_step_apart_ms": round(apart_step * 1000, 2),
        "ceiling_apart": round(ceiling(apart, 1.0), 3),
    }
    head = f"{'workload':10}{'goal':>10}" + "".join(f"{m + ' tok/s':>13}{'x':>7}" for m in modes)
    print(
        head + f"{'accepted/drafted':>18}{'ceiling':>9}{'answer ceil.':>14}{'by context':>12}"
        f"{'of target':>11}{'same text':>11}"
    )
    for w, row in table.items():
        cells = "".join(f"{row[m]['tok_s']:>13}{row[m]['vs_base']:>7}" for m in modes)
        acc = row[modes[-1]]["acceptance"]
        print(f"{w:10}{row['goal']:>10}{cells}{acc if acc is not None else '-':>18}"
              f"{row['ceiling']:>9}{row['copy_ceiling']:>14}{row['context_ceiling']:>12}"
              f"{row['of_target']:>11}"
              f"{'yes' if row['identical'] else 'NO':>11}")  # fmt: skip

    def line(cs: dict[int, float]) -> str:
        return ", ".join(f"{n}: {c:.2f}" for n, c in cs.items())

    where = (
        "timed by the agent in these runs"
        if timed
        else "measured after the runs (the agent timed too few windows)"
    )
    print(
        f"a window of n tokens costs, against one token, {where}: {line(costs)} (the "
        f"engine's step {step * 1000:.1f} ms and the agent's {agent_step * 1000:.1f} ms per "
        "token without drafts: each step's fixed part, paid once per window, counted); with "
        f"every draft accepted, the most a draft could gain here: "
        f"{result['ceiling_all_accepted']}x"
    )
    for w, row in table.items():
        by_round = row.get("of_round_ceiling")
        if by_round and by_round["median"] is not None:
            print(
                f"{w}: auto's gain round by round over the lower ceiling of that round's own "
                f"steps: {', '.join(f'{x:.3f}' for x in by_round['rounds'])} (median "
                f"{by_round['median']:.3f})"
            )
    for w, row in table.items():
        pairs = ", ".join(f"{m} {row[m]['paired']}x" for m in modes[1:])
        print(f"{w}: round by round against {base} (median of the pairs' ratios): {pairs}")
    answers_apart = ", ".join(f"{w} {row['copy_ceiling_apart']}x" for w, row in table.items())
    print(
        f"measured apart, after the runs (one sequence, fixed position): {line(apart)} (the "
        f"engine's step {apart_step * 1000:.1f} ms): a ceiling of {result['ceiling_apart']}x; "
        f"the answers' ceilings with those costs: {answers_apart}"
    )
    print(
        "ceiling: every draft accepted, at the best length; answer ceil.: the most drafts "
        "copied from the request's own text could gain on the model's greedy answer, "
        "knowing it in advance; by context: the same for drafts found by the last token, "
        "as an n-gram drafter finds them; target: the goal, or the lower of the first two "
        "ceilings where that is less; of target: auto's gain (the default; the best mode's "
        "where auto did not run) over the target"
    )
    if args.draft_model:
        for w, row in table.items():
            shares = [
                f"{m}: {row[m]['model_accepted']} of {row[m]['model_drafted']} in "
                f"{row[m]['model_windows']} windows"
                for m in modes
            ]
            print(f"{w}: the draft model's tokens accepted, {'; '.join(shares)}")
    result_file.write(args.out, result)


if __name__ == "__main__":
    main()
