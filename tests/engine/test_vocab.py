"""A model's vocabulary read from several threads at once: each token's bytes are what one
thread alone reads (llama.cpp writes a piece without holding the GIL; the event loop and a
draft model's worker both ask)."""

from __future__ import annotations

import threading

from meshagent.engine.vocab import Vocab


def test_token_bytes_read_by_two_threads_at_once_are_each_tokens_own(model_path):
    alone = Vocab.load(model_path)
    want = [alone.token_bytes(t) for t in range(alone.n_vocab)]
    shared = Vocab.load(model_path)
    got: dict[int, list[bytes]] = {}
    start = threading.Barrier(2)

    def read(k: int) -> None:
        start.wait()
        order = range(shared.n_vocab) if k == 0 else range(shared.n_vocab - 1, -1, -1)
        got[k] = [b""] * shared.n_vocab
        for t in order:
            got[k][t] = shared.token_bytes(t)
            shared._bytes.pop(t, None)  # (read it again next time: every call races)

    threads = [threading.Thread(target=read, args=(k,)) for k in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert got[0] == want and got[1] == want
