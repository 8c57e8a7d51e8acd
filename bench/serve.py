"""Decode speed through the agent's OpenAI API vs llama-cpp-python called directly.

Both run greedy on the same prompt with the same thread count, one after the other, several
rounds; decode tokens/s is measured from the first streamed token to the last. Prints a table
and writes JSON.
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

from meshagent.launch import cpu_seconds, start_agent
from meshagent.sse_client import chunk_text, iter_events

PROMPT = "Write a long, detailed story about a lighthouse keeper who finds a map."


def decode_rate(stream_tokens: list[float]) -> float:
    """Tokens per second between the first and the last token arrival."""
    if len(stream_tokens) < 2:
        return 0.0
    return (len(stream_tokens) - 1) / (stream_tokens[-1] - stream_tokens[0])


def run_direct(model_path: str, max_tokens: int, threads: int) -> tuple[float, int]:
    import llama_cpp.llama
    from llama_cpp import Llama

    from meshagent.engine.runtime import model_params

    # The model parameters the agent loads with (on AMX CPUs llama.cpp's defaults crash).
    llama_cpp.llama.llama_cpp.llama_model_default_params = model_params
    llm = Llama(model_path=model_path, n_ctx=2048, n_threads=threads, verbose=False)
    arrivals = []
    for chunk in llm.create_chat_completion(
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=max_tokens,
        temperature=0.0,
        stream=True,
    ):
        if chunk["choices"][0]["delta"].get("content"):
            arrivals.append(time.perf_counter())
    llm.close()
    return decode_rate(arrivals), len(arrivals)


def run_api(url: str, model: str, max_tokens: int, client: str) -> tuple[float, int]:
    arrivals = []
    if client == "openai":
        from openai import OpenAI

        stream = OpenAI(base_url=f"{url}/v1", api_key="none").chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": PROMPT}],
            max_tokens=max_tokens,
            temperature=0.0,
            stream=True,
        )
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                arrivals.append(time.perf_counter())
        return decode_rate(arrivals), len(arrivals)
    # A light SSE reader: measures the server, not a client library's parsing.
    body = {
        "model": model,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
    }
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
        for event in iter_events(r):
            if event.done:
                continue
            if chunk_text(event.json()):
                arrivals.append(time.perf_counter())
    return decode_rate(arrivals), len(arrivals)


def main() -> None:
    from meshagent.models.default import default_model_path

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument(
        "--client",
        choices=("sse", "openai"),
        default="sse",
        help="sse: a light SSE reader; openai: the official client (adds its parsing cost)",
    )
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out", type=Path, default=Path("bench/results/serve.json"))
    args = ap.parse_args()
    model_path = str(default_model_path())

    direct: list[float] = []
    api: list[float] = []
    n_direct = n_api = 0
    with tempfile.TemporaryDirectory(prefix="meshagent-bench-") as tmp:
        agent = start_agent(Path(tmp), "--threads", str(args.threads))
        url = agent.url
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        run_api(url, model, 8, args.client)  # warm up
        loop_ms: list[float] = []  # the agent's event-loop thread, CPU ms per token
        for _ in range(args.rounds):
            before, _ = cpu_seconds(agent.proc.pid)
            rate, n_api = run_api(url, model, args.max_tokens, args.client)
            after, _ = cpu_seconds(agent.proc.pid)
            api.append(rate)
            loop_ms.append((after - before) * 1000 / max(n_api, 1))
            rate, n_direct = run_direct(model_path, args.max_tokens, args.threads)
            direct.append(rate)
        agent.stop()

    med_direct, med_api = statistics.median(direct), statistics.median(api)
    result = {
        "benchmark": "serve",
        "model": Path(model_path).name,
        "threads": args.threads,
        "client": args.client,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "direct_tok_s": direct,
        "api_tok_s": api,
        "direct_tokens": n_direct,
        "api_tokens": n_api,
        "median_direct_tok_s": med_direct,
        "median_api_tok_s": med_api,
        "ratio": med_api / med_direct,
        "event_loop_cpu_ms_per_token": loop_ms,
        "machine": result_file.machine(),
    }
    print(f"{'path':<28}{'decode tok/s (median)':>24}{'tokens':>8}")
    print(f"{'llama-cpp-python direct':<28}{med_direct:>24.1f}{n_direct:>8}")
    print(f"{'meshagent OpenAI API':<28}{med_api:>24.1f}{n_api:>8}")
    print(f"ratio api/direct: {result['ratio']:.3f} (goal >= 0.95)")
    print(
        "agent's event-loop thread: "
        f"{statistics.median(loop_ms):.2f} CPU ms per token (median of {len(loop_ms)} rounds)"
    )
    result_file.write(args.out, result)


if __name__ == "__main__":
    main()
