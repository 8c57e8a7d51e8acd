"""Prometheus metrics (`GET /metrics`, `docs/metrics.md`): what the API served, measured per
request as it ends, and the agent's live state (slots, queue, placement, peers, overlay
traffic, drafts, kept prefixes), read from its status document at each scrape.

Each app has a registry of its own (not prometheus_client's global one), so that several
agents in one process (tests) keep their counts apart."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from meshagent.placement.costs import decode_work
from meshagent.serving.generation import Finished

CONTENT_TYPE = CONTENT_TYPE_LATEST

# How requests are served, the `path` label: by this agent's whole model, by a split this
# agent is the entry of, or by another agent (carried or forwarded over the overlay).
LOCAL, SPLIT, FORWARDED = "local", "split", "forwarded"

# Seconds. From the request's arrival to its first text: queueing and prefill included, from
# a kept prefix on a fast machine (tens of ms) to a long cold prompt over a WAN split.
TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
# Seconds per output token after the first (a request's mean): 200 tok/s on a GPU to a
# long-haul split's 1-2 tok/s.
TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)


class Metrics:
    def __init__(
        self,
        state: Callable[[], dict[str, Any]] | None = None,
        on_request: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        """`state` gives the agent's status document (`control.status`), read at scrape;
        `on_request` is told of each request as it ends (its `RequestMeter.record`)."""
        self.on_request = on_request
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "meshagent_requests",
            "Completion requests by model, how they were served (local, split, forwarded) and "
            "outcome (the HTTP status, the status of an error event that ended a stream, or "
            "client_gone)",
            ["model", "path", "status"],
            registry=r,
        )

        def latency(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, ["model", "path"], buckets=buckets, registry=r)

        self.ttft = latency(
            "meshagent_time_to_first_token_seconds",
            "From a request's arrival to its first text",
            TTFT_BUCKETS,
        )
        self.tpot = latency(
            "meshagent_time_per_output_token_seconds",
            "A request's mean time per output token after the first",
            TPOT_BUCKETS,
        )
        self.prompt_tokens = Counter(
            "meshagent_prompt_tokens", "Prompt tokens of completed requests", ["model"], registry=r
        )
        self.cached_tokens = Counter(
            "meshagent_cached_prompt_tokens",
            "Prompt tokens a kept prefix gave completed requests (not prefilled)",
            ["model"],
            registry=r,
        )
        self.completion_tokens = Counter(
            "meshagent_completion_tokens", "Tokens generated", ["model"], registry=r
        )
        self.stage_seconds = Counter(
            "meshagent_stage_compute_seconds",
            "Time each stage of a split (0 = the entry) computed for the requests this agent "
            "was the entry of",
            ["model", "stage"],
            registry=r,
        )
        if state is not None:
            r.register(_StateCollector(state))

    def request(self) -> RequestMeter:
        """A meter for one completion request, from its arrival."""
        return RequestMeter(self)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestMeter:
    """What one completion request adds to the metrics, counted once when it ends (`done`)."""

    def __init__(self, metrics: Metrics) -> None:
        self._m = metrics
        self._arrived = time.perf_counter()
        self._first: float | None = None
        self.model = ""
        self.path = LOCAL
        self.failed: int | None = None  # the status of the error that ended it
        self.error = ""  # ...and its message
        self.stages: list[tuple[str, str]] = []  # (peer id, layers) of each stage serving it
        self._finished: Finished | None = None
        self._ended = 0.0

    def fail(self, status: int, message: str) -> None:
        self.failed, self.error = status, message

    @property
    def work(self) -> int:
        """What the request cost, counted in decoded tokens, once it finished (0 before):
        its completion, and the prompt tokens it prefilled (those a kept prefix gave it
        cost nothing) at `PREFILL_SHARE` each (`placement.costs.decode_work`)."""
        fin = self._finished
        if fin is None:
            return 0
        return decode_work(max(0, fin.prompt_tokens - fin.cached_tokens), fin.completion_tokens)

    def receipt(self, headers: Iterable[tuple[bytes, bytes]]) -> None:
        """Who serves it, from the response's `x-meshagent-stages` header."""
        for name, value in headers:
            if name == b"x-meshagent-stages":
                parts = [p.rpartition(":") for p in value.decode().split(",") if p]
                self.stages = [(peer, layers) for peer, _, layers in parts]

    def first_text(self) -> None:
        if self._first is None:
            self._first = time.perf_counter()
            self._m.ttft.labels(self.model, self.path).observe(self._first - self._arrived)

    def finished(self, fin: Finished) -> None:
        m, now = self._m, time.perf_counter()
        self._finished, self._ended = fin, now
        if self._first is not None and fin.completion_tokens > 1:
            per_token = (now - self._first) / (fin.completion_tokens - 1)
            m.tpot.labels(self.model, self.path).observe(per_token)
        m.prompt_tokens.labels(self.model).inc(fin.prompt_tokens)
        m.cached_tokens.labels(self.model).inc(fin.cached_tokens)
        m.completion_tokens.labels(self.model).inc(fin.completion_tokens)
        for i, ms in enumerate(fin.stage_ms):
            m.stage_seconds.labels(self.model, str(i)).inc(ms / 1000)

    def done(self, http_status: int | None, *, client_gone: bool) -> None:
        """The request ended: with `http_status` (None: nothing was sent)."""
        if self.failed is not None:
            status = str(self.failed)
        elif client_gone and self._finished is None:
            status = "client_gone"
        else:
            status = str(http_status or 500)
        self._m.requests.labels(self.model, self.path, status).inc()
        if self._m.on_request is not None:
            self._m.on_request(self.record(status))

    def record(self, status: str) -> dict[str, Any]:
        """The request as the console shows it."""
        fin = self._finished
        first = self._first
        tokens = fin.completion_tokens if fin else 0
        stage_ms = list(fin.stage_ms) if fin else []  # a split's; none served whole
        return {
            "at": time.time(),
            "model": self.model,
            "path": self.path,
            "status": status,
            "error": self.error,
            "prompt_tokens": fin.prompt_tokens if fin else 0,
            "cached_tokens": fin.cached_tokens if fin else 0,
            "completion_tokens": tokens,
            "ttft_ms": None if first is None else round(1000 * (first - self._arrived), 1),
            "tok_s": round((tokens - 1) / (self._ended - first), 1)
            if fin and first is not None and tokens > 1 and self._ended > first
            else None,
            "stages": [
                {
                    "peer": peer,
                    "layers": layers,
                    "ms": round(stage_ms[i], 1) if i < len(stage_ms) else None,
                }
                for i, (peer, layers) in enumerate(self.stages)
            ],
        }


class _StateCollector:
    """The agent's live state as metrics, from its status document at each scrape."""

    def __init__(self, state: Callable[[], dict[str, Any]]) -> None:
        self._state = state

    def describe(self) -> Iterable[Metric]:
        return []  # the families depend on the state: not checked for clashes at register

    def collect(self) -> Iterator[Metric]:
        yield from state_metrics(self._state())


def _gauge(name: str, doc: str, labels: list[str]) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=labels)


def state_metrics(s: dict[str, Any]) -> list[Metric]:
    """Metric families from a status document (`control.status`)."""
    in_flight = _gauge("meshagent_requests_in_flight", "Requests being answered", [])
    in_flight.add_metric([], s.get("in_flight", 0))
    uptime = _gauge("meshagent_uptime_seconds", "Seconds since the agent started", [])
    uptime.add_metric([], s.get("uptime_s", 0))
    out: list[Metric] = [in_flight, uptime]
    out += _model_metrics(s.get("models", []))
    out += _placement_metrics(s.get("placement", {}))
    out += _mesh_metrics(s)
    return out


def _model_metrics(models: list[dict[str, Any]]) -> list[Metric]:
    busy = _gauge("meshagent_slots_busy", "Sequences holding a slot", ["model"])
    slots = _gauge("meshagent_slots", "Slots of the model's engine here", ["model"])
    queued = _gauge("meshagent_queue_depth", "Requests waiting for a slot", ["model"])
    processed = CounterMetricFamily(
        "meshagent_tokens_processed", "Tokens through the engine here", labels=["model"]
    )
    drafted = CounterMetricFamily(
        "meshagent_draft_tokens", "Draft tokens verified (speculation)", labels=["model"]
    )
    accepted = CounterMetricFamily(
        "meshagent_draft_tokens_accepted", "Draft tokens accepted", labels=["model"]
    )
    hits = CounterMetricFamily(
        "meshagent_prefix_cache_hits", "Prompts started from a kept prefix", labels=["model"]
    )
    misses = CounterMetricFamily(
        "meshagent_prefix_cache_misses",
        "Prompts with no kept prefix to start from",
        labels=["model"],
    )
    kept = _gauge("meshagent_prefix_cache_bytes", "KV bytes kept for prefixes", ["model"])
    budget = _gauge("meshagent_prefix_cache_budget_bytes", "What prefixes may keep", ["model"])
    for m in models:
        name, st = [m["id"]], m.get("slots", {})
        busy.add_metric(name, st.get("active", 0))
        slots.add_metric(name, st.get("slots", 0))
        queued.add_metric(name, st.get("queued", 0))
        processed.add_metric(name, st.get("tokens_processed", 0))
        drafted.add_metric(name, st.get("draft_tokens", 0))
        accepted.add_metric(name, st.get("draft_accepted", 0))
        hits.add_metric(name, st.get("prefix_hits", 0))
        misses.add_metric(name, st.get("prefix_misses", 0))
        kept.add_metric(name, st.get("prefix_bytes", 0))
        budget.add_metric(name, (m.get("prefix_cache") or {}).get("budget_bytes", 0))
    return [busy, slots, queued, processed, drafted, accepted, hits, misses, kept, budget]


def _placement_metrics(placement: dict[str, Any]) -> list[Metric]:
    epoch = _gauge("meshagent_placement_epoch", "The epoch of the model's plan", ["model"])
    routable = _gauge(
        "meshagent_placement_routable", "1 while some agent serves the model", ["model"]
    )
    stages = _gauge("meshagent_placement_stages", "Stages of the plan (0: whole)", ["model"])
    replicas = _gauge("meshagent_placement_replicas", "Agents serving it whole", ["model"])
    for model, p in placement.items():
        if p is None:
            continue
        epoch.add_metric([model], p.get("epoch") or 0)
        routable.add_metric([model], 1 if p.get("routable") else 0)
        stages.add_metric([model], len(p.get("stages") or []))
        replicas.add_metric([model], len(p.get("replicas") or []))
    return [epoch, routable, stages, replicas]


def _mesh_metrics(s: dict[str, Any]) -> list[Metric]:
    gossip = s.get("gossip", {})
    peers = _gauge("meshagent_gossip_peers", "Members known by gossip, by state", ["state"])
    for state, n in sorted(gossip.get("states", {}).items()):
        peers.add_metric([state], n)
    exchanges = CounterMetricFamily(
        "meshagent_gossip_exchanges", "Gossip exchanges by outcome", labels=["outcome"]
    )
    exchanges.add_metric(["ok"], gossip.get("exchanges", 0))
    exchanges.add_metric(["failed"], gossip.get("failed_exchanges", 0))
    exchanges.add_metric(["refused"], gossip.get("refused_exchanges", 0))
    links = _gauge("meshagent_overlay_connections", "Peer connections by path", ["path"])
    counts: dict[str, int] = {}
    rtt = _gauge("meshagent_overlay_rtt_seconds", "Smoothed RTT to each peer", ["peer", "path"])
    for link in s.get("peers", []):
        counts[link["path"]] = counts.get(link["path"], 0) + 1
        if link.get("rtt_ms") is not None:
            rtt.add_metric([link["peer_id"], link["path"]], link["rtt_ms"] / 1000)
    for path, n in sorted(counts.items()):
        links.add_metric([path], n)
    sent = CounterMetricFamily(
        "meshagent_overlay_sent_bytes", "Bytes sent to peers, by path", labels=["path"]
    )
    received = CounterMetricFamily(
        "meshagent_overlay_received_bytes", "Bytes received from peers, by path", labels=["path"]
    )
    for path, t in sorted(s.get("overlay_traffic", {}).items()):
        sent.add_metric([path], t["sent"])
        received.add_metric([path], t["received"])
    return [peers, exchanges, links, rtt, sent, received]
