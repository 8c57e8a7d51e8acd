"""The copy-shaped prompts that speculation is measured on, shared by `bench/speculation.py`
(and its replay) and net-sim's load driver (`net-sim/netsim/workload.py`), so that a figure
of one is a figure of the same text in the other: a JSON document to repeat with one value
changed, and a Python function to repeat with one name changed throughout. Constants only:
the load driver imports it inside each lab host, where it must start fast."""

from __future__ import annotations

import json

DOC = {
    "name": "meshagent",
    "version": "0.4.2",
    "description": "a peer-to-peer mesh that runs language models on the machines you have",
    "license": "Apache-2.0",
    "api": {"host": "127.0.0.1", "port": 9337, "endpoints": ["/v1/models", "/v1/completions"]},
    "overlay": {"listen": "0.0.0.0:9338", "relays": ["relay.example.org:9339"], "mdns": True},
    "limits": {"slots": 4, "ctx_size": 2048, "max_queue": 64, "grace_seconds": 10},
}
# Laid out as json.dumps lays it out: SmolLM2 repeats that layout faithfully, where it
# rewrote a hand-packed one after a few lines (and then no longer copied anything: the text
# was not copy-shaped).
COPY_PROMPT = (
    f"Here is a JSON document:\n{json.dumps(DOC, indent=2)}\nRepeat the whole document exactly "
    'as it is, except that "port" 9337 becomes 9400. Answer with the JSON only.'
)

CODE = """def summarize(records):
    total = 0
    count = 0
    for record in records:
        if record.get("valid"):
            total += record["amount"]
            count += 1
    average = total / count if count else 0.0
    print(f"total={total} count={count} average={average:.2f}")
    return {"total": total, "count": count, "average": average}
"""
# A code edit: most of the answer repeats the function, with one name changed throughout.
CODE_PROMPT = (
    f"Here is a Python function:\n```python\n{CODE}```\nRewrite it with the variable `total` "
    "renamed to `running_sum`, changing nothing else. Answer with the code only."
)
