"""How well `auto` chooses its windows, without the machine's noise: a replay.

`bench/speculation.py` times a live agent, and on a small CPU its rounds vary by up to 10%, so
a change to the drafter or to `auto` that gains 3% cannot be seen there. This script takes
the timing out. It computes the model's greedy answer to each workload once (llama.cpp, in
this process), then drives the real `Scheduler` through each answer as an agent would: one
scheduler for all requests, the workloads in rounds, each with `speculation` "off" and then
"auto", every step's time taken from a table of what a window of n tokens costs against one
token (the scheduler learns those costs from the steps, as an agent does), and each window's
verdict read from the answer. A request's time is the sum of its decode steps' costs, so
`auto` against "off" is a ratio of costs, the same in every run. Each request asks for up to
256 tokens, as the benchmark's do, so that near an answer's end a draft may run past it as
the agent's would.

Each copy workload's figure is set against the best any choice of window lengths could do with
the same drafts: a dynamic program over the answer that knows where every draft goes wrong (the
oracle). Prose is set against plain decoding. Cost tables: this machine's (measured apart, as
`bench/speculation.py` measures it after its runs), any given with `--costs
NAME=1:1,2:1.6,17:6.6` (sizes between those given: interpolated), and those a live agent timed
in `bench/speculation.py`'s runs (`--costs-from RESULT.json`, named after the file: the
replay's figures match the live ones best with these); the Xeon's from docs/benchmarks.md is
built in.
Besides the benchmark's three workloads it replays four more copies (a config value changed,
a flag flipped in a JSON list, a parameter renamed in a Python class, a variable renamed in
JavaScript) and two more prose prompts, so that a change is judged on more than two answers.
Prints a table and writes JSON (default bench/results/speculation_replay.json).

    .venv/bin/python bench/speculation_replay.py --model "$(.venv/bin/python bench/coder_model.py)"
        [--costs NAME=N:C,...] [--costs-from bench/results/speculation.json] [--no-measure]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import speculation as live

from meshagent.engine.vocab import Vocab
from meshagent.serving.copying import TokenNames
from meshagent.serving.drafting import MAX_DRAFT, SuffixDrafter
from meshagent.serving.sampling import SamplingParams
from meshagent.serving.scheduler import Scheduler

CONFIG = {
    "server": {"host": "0.0.0.0", "port": 8080, "workers": 4, "timeout": 30},
    "database": {"url": "postgres://db.internal:5432/app", "pool": 10, "ssl": True},
    "cache": {"backend": "redis", "ttl": 300, "prefix": "app:"},
    "features": ["search", "export", "billing"],
    "owner": "platform-team",
}
PEOPLE = [
    {"id": 1, "name": "Ada", "role": "admin", "active": True},
    {"id": 2, "name": "Grace", "role": "editor", "active": True},
    {"id": 3, "name": "Linus", "role": "viewer", "active": False},
    {"id": 4, "name": "Barbara", "role": "editor", "active": True},
]
INVENTORY = """class Inventory:
    def __init__(self):
        self.items = {}

    def add(self, name, qty):
        if qty <= 0:
            raise ValueError("qty must be positive")
        self.items[name] = self.items.get(name, 0) + qty

    def remove(self, name, qty):
        have = self.items.get(name, 0)
        if qty > have:
            raise ValueError(f"only {have} of {name} left")
        self.items[name] = have - qty

    def count(self, name):
        return self.items.get(name, 0)
"""
PARSE_ARGS = """function parseArgs(argv) {
  const opts = { verbose: false, output: "out.txt", retries: 3 };
  for (let i = 0; i < argv.length; i++) {
    const arg = argv[i];
    if (arg === "--verbose") opts.verbose = true;
    else if (arg === "--output") opts.output = argv[++i];
    else if (arg === "--retries") opts.retries = Number(argv[++i]);
    else throw new Error("unknown option: " + arg);
  }
  return opts;
}
"""
MORE = {
    "config": "Here is a config file:\n"
    + json.dumps(CONFIG, indent=2)
    + '\nChange "ttl" from 300 to 600 and return the whole file. Answer with the JSON only.',
    "people": "Here is a JSON list:\n"
    + json.dumps(PEOPLE, indent=2)
    + "\nReturn the same list with Linus marked active. Answer with the JSON only.",
    "class": "Here is a Python class:\n```python\n"
    + INVENTORY
    + "```\nRename the parameter `qty` to `quantity` everywhere, changing nothing else. "
    "Answer with the code only.",
    "js": "Here is a JavaScript function:\n```js\n"
    + PARSE_ARGS
    + "```\nRename `opts` to `options` everywhere, changing nothing else. "
    "Answer with the code only.",
    "prose2": "Explain in detail how a bicycle gear system works, for a curious teenager.",
    "prose3": "Write a long letter from a sailor to his sister describing a storm at sea.",
}
PROSE = ("prose", "prose2", "prose3")
LIMIT = 256  # the tokens a request asks for: bench/speculation.py's default --max-tokens
# Measured on a 2.6 GHz Xeon with AVX-512 (docs/benchmarks.md, 2026-12-03): windows are cheap.
XEON = {1: 1.0, 2: 1.26, 5: 2.17, 17: 6.05}


def greedy_answers(model: Path, threads: int, limit: int) -> tuple[dict[str, dict], int]:
    """Each workload's chat prompt and the model's greedy answer, as tokens, and the end
    token the answers end with."""
    import numpy as np

    from meshagent.engine.base import ForwardItem
    from meshagent.engine.llama import LlamaEngine
    from meshagent.serving.chat import ChatMessage, ChatTemplate

    engine = LlamaEngine(model, threads=threads)
    out, end = {}, None
    try:
        info = engine.info
        template = ChatTemplate(
            info.chat_template, bos_token=info.bos_token, eos_token=info.eos_token
        )
        for name, text in {**live.WORKLOADS, **MORE}.items():
            prompt = engine.tokenize(template.render([ChatMessage("user", text)]), add_bos=False)
            engine.clear_sequence(0)
            logits = engine.forward([ForwardItem(0, 0, prompt, True)])[0]
            answer: list[int] = []
            while len(answer) < limit:
                token = int(np.argmax(logits))
                if engine.is_end_of_generation(token):
                    end = token
                    break
                answer.append(token)
                at = len(prompt) + len(answer) - 1
                logits = engine.forward([ForwardItem(0, at, [token], True)])[0]
            out[name] = {"prompt": prompt, "answer": answer}
            print(f"  {name}: {len(prompt)} prompt tokens, {len(answer)} answered", flush=True)
    finally:
        engine.close()
    if end is None:
        raise SystemExit("no answer ended within the limit: raise --max-tokens")
    return out, end


def replay_one(
    sch: Scheduler, seq: int, x: dict, end: int, costs: dict, mode: str, limit: int = LIMIT
) -> float:
    """Decode one answer through `sch` (its windows verified against the answer) and return
    its decode steps' cost after the first token, in one-token steps. The request asks for up
    to `limit` tokens, as the benchmark's do, so that near the answer's end a draft may run
    past it as the agent's would."""
    prompt, full = x["prompt"], [*x["answer"], end]
    greedy = SamplingParams(temperature=0.0)
    sch.submit(seq, tuple(prompt), max(limit, len(full) + 1), greedy, speculation=mode)
    total, first, done = 0.0, True, False
    while not done:
        step = sch.next_step()
        if step is None:
            break
        if not step.items:
            continue
        item = step.items[0]
        n = len(item.tokens)
        decode = item.pos >= len(prompt)
        if decode:
            cost = live.window_cost(costs, n)
            total += 0.0 if first else cost
            sch.observe(n, cost * 0.04)  # as if a one-token step took 40 ms
        if not item.last:
            continue
        at = item.pos + n - item.draft - len(prompt)
        for r in range(item.draft + 1):
            token = full[at + r]
            done = any(e.finish for e in sch.token(item.slot, token)) or done
            if r < item.draft and item.tokens[n - item.draft + r] != token:
                break
        first = first and not decode
    return total


def replay(answers: dict, end: int, costs: dict, rounds: int, token_name) -> dict[str, float]:
    """`auto` against "off" per workload: one scheduler, the workloads in rounds."""
    sch = Scheduler(
        n_slots=1, slot_ctx=4096, max_queue=4, is_end=lambda t: t == end, token_name=token_name
    )
    sch.observe(1, 0.04)
    got: dict[str, dict[str, list[float]]] = {w: {"off": [], "auto": []} for w in answers}
    seq = 0
    for r in range(rounds):
        for w, x in answers.items():
            for mode in ("off", "auto") if r % 2 == 0 else ("auto", "off"):
                seq += 1
                got[w][mode].append(replay_one(sch, seq, x, end, costs, mode))
    return {w: statistics.median(v["off"]) / statistics.median(v["auto"]) for w, v in got.items()}


def oracle(x: dict, end: int, costs: dict, token_name) -> float:
    """The best gain any choice of window lengths gives with the drafter's proposals, knowing
    where each goes wrong (a dynamic program over the answer)."""
    full = [*x["answer"], end]
    drafter = SuffixDrafter.answering(x["prompt"], (), token_name)
    drafter.extend(full[:1])
    longest = min(max(costs) - 1, MAX_DRAFT)  # the drafts `auto` may send
    right = {}
    for i in range(1, len(full)):
        proposal = drafter.propose(longest)
        n = 0
        while n < len(proposal) and i + n < len(full) and proposal[n] == full[i + n]:
            n += 1
        right[i] = (len(proposal), n)
        drafter.extend(full[i : i + 1])
    cheapest = [0.0] * (len(full) + longest + 2)
    for i in range(len(full) - 2, 0, -1):
        size, n = right[i]
        cheapest[i] = min(
            live.window_cost(costs, k + 1) + cheapest[min(i + min(k, n) + 1, len(full) - 1)]
            for k in range(size + 1)
        )
    return (len(full) - 2) / cheapest[1] if cheapest[1] else 1.0


def parse_costs(text: str) -> tuple[str, dict[int, float]]:
    name, _, sizes = text.partition("=")
    table = {int(n): float(c) for n, c in (p.split(":") for p in sizes.split(","))}
    if 1 not in table or len(table) < 2:
        raise argparse.ArgumentTypeError(f"{text!r}: give 1:1 and at least one window size")
    return name, table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", type=Path, help="a GGUF file (default: the embedded model)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=300)
    ap.add_argument(
        "--costs", type=parse_costs, action="append", default=[], metavar="NAME=N:C,..."
    )
    ap.add_argument(
        "--costs-from",
        type=Path,
        action="append",
        default=[],
        metavar="FILE",
        help="a bench/speculation.py result: the window costs its agent timed in its runs",
    )
    ap.add_argument("--no-measure", action="store_true", help="only the given cost tables")
    ap.add_argument("--out", type=Path, default=Path("bench/results/speculation_replay.json"))
    args = ap.parse_args()
    model = args.model or live.default_model_path()
    print(f"greedy answers of {model.name}:", flush=True)
    answers, end = greedy_answers(model, args.threads, args.max_tokens)
    token_name = TokenNames(Vocab.load(model).token_bytes)  # as the agent's runner gives it
    tables = {"xeon": XEON, **dict(args.costs)}
    for path in args.costs_from:
        timed = live.timed_costs(json.loads(path.read_text())["agent_steps"])
        if timed is None:
            raise SystemExit(f"{path}: its agent timed too few windows for a cost table")
        tables[path.stem] = timed[0]
    if not args.no_measure:
        tables = {"here": live.window_costs(model, args.threads)[0], **tables}
    rows: dict[str, dict[str, dict]] = {}
    for name, costs in tables.items():
        gains = replay(answers, end, costs, args.rounds, token_name)
        for w, gain in gains.items():
            best = None if w in PROSE else oracle(answers[w], end, costs, token_name)
            rows.setdefault(w, {})[name] = {
                "auto": round(gain, 3),
                "oracle": None if best is None else round(best, 3),
                "of_oracle": None if best is None else round(gain / best, 3),
            }
    print(f"\n{'workload':10}" + "".join(f"{n + ': auto / oracle':>26}" for n in tables))
    for w, per in rows.items():
        cells = "".join(
            f"{per[n]['auto']:>12.3f}x / {per[n]['oracle']:.3f}x ({per[n]['of_oracle']:.0%})"
            if per[n]["oracle"]
            else f"{per[n]['auto']:>12.3f}x{'':>13}"
            for n in tables
        )
        print(f"{w:10}{cells}")
    copies = [c["of_oracle"] for per in rows.values() for c in per.values() if c["of_oracle"]]
    prose = [c["auto"] for w in PROSE for c in rows[w].values()]
    summary = {
        "copies_of_oracle_mean": round(statistics.mean(copies), 3),
        "copies_of_oracle_min": min(copies),
        "prose_mean": round(statistics.mean(prose), 3),
        "prose_min": min(prose),
    }
    print(
        f"copies: {summary['copies_of_oracle_mean']:.1%} of the oracle on average "
        f"(lowest {summary['copies_of_oracle_min']:.1%}); prose: {summary['prose_mean']:.3f}x "
        f"of plain decoding on average (lowest {summary['prose_min']:.3f}x)"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "benchmark": "speculation_replay",
        "model": model.name,
        "rounds": args.rounds,
        "costs": {n: {str(k): v for k, v in c.items()} for n, c in tables.items()},
        "workloads": rows,
        "summary": summary,
    }
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    sys.exit(main())
