"""Routing by prefix between replicas, end to end: two agent processes each serve the model
whole; ten multi-turn conversations, four at a time, all sent to one agent's API with the
`openai` client. Each later turn goes to the replica that served its conversation before (and
restarts there from the kept prefix), while the two replicas share the turns."""

from __future__ import annotations

from collections import Counter
from concurrent.futures import ThreadPoolExecutor

from openai import OpenAI

from meshagent.cli.main import main
from tests.e2e.agents import invite, wait_for
from tests.e2e.test_split_serving import WHOLE, _get

CONVERSATIONS = 10
TURNS = 3
SYSTEM = "You are a helpful assistant. Answer in one short sentence."


def test_turns_follow_their_conversation_and_the_replicas_share_them(spawn_agent, model_id, capsys):
    a = spawn_agent(*WHOLE, name="a")
    b = spawn_agent(*WHOLE, "--join", invite(a), name="b")
    ids = {_get(x, "/control/status")["peer_id"]: n for n, x in (("a", a), ("b", b))}

    def two_replicas():
        p = _get(a, "/control/status")["placement"][model_id]
        served = all(_get(x, "/control/status")["models"] for x in (a, b))
        return p["routable"] and sorted(p["replicas"]) == sorted(ids) and served

    wait_for(two_replicas, timeout=120)

    # Each agent's record says what it serves once its part is loaded (the SERVES column of
    # `meshagent peers`), not what it served when the record was first made.
    def both_say_they_serve():
        rows = _get(a, "/control/peers")["peers"]
        served = {r["peer_id"]: [s["layers"] for s in r["serving"]] for r in rows}
        return all(served.get(p) == [[0, 30]] for p in ids)

    wait_for(both_say_they_serve, timeout=30)
    client = OpenAI(base_url=f"{a.url}/v1", api_key="x", max_retries=0, timeout=120)

    def converse(n: int) -> list[tuple[str, int, int]]:
        """(the replica that answered, prompt tokens, cached tokens) per turn."""
        messages = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Conversation {n}: name a colour and a fruit."},
        ]
        turns = []
        for t in range(TURNS):
            raw = client.chat.completions.with_raw_response.create(
                model=model_id, messages=messages, max_tokens=12, temperature=0
            )
            reply = raw.parse()
            served_by = raw.headers.get("x-meshagent-served-by")
            if served_by is None:  # answered by `a` itself: its receipt names its stage
                served_by = raw.headers["x-meshagent-stages"].split(":")[0]
            usage = reply.usage
            turns.append(
                (
                    ids[served_by],
                    usage.prompt_tokens,
                    usage.prompt_tokens_details.cached_tokens,
                )
            )
            messages += [
                {"role": "assistant", "content": reply.choices[0].message.content},
                {"role": "user", "content": f"And another one, please ({t})."},
            ]
        return turns

    with ThreadPoolExecutor(4) as pool:
        runs = list(pool.map(converse, range(CONVERSATIONS)))

    later = [(run[t - 1][0], run[t]) for run in runs for t in range(1, TURNS)]
    on_holder = [turn for holder, turn in later if turn[0] == holder]
    assert len(on_holder) >= 0.9 * len(later), runs
    # A turn on its holder restarts from the last turn's kept prefix.
    assert all(cached > 0 for _, _, cached in on_holder), runs
    load = Counter(turn[0] for run in runs for turn in run)
    assert max(load["a"], load["b"]) <= 2 * min(load["a"], load["b"]), load

    routing = _get(a, "/control/status")["routing"]
    assert routing["prefix"] == len(on_holder)
    assert routing["new"] + routing["prefix"] + routing["balance"] == CONVERSATIONS * TURNS
    assert routing["in_flight"] == {}
    assert main(["status", "--data-dir", str(a.data_dir)]) == 0
    [line] = [x for x in capsys.readouterr().out.splitlines() if x.startswith("routing ")]
    assert f"{CONVERSATIONS * TURNS} requests among replicas: {len(on_holder)} to the" in line
