"""What hosting a model costs and what peers offer: the types the planner, the exact cut
(`cuts.py`) and the search (`search.py`) share, so that none of them imports another's."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from meshagent.models.layout import ModelLayout, standin_bytes
from meshagent.net.coordinates import Coordinate, estimate_ms

DEFAULT_RTT_MS = 5.0  # assumed for a pair not measured yet, while no pair is measured

# llama.cpp's compute buffer, as llama-cpp-python 0.3.36 reserves it for the micro-batch of
# `BATCH_TOKENS` the engines use: per token, float32 rows of the larger of the output head's
# logits (a stage that ends the model; a middle stage has a placeholder vocabulary) and the
# layers' intermediates, about 12 x n_embd for llama-shaped FFNs. Measured for SmolLM2:
# 98.3 MiB whole or last stage, 14.0 MiB a middle one, for any context (docs/placement.md).
BATCH_TOKENS = 512
COMPUTE_ROW_EMBD = 12
COMPUTE_FIXED = 3 << 20

# What a replica or a chain serves with its slots: a decode step of n sequences together
# costs (1 + BATCH_STEP (n - 1)) of one sequence's step (the weights are read once for all),
# and a prompt token, prefilled in a batch, `PREFILL_SHARE` of a decoded one. The assignment
# counts demand in decoded tokens at these costs (`api/metrics.py` meters it so).
BATCH_STEP = 0.1
PREFILL_SHARE = 0.1
MAX_CHAINS = 16  # chains of one split, at most (`--chains`, and what demand grows)


def streams_gain(streams: int) -> float:
    """How many times one sequence's tokens per second `streams` sequences decoded
    together give (3.1 for 4)."""
    n = max(1, streams)
    return n / (1.0 + BATCH_STEP * (n - 1))


def decode_work(prompt_tokens: int, completion_tokens: int) -> int:
    """A request's tokens counted as decoded ones: its prompt at `PREFILL_SHARE` each."""
    return completion_tokens + math.ceil(prompt_tokens * PREFILL_SHARE)


@dataclass(frozen=True)
class ModelCost:
    """What a model costs to host, from its layout (exact bytes per layer)."""

    model_id: str
    n_layers: int
    layer_bytes: tuple[int, ...]
    embedding_bytes: int  # held by the first stage (token lookup)
    head_bytes: int  # held by the last stage (output norm + head)
    other_bytes: int  # held by every stage
    kv_bytes_per_token_per_layer: int
    flops_per_layer: float = 0.0  # per token; turns a peer's GFLOP/s into layers per second
    tied_embeddings: bool = False  # a whole model holds the shared matrix once
    split_refusal: str | None = None  # why it may only be served whole, if so
    # For llama.cpp's compute buffer (`compute_bytes`); 0: not counted (hand-made tables).
    n_embd: int = 0
    n_vocab: int = 0
    tokenizer_bytes: int = 0  # header bytes the first and last stage carry besides weights

    @classmethod
    def from_layout(cls, model_id: str, layout: ModelLayout) -> ModelCost:
        return cls(
            model_id=model_id,
            n_layers=layout.n_layers,
            layer_bytes=layout.layer_bytes,
            embedding_bytes=layout.embedding_bytes,
            head_bytes=layout.head_bytes,
            other_bytes=layout.other_bytes,
            kv_bytes_per_token_per_layer=layout.kv_bytes_per_token_per_layer,
            flops_per_layer=2.0 * sum(layout.layer_params) / max(layout.n_layers, 1),
            tied_embeddings=layout.tied_embeddings,
            split_refusal=layout.split_refusal,
            n_embd=layout.n_embd,
            n_vocab=layout.n_vocab,
            tokenizer_bytes=layout.tokenizer_bytes,
        )

    def compute_bytes(self, last: bool) -> int:
        """llama.cpp's compute buffer for a stage (`last`: it ends the model, with its output
        head), estimated as `BATCH_TOKENS` describes."""
        if not self.n_embd:
            return 0
        row = max(self.n_vocab if last else 0, COMPUTE_ROW_EMBD * self.n_embd)
        return BATCH_TOKENS * 4 * row + COMPUTE_FIXED

    def stage_bytes(self, start: int, end: int, context_tokens: int) -> int:
        """Weights, KV cache and compute buffer of a stage over layers [start, end)."""
        kv = self.kv_bytes_per_token_per_layer * context_tokens * (end - start)
        return self.weight_bytes(start, end) + kv + self.compute_bytes(end == self.n_layers)

    def offer_bytes(self, start: int, end: int, context_tokens: int, spare: int) -> int:
        """What of `stage_bytes` comes out of an agent's offer when it has `spare` bytes
        beyond it, which take the compute buffer first."""
        compute = self.compute_bytes(end == self.n_layers)
        return self.stage_bytes(start, end, context_tokens) - min(compute, spare)

    def weight_bytes(self, start: int, end: int) -> int:
        """The weights a stage over layers [start, end) loads."""
        total = sum(self.layer_bytes[start:end]) + self.other_bytes
        if start == 0:
            total += self.embedding_bytes
        if end == self.n_layers:
            total += self.head_bytes
            if start == 0 and self.tied_embeddings:
                total -= self.embedding_bytes
            if start > 0:
                total += self.standin_bytes
        return total

    @property
    def standin_bytes(self) -> int:
        """The zero token embeddings a last stage (not also the first) carries because
        llama.cpp requires them (`models.layout.standin_bytes`)."""
        return standin_bytes(self.n_vocab, self.n_embd, self.tied_embeddings)


@dataclass(frozen=True)
class PeerCapacity:
    peer_id: str
    memory_bytes: int  # system memory offered for weights and KV cache (`--max-memory`)
    speed: float  # layers per second of the reference model (relative speed is what matters)
    rtt_ms: Mapping[str, float] = field(default_factory=dict)  # measured RTT to other peers
    # What it can load without downloading: every layer range (the whole model file is
    # here), or the layer ranges whose stage artifacts it holds.
    whole_file: bool = True
    holds: frozenset[tuple[int, int]] = frozenset()
    vram_bytes: int = 0  # device (GPU) memory offered, all devices together
    vram_speed: float = 0.0  # layers per second on those devices
    # System memory it has beyond its offer, where llama.cpp's compute buffers go first: the
    # offer (`--max-memory`) is for weights and KV cache.
    spare_bytes: int = 0
    # Whether it has read the model's tokenizer (a stage host that fetched the header around
    # it, `models/ranged.py`, fetches it before it can cut the first or last stage).
    tokenizer: bool = True
    # Its network coordinate, as its record gives it (None: none yet): the RTT to a peer it
    # has not measured is estimated from both peers' (`rtt_between`).
    coord: Coordinate | None = None
    # The draft model it runs as a model's entry (`--draft-model`), on its CPU: GFLOP per
    # token, and the smallest model (GFLOP per token) it drafts for (0: none, any).
    draft_gflops: float = 0.0
    drafts_from_gflops: float = 0.0

    def needs(self, model: ModelCost, start: int, end: int, context_tokens: int) -> int:
        """Bytes of its offer a stage over layers [start, end) takes here: weights and KV
        cache, and what of the compute buffer the memory beyond the offer cannot hold."""
        return model.offer_bytes(start, end, context_tokens, self.spare_bytes)

    def download_bytes(self, model: ModelCost, start: int, end: int) -> int:
        """Bytes this peer must download before it can load layers [start, end)."""
        if self.whole_file or (start, end) in self.holds:
            return 0
        ends = start == 0 or end == model.n_layers
        return model.weight_bytes(start, end) + (
            0 if self.tokenizer or not ends else model.tokenizer_bytes
        )

    def stage_ms(self, model: ModelCost, start: int, end: int, context_tokens: int) -> float:
        """Compute time per token of layers [start, end) here: the share of the stage's bytes
        that fits the devices runs at `vram_speed`, the rest at `speed`; the first stage (the
        entry) also runs its draft model (`draft_ms`)."""
        layers = end - start
        cpu_ms = 1000.0 * layers / max(self.speed, 1e-9)
        extra = self.draft_ms(model) if start == 0 else 0.0
        if self.vram_bytes <= 0 or self.vram_speed <= 0:
            return cpu_ms + extra
        need = model.stage_bytes(start, end, context_tokens)
        on_device = min(1.0, self.vram_bytes / max(need, 1))
        return on_device * 1000.0 * layers / self.vram_speed + (1.0 - on_device) * cpu_ms + extra

    def draft_ms(self, model: ModelCost) -> float:
        """Compute time per token its draft model adds where it is `model`'s entry: a draft
        forward per token, on its CPU (`speed` is in `model`'s layers per second); 0 without
        a draft model, for a model smaller than it drafts for, or without the model's FLOPs."""
        if self.draft_gflops <= 0 or model.flops_per_layer <= 0:
            return 0.0
        if model.flops_per_layer * model.n_layers < self.drafts_from_gflops * 1e9:
            return 0.0
        layers = self.draft_gflops * 1e9 / model.flops_per_layer
        return 1000.0 * layers / max(self.speed, 1e-9)


@dataclass(frozen=True)
class StageAssignment:
    peer_id: str
    start: int
    end: int

    @property
    def layers(self) -> int:
        return self.end - self.start


def usable(peer: PeerCapacity, headroom: float) -> int:
    """The bytes of a peer's offer (system and device memory) a plan may fill."""
    return int((peer.memory_bytes + peer.vram_bytes) * (1.0 - headroom))


def rank_speed(peer: PeerCapacity) -> float:
    """A peer's speed for ranking: its devices' when its memory is mostly theirs."""
    total = peer.memory_bytes + peer.vram_bytes
    if total <= 0:
        return peer.speed
    return (peer.memory_bytes * peer.speed + peer.vram_bytes * peer.vram_speed) / total


def rtt_between(a: PeerCapacity, b: PeerCapacity, unknown: float) -> float:
    """The RTT between two peers: the larger of the two measures; with none, what their
    coordinates estimate where both have settled ones; else `unknown`."""
    if a.peer_id == b.peer_id:
        return 0.0
    ab, ba = a.rtt_ms.get(b.peer_id), b.rtt_ms.get(a.peer_id)
    known = [x for x in (ab, ba) if x is not None]
    if known:
        return max(known)
    if a.coord is not None and b.coord is not None and max(a.coord.error, b.coord.error) < 1.0:
        return estimate_ms(a.coord, b.coord)
    return unknown


def unknown_rtt(peers: Iterable[PeerCapacity]) -> float:
    """What a pair that has not measured its RTT is taken to cost: as much as the farthest
    pair that has. A guess any lower would make a peer that just (re)joined, before its
    probes, look closer than every measured one, and move a working split onto it."""
    return max((ms for p in peers for ms in p.rtt_ms.values()), default=DEFAULT_RTT_MS)


def ring_ms(order: Sequence[PeerCapacity], unknown: float) -> float:
    """One trip around the ring of peers in this order."""
    n = len(order)
    return sum(rtt_between(order[i], order[(i + 1) % n], unknown) for i in range(n))
