"""The NAT split's figures from hand-made records (no root): a token's time before and after
the switch, the text against the direct run's, and the matrix's pairs with the time a token
takes on the path each ends on."""

from netsim import nat_move


def rec(chunks, text="abc", t0=10.0):
    return {"chunks": chunks, "text": text, "complete": True, "t0": t0, "replays": None}


def test_a_moving_run_is_timed_apart_on_each_side_of_the_switch():
    # 0.1 s a chunk up to 2 s into the request, then 0.05 s; the switch 12.0 s into the run.
    chunks = [round(0.1 * i, 3) for i in range(21)] + [
        round(2.0 + 0.05 * i, 3) for i in range(1, 41)
    ]
    direct = rec([0.0, 0.05, 0.1])
    ph = nat_move._phase(rec(chunks), direct, switch=12.0)
    assert ph["switch_s"] == 2.0
    assert ph["token_ms_before"] == 100.0 and ph["token_ms_after"] == 50.0
    assert ph["chunks_before"] == 15 and ph["chunks_after"] == 30  # 0.5 s each side left out
    assert ph["longest_gap_ms_near_switch"] == 100.0
    assert ph["same_text"] and ph["complete"]
    assert not nat_move._phase(rec(chunks, text="abd"), direct)["same_text"]


def test_each_pair_gets_the_time_a_token_takes_on_the_path_it_ends_on():
    matrix = {
        "pairs": {
            "full-cone/symmetric": {"runs": 20, "direct": 20, "within_goal": 20},
            "symmetric/symmetric": {"runs": 20, "direct": 0, "within_goal": 0},
        }
    }
    split = {"phases": {"direct": {"token_ms": 57.7}, "relayed": {"token_ms": 105.3}}}
    rows = nat_move.by_pair(matrix, split).splitlines()[2:]
    assert rows == [
        "| full-cone/symmetric | direct (20/20) | 20/20 | 57.7 | 105.3 |",
        "| symmetric/symmetric | relayed (0/20) | 0/20 | 105.3 | 105.3 |",
    ]
