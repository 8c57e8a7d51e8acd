"""Prometheus metrics without an engine: the agent's state read from a status document, and
what one request adds, both parsed back with Prometheus' own text parser."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from meshagent.api.metrics import TPOT_BUCKETS, TTFT_BUCKETS, Metrics
from meshagent.serving.generation import Finished

STATUS = {
    "in_flight": 2,
    "uptime_s": 12.5,
    "models": [
        {
            "id": "m",
            "slots": {
                "active": 1,
                "queued": 3,
                "slots": 4,
                "tokens_processed": 900,
                "draft_tokens": 40,
                "draft_accepted": 30,
                "prefix_hits": 5,
                "prefix_misses": 2,
                "prefix_bytes": 1234,
            },
            "prefix_cache": {"budget_bytes": 4096},
        }
    ],
    "placement": {"m": {"epoch": 7, "routable": True, "stages": [{}, {}, {}], "replicas": []}},
    "peers": [
        {"peer_id": "a", "path": "direct", "rtt_ms": 2.0},
        {"peer_id": "b", "path": "relayed", "rtt_ms": None},
        {"peer_id": "c", "path": "direct", "rtt_ms": 40.0},
    ],
    "overlay_traffic": {"direct": {"sent": 100, "received": 250}},
    "gossip": {"states": {"alive": 3, "dead": 1}, "exchanges": 9, "failed_exchanges": 1},
}


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_the_agents_state_is_exposed_and_parses():
    got = samples(Metrics(lambda: STATUS).render().decode())
    m = (("model", "m"),)
    assert got[("meshagent_requests_in_flight", ())] == 2
    assert got[("meshagent_slots_busy", m)] == 1
    assert got[("meshagent_slots", m)] == 4
    assert got[("meshagent_queue_depth", m)] == 3
    assert got[("meshagent_tokens_processed_total", m)] == 900
    assert got[("meshagent_draft_tokens_accepted_total", m)] == 30
    assert got[("meshagent_prefix_cache_hits_total", m)] == 5
    assert got[("meshagent_prefix_cache_bytes", m)] == 1234
    assert got[("meshagent_prefix_cache_budget_bytes", m)] == 4096
    assert got[("meshagent_placement_epoch", m)] == 7
    assert got[("meshagent_placement_stages", m)] == 3
    assert got[("meshagent_placement_routable", m)] == 1
    assert got[("meshagent_overlay_connections", (("path", "direct"),))] == 2
    assert got[("meshagent_overlay_connections", (("path", "relayed"),))] == 1
    assert got[("meshagent_overlay_rtt_seconds", (("path", "direct"), ("peer", "c")))] == 0.04
    assert not any(k[0] == "meshagent_overlay_rtt_seconds" and ("peer", "b") in k[1] for k in got)
    assert got[("meshagent_overlay_received_bytes_total", (("path", "direct"),))] == 250
    assert got[("meshagent_gossip_peers", (("state", "dead"),))] == 1
    assert got[("meshagent_gossip_exchanges_total", (("outcome", "failed"),))] == 1


def test_a_requests_counts_move_and_its_times_land_in_buckets():
    metrics = Metrics()
    meter = metrics.request()
    meter.model, meter.path = "m", "split"
    meter.first_text()
    meter.first_text()  # only the first counts
    meter.finished(Finished("stop", 50, 11, stage_ms=(30.0, 20.0), cached_tokens=40))
    meter.done(200, client_gone=False)
    bad = metrics.request()
    bad.failed = 400
    bad.done(400, client_gone=False)
    gone = metrics.request()
    gone.model = "m"
    gone.done(200, client_gone=True)  # the stream started, then the client left

    got = samples(metrics.render().decode())
    ml = (("model", "m"), ("path", "split"))
    assert got[("meshagent_requests_total", (*ml, ("status", "200")))] == 1
    assert got[("meshagent_requests_total", (("model", ""), ("path", "local"), ("status", "400")))]
    assert got[("meshagent_requests_total", (("model", "m"), ("path", "local"),
                                             ("status", "client_gone")))] == 1  # fmt: skip
    assert got[("meshagent_time_to_first_token_seconds_count", ml)] == 1
    assert got[("meshagent_time_per_output_token_seconds_count", ml)] == 1
    assert got[("meshagent_completion_tokens_total", (("model", "m"),))] == 11
    assert got[("meshagent_prompt_tokens_total", (("model", "m"),))] == 50
    assert got[("meshagent_cached_prompt_tokens_total", (("model", "m"),))] == 40
    assert got[("meshagent_stage_compute_seconds_total", (("model", "m"), ("stage", "1")))] == 0.02
    # The buckets rise and end in +Inf; a request's first text came within the first one.
    for buckets in (TTFT_BUCKETS, TPOT_BUCKETS):
        assert list(buckets) == sorted(buckets)
    inf = tuple(sorted((*ml, ("le", "+Inf"))))
    assert got[("meshagent_time_to_first_token_seconds_bucket", inf)] == 1
    first = tuple(sorted((*ml, ("le", str(TTFT_BUCKETS[0])))))
    assert got[("meshagent_time_to_first_token_seconds_bucket", first)] == 1


def test_a_request_meters_its_work_in_decoded_tokens_for_the_assignment():
    meter = Metrics().request()
    assert meter.work == 0  # not finished
    meter.model = "m"
    meter.finished(Finished("stop", prompt_tokens=300, completion_tokens=40, cached_tokens=100))
    # 40 decoded, and the 200 prompt tokens prefilled at a tenth each; the 100 a kept prefix
    # gave it cost nothing
    assert meter.work == 40 + 20
