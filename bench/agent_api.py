"""Agent-grade API on a whole model and a three-agent split: forced tool calls and strict
JSON-schema output on varied prompts, any-JSON output, logprobs against llama.cpp, and n
completions from one prefill.

One agent serves the embedded model whole; three agents, each too small for it, serve it
split (a mesh of their own). Every prompt goes to both, greedy:
- tool calls with `tool_choice` "required" (five tools) and a named function: each call's
  arguments must validate against its function's schema (jsonschema);
- `response_format` json_schema (strict) over four schemas with nested objects, arrays,
  enums and bounded integers: the text must parse and validate;
- `json_object`: the text must parse (a reply cut by max_tokens is counted as it is);
- logprobs: the top-1 logprob of each token of a text completion against the log-softmax
  of llama.cpp's logits, computed here;
- n=4: the engine's token count against one prefill plus each choice's own tokens.

- strict json_schema with unbounded arrays and strings at max_tokens 48, 96 and 200: each
  reply must close in time and validate.

Goal (issue 18): 50 of 50 valid tool calls and schema outputs, whole and split; json_object
always parses; logprobs equal llama.cpp's; n=4 with one prefill. Every unbounded schema
reply validates, whole and split.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import httpx
import jsonschema
from split import start_split

from meshagent.launch import start_agent
from meshagent.models.default import default_model_path
from meshagent.testing.structured_output import ADD, TAGS, WEATHER, reference_logprobs

MODEL = "SmolLM2-135M-Instruct.Q4_1"
SMALL = ["--max-memory", "80M", "--slots", "2", "--ctx-size", "1024", "--threads", "1"]
WHOLE = ["--slots", "2", "--ctx-size", "1024", "--threads", "1"]

ORDER = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 20},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
                },
                "required": ["name", "quantity"],
                "additionalProperties": False,
            },
        },
        "express": {"type": "boolean"},
    },
    "required": ["items", "express"],
    "additionalProperties": False,
}
EVENT = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 30},
        "day": {"type": "string", "enum": ["mon", "tue", "wed", "thu", "fri", "sat", "sun"]},
        "hour": {"type": "integer", "minimum": 0, "maximum": 23},
        "guests": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 4},
    },
    "required": ["title", "day", "hour", "guests"],
    "additionalProperties": False,
}
SEARCH = {
    "type": "object",
    "properties": {
        "query": {"type": "string", "maxLength": 40},
        "filters": {
            "type": "object",
            "properties": {
                "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
                "kind": {"type": "string", "enum": ["book", "film", "paper"]},
            },
            "required": ["kind"],
            "additionalProperties": False,
        },
    },
    "required": ["query", "filters"],
    "additionalProperties": False,
}
FUNCTIONS = {
    "get_weather": ("A city's forecast", WEATHER),
    "place_order": ("Order items from the shop", ORDER),
    "schedule_event": ("Put an event in the calendar", EVENT),
    "add": ("Add two integers", ADD),
    "search": ("Search the library", SEARCH),
}
TOOLS = [
    {"type": "function", "function": {"name": n, "description": d, "parameters": p}}
    for n, (d, p) in FUNCTIONS.items()
]

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"type": "string", "enum": ["pilot", "teacher", "cook", "other"]},
        "home": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "floor": {"type": "integer", "minimum": 0, "maximum": 200},
            },
            "required": ["city", "floor"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "home"],
    "additionalProperties": False,
}
RECIPE = {
    "type": "object",
    "properties": {
        "dish": {"type": "string", "maxLength": 30},
        "steps": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 4},
        "minutes": {"type": "integer", "minimum": 1, "maximum": 600},
        "vegan": {"type": "boolean"},
    },
    "required": ["dish", "steps", "minutes", "vegan"],
    "additionalProperties": False,
}
SCHEMAS = {"person": PERSON, "order": ORDER, "event": EVENT, "recipe": RECIPE}

SUBJECTS = [
    "Paris", "a pilot", "a birthday party", "three apples and a pear", "the year 1999",
    "my grandmother", "a rainy Monday", "a chess club", "tomato soup", "Oslo in winter",
    "a jazz concert", "a new bicycle", "the moon landing", "a vegan curry", "Tokyo",
    "a school teacher", "two pizzas", "a film about robots", "a picnic on Sunday", "Cairo",
    "a bakery", "seven and eleven", "a science paper on bees", "a cook in Rome", "Lima",
    "a wedding", "a bag of rice", "a detective novel", "a team meeting at nine", "Nairobi",
    "a sailor", "forty-two plus eight", "a garden", "a night train", "pancakes", "Sydney",
    "a library visit", "a museum trip", "a mountain hike", "lemon cake", "Berlin",
    "a doctor", "twelve eggs", "a poetry book", "a football match", "Montreal",
    "a painter", "a dentist appointment", "fish and chips", "a snowstorm",
]  # fmt: skip


def prompts(n: int) -> list[str]:
    forms = [
        "Tell me about {}.", "I need help with {}.", "Please handle {}.", "What about {}?",
        "Something concerning {}, please.",
    ]  # fmt: skip
    return [forms[i % len(forms)].format(SUBJECTS[i % len(SUBJECTS)]) for i in range(n)]


def post(url: str, path: str, body: dict) -> dict:
    r = httpx.post(f"{url}{path}", json=body, timeout=300)
    if r.status_code != 200:
        raise RuntimeError(f"{path}: {r.status_code} {r.text}")
    return r.json()


def tool_calls(url: str, texts: list[str]) -> tuple[int, int, list[str]]:
    """Forced calls: per prompt "required" and one named function. (valid, asked, failures)"""
    ok, asked, bad = 0, 0, []
    names = list(FUNCTIONS)
    for i, text in enumerate(texts):
        for choice in ("required", {"type": "function", "function": {"name": names[i % 5]}}):
            asked += 1
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": text}],
                "tools": TOOLS,
                "tool_choice": choice,
                "max_tokens": 270,  # the prompt lists five tools: 1,024 tokens in all
                "temperature": 0,
            }
            message = post(url, "/v1/chat/completions", body)["choices"][0]["message"]
            try:
                calls = message.get("tool_calls") or []
                assert calls, f"no call: {message.get('content')!r}"
                for call in calls:
                    fn = call["function"]
                    assert isinstance(choice, str) or fn["name"] == choice["function"]["name"]
                    jsonschema.validate(json.loads(fn["arguments"]), FUNCTIONS[fn["name"]][1])
                ok += 1
            except (AssertionError, ValueError, KeyError, jsonschema.ValidationError) as e:
                bad.append(f"{text} / {choice}: {e}")
    return ok, asked, bad


def schema_outputs(url: str, texts: list[str]) -> tuple[int, int, list[str]]:
    ok, bad = 0, []
    names = list(SCHEMAS)
    for i, text in enumerate(texts):
        name = names[i % len(names)]
        fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name]}}
        fmt["json_schema"]["strict"] = True
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"{text} Answer as a {name}."}],
            "response_format": fmt,
            "max_tokens": 400,
            "temperature": 0,
        }
        out = post(url, "/v1/chat/completions", body)["choices"][0]["message"]["content"]
        try:
            jsonschema.validate(json.loads(out), SCHEMAS[name])
            ok += 1
        except (ValueError, jsonschema.ValidationError) as e:
            bad.append(f"{text} / {name}: {e}: {out[:120]!r}")
    return ok, len(texts), bad


# Strict schemas whose replies have no natural end: unbounded arrays and strings. A model may
# run on inside them until max_tokens; the reply must still close and validate.
OPEN_SCHEMAS = {
    "tags": TAGS,
    "notes": {
        "type": "object",
        "properties": {
            "summary": {"type": "string"},
            "steps": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"say": {"type": "string"}, "n": {"type": "integer"}},
                    "required": ["say", "n"],
                },
            },
        },
        "required": ["summary", "steps"],
    },
}
OPEN_LIMITS = (48, 96, 200)


def open_schemas(url: str, texts: list[str]) -> tuple[int, int, list[str]]:
    """Strict unbounded schemas at each of OPEN_LIMITS: replies that parse and validate."""
    ok, asked, failures = 0, 0, []
    names = sorted(OPEN_SCHEMAS)
    for i, text in enumerate(texts):
        name = names[i % len(names)]
        fmt = {"type": "json_schema", "json_schema": {"name": name, "strict": True}}
        fmt["json_schema"]["schema"] = OPEN_SCHEMAS[name]
        for limit in OPEN_LIMITS:
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": f"Write at length: {text}"}],
                "response_format": fmt,
                "max_tokens": limit,
                "temperature": 0,
            }
            asked += 1
            out = post(url, "/v1/chat/completions", body)["choices"][0]["message"]["content"]
            try:
                jsonschema.validate(json.loads(out), OPEN_SCHEMAS[name])
                ok += 1
            except (ValueError, jsonschema.ValidationError) as e:
                failures.append(f"open schema {name} at {limit}: {str(e)[:80]} in {out[:80]!r}")
    return ok, asked, failures


def json_objects(url: str, texts: list[str], max_tokens: int) -> tuple[int, int, int]:
    """(parsed, asked, cut by max_tokens)"""
    ok = cut = 0
    for text in texts:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"{text} Answer in JSON."}],
            "response_format": {"type": "json_object"},
            "max_tokens": max_tokens,
            "temperature": 0,
        }
        choice = post(url, "/v1/chat/completions", body)["choices"][0]
        cut += choice["finish_reason"] == "length"
        with contextlib.suppress(ValueError):
            ok += isinstance(json.loads(choice["message"]["content"]), dict)
    return ok, len(texts), cut


LOGPROB_PROMPTS = [
    "The capital of France is",
    "Water boils at",
    "Once upon a time",
    "def fibonacci(n):",
    "The three primary colours are",
]


def logprob_error(url: str) -> float:
    """The largest |logprob - llama.cpp's| over 12 greedy tokens of each prompt."""
    worst = 0.0
    for prompt in LOGPROB_PROMPTS:
        ref = [v for _, v in reference_logprobs(default_model_path(), prompt, 12)]
        body = {
            "model": MODEL,
            "prompt": prompt,
            "max_tokens": len(ref),
            "temperature": 0,
            "logprobs": 1,
        }
        got = post(url, "/v1/completions", body)["choices"][0]["logprobs"]["token_logprobs"]
        if len(got) != len(ref):
            return float("inf")
        worst = max(worst, *(abs(a - b) for a, b in zip(got, ref, strict=True)))
    return worst


def scrape_processed(url: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("meshagent_tokens_processed_total{") and MODEL in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def n_prefill(url: str) -> tuple[int, int]:
    """(tokens the engine ran for n=4, what one prefill and each choice's tokens come to)"""
    messages = [{"role": "user", "content": f"Name a fruit. ({time.time_ns()})"}]
    before = scrape_processed(url)
    body = {"model": MODEL, "messages": messages, "n": 4, "max_tokens": 16, "temperature": 1}
    body["meshagent"] = {"speculation": "off"}  # rejected drafts would count as tokens run
    r = post(url, "/v1/chat/completions", {**body, "seed": 3})
    ran = int(scrape_processed(url) - before)
    cut = sum(c["finish_reason"] == "length" for c in r["choices"])
    u = r["usage"]
    prefilled = u["prompt_tokens"] - u["prompt_tokens_details"]["cached_tokens"]
    one = prefilled + 3 + u["completion_tokens"] - cut
    return ran, one


def measure(name: str, url: str, args: argparse.Namespace) -> dict:
    texts = prompts(args.prompts)
    t0 = time.monotonic()
    tools = tool_calls(url, texts)
    schemas = schema_outputs(url, texts)
    unbounded = open_schemas(url, prompts(args.open_prompts))
    objects = json_objects(url, prompts(args.json_objects), args.json_object_tokens)
    err = logprob_error(url)
    ran, one = n_prefill(url)
    row = {
        "side": name,
        "tool_calls_valid": tools[0],
        "tool_calls_asked": tools[1],
        "schema_valid": schemas[0],
        "schema_asked": schemas[1],
        "open_schema_valid": unbounded[0],
        "open_schema_asked": unbounded[1],
        "json_object_parsed": objects[0],
        "json_object_asked": objects[1],
        "json_object_cut_by_max_tokens": objects[2],
        "logprob_max_abs_error": err,
        "n4_tokens_run": ran,
        "n4_one_prefill_tokens": one,
        "seconds": round(time.monotonic() - t0, 1),
        "failures": tools[2] + schemas[2] + unbounded[2],
    }
    print(f"{name}: done in {row['seconds']} s", file=sys.stderr)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--prompts", type=int, default=50)
    ap.add_argument("--json-objects", type=int, default=20)
    ap.add_argument(
        "--open-prompts", type=int, default=10, help="prompts for the unbounded schemas"
    )
    ap.add_argument("--json-object-tokens", type=int, default=400)
    ap.add_argument("--out", type=Path, default=Path("bench/results/agent_api.json"))
    args = ap.parse_args()
    rows = []
    with (
        tempfile.TemporaryDirectory(prefix="meshagent-bench-") as tmp,
        contextlib.ExitStack() as agents,
    ):
        root = Path(tmp)
        whole = start_agent(root / "whole", *WHOLE)
        agents.callback(whole.stop)
        rows.append(measure("whole", whole.url, args))
        entry, stages, _ = start_split(root, agents, MODEL, SMALL)
        rows.append(measure(f"split ({len(stages)} stages)", entry.url, args))
    print(
        f"\n{'side':<18} {'tool calls':>11} {'json_schema':>11} {'unbounded@48/96/200':>19} "
        f"{'json_object':>12} {'logprob err':>11} {'n=4 tokens run / one prefill':>29}"
    )
    for r in rows:
        print(
            f"{r['side']:<18} {r['tool_calls_valid']:>5}/{r['tool_calls_asked']:<5} "
            f"{r['schema_valid']:>5}/{r['schema_asked']:<5} "
            f"{r['open_schema_valid']:>9}/{r['open_schema_asked']:<9} "
            f"{r['json_object_parsed']:>5}/{r['json_object_asked']:<3}"
            f"({r['json_object_cut_by_max_tokens']} cut) "
            f"{r['logprob_max_abs_error']:>11.2e} "
            f"{r['n4_tokens_run']:>14} / {r['n4_one_prefill_tokens']}"
        )
        for f in r["failures"]:
            print("   failed:", f)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"machine": platform.processor() or platform.machine(), "rows": rows}, indent=2)
    )
    print(f"\nwritten to {args.out}")


if __name__ == "__main__":
    main()
