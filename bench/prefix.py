"""Kept prefixes: time to first token of a conversation's second turn against its first.

One agent serves the embedded model whole. Each round is a new conversation of about 1,500
prompt tokens (a system prompt that names the round, so that no earlier round shares it, and
a long document), then a second turn: the same history, the first answer and one short
message. Time to first token is measured on a stream, from the request to the first
content. The same conversations then run on an agent started with `--prefix-cache 0`, and
both turns' texts must be identical (greedy).

Goal (issue 17): second turn <= 0.2x the cold first turn, with `cached_tokens` reporting the
reused length.
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

TOPICS = ["rivers", "bridges", "lighthouses", "orchards", "railways", "glaciers", "markets"]


def document(words: int) -> str:
    """A long, varied text: sentences about the topics, in an order that does not repeat."""
    out, i = [], 0
    while sum(len(s.split()) for s in out) < words:
        a, b = TOPICS[i % len(TOPICS)], TOPICS[(i * 3 + 1) % len(TOPICS)]
        out.append(
            f"Section {i + 1}: the study of {a} found that {b} near them changed over "
            f"{3 + i % 11} decades, measured at {17 + i * 7 % 90} sites."
        )
        i += 1
    return " ".join(out)


def conversation(r: int, words: int) -> list[dict]:
    return [
        {
            "role": "system",
            "content": f"Conversation {r}. You are a concise research assistant. "
            "Answer from the document the user gives.",
        },
        {"role": "user", "content": "Here is a document:\n" + document(words)},
    ]


def turn(url: str, model: str, messages: list[dict], max_tokens: int) -> dict:
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    got = stream_chat(url, body)
    text, usage, first = got.text, got.usage, got.first
    return {
        "text": text,
        "ttft_s": first - start,
        "prompt_tokens": usage["prompt_tokens"],
        "cached_tokens": usage.get("prompt_tokens_details", {}).get("cached_tokens", 0),
    }


def run_agent(setting: str, rounds: int, words: int, max_tokens: int, threads: int) -> list:
    with tempfile.TemporaryDirectory(prefix="meshagent-bench-") as tmp:
        agent = start_agent(
            Path(tmp), "--threads", str(threads), "--prefix-cache", setting, "--speculation", "off"
        )
        try:
            url = agent.url
            model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
            turn(url, model, [{"role": "user", "content": "Hello"}], 4)  # warm up
            out = []
            for r in range(rounds):
                messages = conversation(r, words)
                first = turn(url, model, messages, max_tokens)
                messages += [
                    {"role": "assistant", "content": first["text"]},
                    {"role": "user", "content": "Which section mentions glaciers first?"},
                ]
                second = turn(url, model, messages, max_tokens)
                out.append({"first": first, "second": second})
            return out
        finally:
            agent.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--words", type=int, default=1000, help="document length (about 1,500 tokens)")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out", type=Path, default=Path("bench/results/prefix.json"))
    args = ap.parse_args()
    cached = run_agent("auto", args.rounds, args.words, args.max_tokens, args.threads)
    plain = run_agent("0", args.rounds, args.words, args.max_tokens, args.threads)
    identical = all(
        c[t]["text"] == p[t]["text"] for c, p in zip(cached, plain, strict=True) for t in c
    )

    def med(runs: list, t: str, key: str) -> float:
        return statistics.median(x[t][key] for x in runs)

    ratio = med(cached, "second", "ttft_s") / med(cached, "first", "ttft_s")
    result = {
        "benchmark": "prefix",
        "threads": args.threads,
        "rounds": args.rounds,
        "machine": result_file.machine(),
        "prompt_tokens": {
            "first": med(cached, "first", "prompt_tokens"),
            "second": med(cached, "second", "prompt_tokens"),
        },
        "cached_tokens_second": [x["second"]["cached_tokens"] for x in cached],
        "cached_tokens_first": [x["first"]["cached_tokens"] for x in cached],
        "ttft_s": {
            "cache_first": [round(x["first"]["ttft_s"], 3) for x in cached],
            "cache_second": [round(x["second"]["ttft_s"], 3) for x in cached],
            "off_first": [round(x["first"]["ttft_s"], 3) for x in plain],
            "off_second": [round(x["second"]["ttft_s"], 3) for x in plain],
        },
        "second_vs_first": round(ratio, 3),
        "second_vs_off_second": round(
            med(cached, "second", "ttft_s") / med(plain, "second", "ttft_s"), 3
        ),
        "goal": "<= 0.2",
        "identical": identical,
    }
    t = result["ttft_s"]
    print(f"{'':28}{'first turn':>12}{'second turn':>13}")
    print(f"{'prompt tokens (median)':28}{result['prompt_tokens']['first']:>12}"
          f"{result['prompt_tokens']['second']:>13}")  # fmt: skip
    print(f"{'cached tokens':28}{result['cached_tokens_first']!s:>12}"
          f"{result['cached_tokens_second']!s:>13}")  # fmt: skip
    print(f"{'TTFT s, cache (median)':28}{statistics.median(t['cache_first']):>12.3f}"
          f"{statistics.median(t['cache_second']):>13.3f}")  # fmt: skip
    print(f"{'TTFT s, --prefix-cache 0':28}{statistics.median(t['off_first']):>12.3f}"
          f"{statistics.median(t['off_second']):>13.3f}")  # fmt: skip
    print(
        f"second turn / cold first turn: {result['second_vs_first']} (goal <= 0.2); "
        f"same text with the cache off: {'yes' if identical else 'NO'}"
    )
    result_file.write(args.out, result)


if __name__ == "__main__":
    main()
