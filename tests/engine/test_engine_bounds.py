"""The engine's last line: token ids, sequences and positions out of range are refused with
`OutOfRange` before they reach llama.cpp, which would abort the process on several of them.

Every case runs, one after another, in a child process (`run_cases`) on tiny random models,
so that an abort kills the child and not the test run: a case the child never reported is one
that killed it. The engine still computes afterwards (the last case of each engine)."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from meshagent.testing.tiny_gguf import N_VOCAB, write_tiny_model

SLOTS, SLOT_CTX = 2, 64
N_EMBD = 64  # write_tiny_model's default


def _cases(workdir: Path) -> Iterator[tuple[str, Callable[[], object]]]:
    """(name, call) for each case; built lazily so that each engine loads when reached."""
    from meshagent.engine.base import ForwardItem
    from meshagent.engine.llama import LlamaEngine
    from meshagent.engine.runtime import EmbdItem
    from meshagent.engine.split_in_process import StagedEngine
    from meshagent.models.artifacts import ArtifactStore

    path = write_tiny_model(workdir / "tiny-llama.gguf", "llama", n_layers=4)
    whole = LlamaEngine(path, slots=SLOTS, slot_ctx=SLOT_CTX, threads=1)

    def fwd(seq: int, pos: int, tokens: list[int]) -> Callable[[], object]:
        return lambda: whole.forward([ForwardItem(seq, pos, tokens, True)])

    yield "token -1", fwd(0, 0, [5, -1])
    yield "token n_vocab", fwd(0, 0, [N_VOCAB])
    yield "token 2**31", fwd(0, 0, [2**31])
    yield "token 2**70", fwd(0, 0, [2**70])
    yield "seq n_slots", fwd(SLOTS, 0, [5])
    yield "seq -1", fwd(-1, 0, [5])
    yield "pos -1", fwd(0, -1, [5])
    yield "pos past the slot", fwd(0, SLOT_CTX - 1, [5, 6])
    yield "clear seq n_slots", lambda: whole.clear_sequence(SLOTS)
    yield "clear seq -1", lambda: whole.clear_sequence(-1)
    yield "trim seq 2**31", lambda: whole.trim_sequence(2**31, 0)
    yield "trim to -1", lambda: whole.trim_sequence(0, -1)
    yield "export seq n_slots", lambda: whole.export_sequence(SLOTS, 0)
    yield "import seq n_slots", lambda: whole.import_sequence(SLOTS, b"")
    yield "token_bytes -1", lambda: whole.token_bytes(-1)
    yield "token_bytes n_vocab", lambda: whole.token_bytes(N_VOCAB)
    yield "grammar n_vocab", lambda: whole.constraint('root ::= "a"').allows(N_VOCAB)
    yield "whole still computes", lambda: whole.forward([ForwardItem(0, 0, [1, 5, 6], True)])[0]
    whole.close()

    store = ArtifactStore(workdir / "artifacts")
    staged = StagedEngine(path, [0, 2, 4], store, slots=SLOTS, slot_ctx=SLOT_CTX, threads=1)
    first, last = staged.stages
    rows = np.zeros((1, N_EMBD), dtype=np.float32)

    def embd(stage, seq: int, pos: int) -> Callable[[], object]:
        return lambda: stage.forward([EmbdItem(seq, pos, rows, 1 if stage.last else 0)])

    yield "entry lookup token -1", lambda: staged.forward([ForwardItem(0, 0, [5, -1], True)])
    yield "entry lookup token n_vocab", lambda: staged.forward([ForwardItem(0, 0, [N_VOCAB], True)])
    yield "entry lookup 2**70", lambda: staged.forward([ForwardItem(0, 0, [5, 2**70], True)])
    yield "stage seq n_slots", embd(first, SLOTS, 0)
    yield "last stage seq -1", embd(last, -1, 0)
    yield "stage pos -1", embd(first, 0, -1)
    yield "last stage pos past the slot", embd(last, 0, SLOT_CTX)
    yield "stage clear seq n_slots", lambda: first.clear_sequence(SLOTS)
    yield "stage trim seq -1", lambda: last.trim_sequence(-1, 0)
    yield "staged trim seq n_slots", lambda: staged.trim_sequence(SLOTS, 0)
    yield "staged still computes", lambda: staged.forward([ForwardItem(0, 0, [1, 5], True)])[0]
    staged.close()


def run_cases(workdir: str) -> None:
    """Run every case, printing one JSON line each as it ends (the child's side)."""
    from meshagent.errors import OutOfRange

    for name, call in _cases(Path(workdir)):
        try:
            out = call()
            result = {"case": name, "outcome": "returned", "finite": _finite(out)}
        except OutOfRange as e:
            result = {"case": name, "outcome": "refused", "message": str(e)}
        except Exception as e:  # any other error: the test names it
            result = {"case": name, "outcome": type(e).__name__, "message": str(e)}
        print(json.dumps(result), flush=True)


def _finite(out: object) -> bool:
    return isinstance(out, np.ndarray) and bool(np.isfinite(out).all())


# Every case in the order the child runs them.
ORDER = [
    "token -1",
    "token n_vocab",
    "token 2**31",
    "token 2**70",
    "seq n_slots",
    "seq -1",
    "pos -1",
    "pos past the slot",
    "clear seq n_slots",
    "clear seq -1",
    "trim seq 2**31",
    "trim to -1",
    "export seq n_slots",
    "import seq n_slots",
    "token_bytes -1",
    "token_bytes n_vocab",
    "grammar n_vocab",
    "whole still computes",
    "entry lookup token -1",
    "entry lookup token n_vocab",
    "entry lookup 2**70",
    "stage seq n_slots",
    "last stage seq -1",
    "stage pos -1",
    "last stage pos past the slot",
    "stage clear seq n_slots",
    "stage trim seq -1",
    "staged trim seq n_slots",
    "staged still computes",
]
STILL_COMPUTES = [c for c in ORDER if c.endswith("still computes")]
CASES = [c for c in ORDER if c not in STILL_COMPUTES]


@pytest.fixture(scope="module")
def outcomes() -> tuple[dict[str, dict], str]:
    """Each case's outcome from one child process, and how that child ended."""
    with tempfile.TemporaryDirectory() as workdir:
        code = f"from tests.engine.test_engine_bounds import run_cases; run_cases({workdir!r})"
        child = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=300
        )
    results = {}
    for line in child.stdout.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            results[r["case"]] = r
    ended = f"exit status {child.returncode}" + (
        f" (signal {-child.returncode})" if child.returncode < 0 else ""
    )
    return results, f"{ended}; stderr tail: {child.stderr[-1500:]}"


def test_the_child_ran_every_case(outcomes):
    results, ended = outcomes
    assert list(results) == ORDER, ended


@pytest.mark.parametrize("case", CASES)
def test_an_out_of_range_value_is_refused_not_an_abort(outcomes, case):
    results, ended = outcomes
    assert case in results, f"the engine process died at or before {case!r}: {ended}"
    assert results[case]["outcome"] == "refused", results[case]


@pytest.mark.parametrize("case", STILL_COMPUTES)
def test_the_engine_computes_after_refusals(outcomes, case):
    results, ended = outcomes
    assert case in results, f"the engine process died before {case!r}: {ended}"
    assert results[case] == {"case": case, "outcome": "returned", "finite": True}
