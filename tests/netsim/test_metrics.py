"""The report's figures from hand-made records: spreads, the floor, bytes per token, faults."""

import pytest
from netsim import metrics
from netsim.fabric import LinkCounters
from netsim.lab import Counters


def rec(i, *, t0=0.0, ok=True, stream=True, chunks=(), tokens=None, **kw):
    r = {
        "i": i,
        "t0": t0,
        "shape": "long",
        "stream": stream,
        "ok": ok,
        "complete": ok,
        "status": 200 if ok else 500,
        "t_first": chunks[0] if chunks else None,
        "t_end": (chunks[-1] + 0.01) if chunks else 1.0,
        "chunks": list(chunks),
        "completion_tokens": len(chunks) if tokens is None else tokens,
        "prompt_tokens": 10,
        "stage_ms": None,
        "cause": None if ok else "http",
        "error": None if ok else "HTTP 500 engine_error: broken",
    }
    r.update(kw)
    return r


def test_spread_quantiles_interpolate_and_empty_is_none():
    s = metrics.spread([1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    assert s["n"] == 10 and s["median"] == 5.5 and s["min"] == 1 and s["max"] == 10
    assert s["p10"] == pytest.approx(1.9) and s["p90"] == pytest.approx(9.1)
    assert metrics.spread([]) is None


def test_per_token_figures_of_a_stream():
    r = rec(0, chunks=[0.5, 0.56, 0.62, 0.68])
    assert metrics.gaps_ms(r) == pytest.approx([60, 60, 60])
    assert metrics.per_token_ms(r) == pytest.approx(60)
    assert metrics.ttft_ms(r) == pytest.approx(500)
    assert metrics.tokens_per_s(r) == pytest.approx(4 / 0.69)
    whole = rec(1, stream=False, tokens=8, t_end=2.0)
    assert metrics.ttft_ms(whole) is None and metrics.per_token_ms(whole) is None
    assert metrics.tokens_per_s(whole) == 4


def test_summarise_counts_failures_and_incomplete_streams():
    records = [
        rec(0, chunks=[0.1, 0.2]),
        rec(1, t0=1.0, stream=False, tokens=5),
        rec(2, t0=2.0, ok=False, chunks=[0.1], cause="incomplete", error="no [DONE]"),
    ]
    s = metrics.summarise(records)
    assert (s["requests"], s["ok"], s["failed"]) == (3, 2, 1)
    assert s["streams"] == 2 and s["streams_complete"] == 1 and s["streams_incomplete"] == [2]
    assert s["completion_tokens"] == 7
    assert s["by_kind"]["long/stream"]["requests"] == 2
    [f] = s["failures"]
    assert f["i"] == 2 and f["cause"] == "incomplete" and f["tokens_received"] == 1


def test_decode_compute_subtracts_the_prefill_and_the_floor_adds_the_ring():
    prefill = [rec(i, stage_ms=[10.0, 12.0, 8.0], tokens=1) for i in range(3)]
    decode = [rec(3, stage_ms=[73.0, 138.0, 71.0], tokens=64)]
    compute = metrics.decode_compute_ms(prefill, decode)
    assert compute == pytest.approx([1.0, 2.0, 1.0])
    floor = metrics.floor_ms(compute, [15.0, 15.0, 15.0])
    assert floor == {"compute_ms": 4.0, "ring_ms": 45.0, "floor_ms": 49.0}
    vs = metrics.against_floor(55.0, floor["floor_ms"])
    assert vs["gap_ms"] == 6.0 and vs["goal_ms"] == pytest.approx(1.1 * 49 + 2)
    assert vs["goal_met"] and not metrics.against_floor(60.0, 49.0)["goal_met"]
    assert metrics.decode_compute_ms([], decode) is None


def counters(uptime, links, delivered=0, late=0.0):
    return Counters(
        links={k: LinkCounters(*v) for k, v in links.items()},
        unrouted={},
        uptime_s=uptime,
        queued=0,
        read_errors=0,
        write_errors=0,
        delivered=delivered,
        late_total_s=late,
        max_late_s=0.001,
    )


def test_wire_per_token_nets_out_the_idle_background():
    before = counters(10.0, {("h0", "h1"): (10, 1000, {}, {})}, delivered=10, late=0.001)
    after = counters(20.0, {("h0", "h1"): (110, 21000, {"loss": 1}, {"loss": 100})}, 110, 0.011)
    window = metrics.counters_window(before, after)
    assert window["seconds"] == 10.0 and window["links"]["h0>h1"]["bytes"] == 20000
    assert window["late_mean_ms"] == pytest.approx(0.1)
    idle = {"seconds": 5.0, "links": {"h0>h1": {"bytes": 500}}}
    wire = metrics.wire_per_token(window, tokens=100, idle=idle)["h0>h1"]
    assert wire["bytes_per_token"] == 200.0
    assert wire["idle_bytes_per_s"] == 100.0
    assert wire["net_bytes_per_token"] == 190.0  # 1000 bytes of background in 10 s
    assert wire["dropped"] == {"loss": 1}


def test_around_fault_separates_in_flight_from_later_and_finds_the_stall():
    records = [
        rec(0, t0=9.0, chunks=[0.5, 1.5, 2.0], t_end=2.1),  # in flight, survives
        rec(1, t0=9.5, ok=False, chunks=[0.2], t_end=0.6, cause="stream_error"),  # in flight
        rec(2, t0=10.2, ok=False, chunks=[], t_end=0.01),  # later, fails at once
        rec(3, t0=13.0, chunks=[0.5, 0.6], t_end=0.7),  # later, ok
    ]
    a = metrics.around_fault(records, fault_t=10.0)
    assert [x["i"] for x in a["in_flight"]] == [0, 1]
    assert a["in_flight_ok"] == 1 and a["in_flight_failed"] == 1
    first = a["in_flight"][0]
    assert first["tokens_before_fault"] == 1 and first["tokens_after_fault"] == 2
    assert a["sent_after"] == 2 and a["sent_after_failed"] == 1
    assert a["sent_after_causes"] == {"http": 1}
    # tokens after the fault at 10.5, 11.0, 13.5, 13.6: the longest silence is 11.0 -> 13.5
    assert a["token_stall"]["longest_gap_s"] == pytest.approx(2.5)
    assert a["token_stall"]["resumed_after_fault_s"] == pytest.approx(3.5)
    assert a["first_ok_request"]["i"] == 3
    none = metrics.around_fault([rec(0, t0=0.0, chunks=[0.1], t_end=0.2)], fault_t=5.0)
    assert none["token_stall"]["tokens_after_fault"] == 0
    assert none["token_stall"]["resumed_after_fault_s"] is None
    assert none["first_ok_request"] is None


def test_tokens_that_stop_after_the_fault_never_resumed():
    records = [
        rec(0, t0=9.0, ok=False, chunks=[0.5, 1.02], t_end=1.03),  # one more token, then error
        rec(1, t0=10.5, ok=False, chunks=[], t_end=0.01),
        rec(2, t0=40.0, ok=False, chunks=[], t_end=0.01),
    ]
    stall = metrics.around_fault(records, fault_t=10.0)["token_stall"]
    assert stall["resumed_after_fault_s"] is None
    assert stall["last_token_after_fault_s"] == pytest.approx(0.02)
    assert stall["observed_s"] == pytest.approx(30.01)


def test_churn_measures_each_faults_stall_beyond_the_usual_gap():
    steady = [0.1 * k for k in range(1, 11)]  # a token every 100 ms ...
    stalled = [*steady[:5], 3.5, 3.6, 3.7]  # ... then 3 s without one across the fault
    records = [
        rec(0, t0=10.0, chunks=stalled, t_end=3.8),
        rec(1, t0=10.0, chunks=steady, t_end=1.1),  # in flight too, never stalled
        rec(2, t0=10.0, stream=False, t_end=4.0),  # whole: no tokens to time
        rec(3, t0=11.0, ok=False, chunks=[0.1], t_end=0.5, cause="stream_error"),
        rec(4, t0=20.0, chunks=steady, t_end=1.1),  # after every fault
    ]
    faults = [{"t": 10.55, "kind": "kill", "host": "h1"}, {"t": 11.2, "kind": "sigint"}]
    rows = metrics.churn_faults(records, faults)
    kill, sigint = rows
    assert kill["in_flight"] == 3 and kill["in_flight_failed"] == 0
    assert kill["stalls_s"] == [pytest.approx(3.0), pytest.approx(0.1)]
    assert kill["extra_s"] == pytest.approx(2.9)  # the stall less its 100 ms median gap
    assert sigint["in_flight"] == 3 and sigint["in_flight_failed"] == 1  # 0, 2 and 3
    by_kind = metrics.churn_by_kind(rows)
    assert by_kind["kill"]["extra_s"]["max"] == pytest.approx(2.9)
    assert by_kind["sigint"]["in_flight_failed"] == 1


def test_greedy_identity_compares_with_the_reference_of_the_same_prompt():
    def g(i, prompt_no, text, *, ok=True, temperature=0.0, replays=None):
        return rec(
            i, shape="long-greedy", prompt_no=prompt_no, text=text, ok=ok,
            temperature=temperature, replays=replays,
        )  # fmt: skip

    refs = [g(-1, 0, "the keeper waited"), g(-2, 1, "a letter home")]
    runs = [
        g(0, 0, "the keeper waited", replays=[{"tokens": 40}]),
        g(1, 1, "a letter hom!"),
        g(2, 1, "anything", temperature=0.7),  # sampled: not checked here
        g(3, 0, "cut sh", ok=False),  # failed: counted as failed elsewhere
    ]
    out = metrics.greedy_identity(runs, refs)
    assert out["checked"] == 2 and out["identical"] == 1 and out["replayed_checked"] == 1
    [m] = out["mismatches"]
    assert m["i"] == 1 and m["first_difference_at_char"] == 12 and not m["replayed"]


def test_churn_detection_is_the_entrys_first_break_after_each_fault():
    faults = [{"t": 10.0, "kind": "kill"}, {"t": 30.0, "kind": "partition"}]
    events = [
        {"host": "h2", "t": 10.4, "event": "pipeline.broken"},
        {"host": "h2", "t": 11.0, "event": "pipeline.broken"},  # the same fault, again
        {"host": "h1", "t": 30.2, "event": "pipeline.broken"},  # another agent's
        {"host": "h2", "t": 31.0, "event": "stream.handler_failed"},
    ]
    assert metrics.churn_detection(faults, events, "h2") == [0.4, None]


def test_replay_times_split_the_wait_from_the_replay():
    records = [
        rec(0, replays=[{"ms": 3000.0, "wait_ms": 1000.0}, {"ms": 500.0, "wait_ms": 400.0}]),
        rec(1),
    ]
    out = metrics.replay_times(records)
    assert out["replays"] == 2
    assert out["wait_s"]["max"] == pytest.approx(1.0)
    assert out["replay_s"]["max"] == pytest.approx(2.0)


def test_churn_back_is_from_the_fault_to_the_chain_opened_again():
    faults = [{"t": 10.0, "kind": "power_cut"}, {"t": 30.0, "kind": "partition"}]
    events = [
        {"t": 12.1, "event": "pipeline.broken"},
        {"t": 13.1, "event": "pipeline.reconnected"},
        {"t": 14.0, "event": "pipeline.reconnected"},
    ]
    assert metrics.churn_back(faults, events) == [3.1, None]


def test_speculation_compares_decode_rates_acceptance_and_texts():
    def run(mode, gap, texts, receipt=None):
        return [
            rec(i, chunks=[0.1 + gap * k for k in range(11)], prompt_no=i, text=t,
                speculation=receipt)
            for i, t in enumerate(texts)
        ]  # fmt: skip

    phases = {
        "copy-off": run("off", 0.1, ["a", "b"]),  # 10 tok/s
        "copy-auto": run(
            "auto",
            0.025,
            ["a", "b"],
            {"windows": 3, "drafted": 12, "accepted": 9, "peak_windows_in_flight": 3},
        ),
        "prose-off": run("off", 0.1, ["c"]),
        "prose-auto": run("auto", 0.1, ["d"]),  # the text changed: said so
    }
    s = metrics.speculation(phases)
    assert s["copy"]["tok_s_off"] == pytest.approx(10) and s["copy"]["ratio"] == pytest.approx(4)
    assert (s["copy"]["windows"], s["copy"]["acceptance"]) == (6, 0.75)
    assert s["copy"]["same_text"] == "2/2" and s["copy"]["ok"] == 4
    assert s["prose"]["ratio"] == pytest.approx(1) and s["prose"]["same_text"] == "0/1"
    assert s["prose"]["acceptance"] is None
    assert (s["copy"]["peak_in_flight"], s["prose"]["peak_in_flight"]) == (3, 0)


def test_per_token_acceptance_inverts_the_windows_that_end_at_the_first_wrong_token():
    # Windows of 4 drafts, each right with chance 0.6 given those before: on average
    # 0.6 + 0.36 + 0.216 + 0.1296 = 1.3056 kept of 4.
    p = metrics.per_token_acceptance(drafted=400, accepted=round(1.3056 * 100), windows=100)
    assert p == pytest.approx(0.6, abs=0.005)
    assert metrics.per_token_acceptance(drafted=40, accepted=40, windows=10) == pytest.approx(1)
    assert metrics.per_token_acceptance(drafted=0, accepted=0, windows=0) is None


def test_the_draft_ceiling_weighs_tokens_per_window_against_what_windows_cost():
    # A trip-bound split: a window costs the trip (100 ms) and 10 ms a token.
    steps = {str(n): {"count": 5, "mean_ms": 100.0 + 10 * n} for n in range(1, 6)}
    cost = {"slope": 0.1, "jump": 0.0, "steps": steps}
    sure = metrics.draft_ceiling(1.0, cost, forward_ms=0.0, most=4)
    assert sure["at_draft_tokens"] == 4
    assert sure["ceiling"] == pytest.approx(5 * 110 / 150, abs=1e-3)
    # A dear draft model lowers it; one never right allows nothing.
    assert metrics.draft_ceiling(1.0, cost, forward_ms=50.0, most=4)["ceiling"] < sure["ceiling"]
    assert metrics.draft_ceiling(0.0, cost, forward_ms=0.0)["ceiling"] == 1.0
    # Window sizes never timed come from the fitted line through the one-token step.
    line = {"slope": 0.5, "jump": 0.2, "steps": {"1": {"count": 3, "mean_ms": 200.0}}}
    assert metrics.window_ms(line, 3) == pytest.approx(200 * (1 + 0.2 + 0.5 * 2))
    assert metrics.draft_ceiling(0.5, None, 10.0) is None
    # Drafts always right and windows ever cheaper along the line: the ceiling stops at the
    # largest window an entry sends, 16 tokens (15 drafts).
    assert metrics.draft_ceiling(1.0, line, 0.0)["at_draft_tokens"] == 15


def test_a_draft_model_that_sent_no_window_is_judged_by_what_it_proposed():
    # The entry's record of it (status `draft_model.right`), once it judged enough tokens.
    assert metrics.unsent_p({"p": 0.62, "judged": 40.0}) == 0.62
    assert metrics.unsent_p({"p": 0.62, "judged": 5.0}) is None  # too few to stand for it
    assert metrics.unsent_p({"p": None, "judged": 0.0}) is None
    assert metrics.unsent_p(None) is None
