"""A real stage host, in a process of its own, fed sequence ids and positions past its slots:
llama.cpp asserts `seq_id < n_seq` and aborts the process; the stage refuses them where they
are decoded, with a protocol error naming the value, and goes on serving."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from meshagent.engine.base import ForwardItem
from meshagent.engine.llama import LlamaEngine
from meshagent.models.layout import inspect_model

ROOT = Path(__file__).resolve().parents[2]


def test_a_stage_process_refuses_sequences_past_its_slots_and_serves_on(model_path, store, vocab):
    layout = inspect_model(model_path)
    cut = 15
    tokens = vocab.tokenize("The three longest rivers in Europe are", add_bos=True)
    whole = LlamaEngine(model_path, slots=1, slot_ctx=256, flash_attn=False)
    try:
        [logits] = whole.forward([ForwardItem(0, 0, tokens, True)])
        expected = int(logits.argmax())
    finally:
        whole.close()
    args = {
        "first": str(store.ensure_layers(model_path, 0, cut, layout)[0]),
        "last": str(store.ensure_layers(model_path, cut, 30, layout)[0]),
        "entry": str(store.ensure_entry(model_path, layout)[0]),
        "tokens": tokens,
        "n_vocab": vocab.n_vocab,
        "bad": ["close", "keep", "forward", "position"],
    }
    proc = subprocess.run(
        [sys.executable, "-m", "tests.serving.stage_host_child", json.dumps(args)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    # Killed by SIGABRT (-6) inside llama.cpp before the messages were checked.
    assert proc.returncode == 0, proc.stderr[-3000:]
    *bad, good = json.loads(proc.stdout.strip().splitlines()[-1])
    assert bad == [
        [["failure", None, "protocol error: sequence 1000000 is not one of the 2 slots"]],
        [["failure", None, "protocol error: sequence 1000000 is not one of the 2 slots"]],
        [["failure", None, "protocol error: sequence 1000000 is not one of the 2 slots"]],
        [
            [
                "failure",
                None,
                "protocol error: positions 1000000-1000000 of sequence 0 are past its "
                "slot's 256 positions",
            ]
        ],
    ]
    assert good == [["token", 0, expected]]  # the whole model's next token
