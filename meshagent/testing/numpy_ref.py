"""The numpy reference engine: an independent implementation of the split architectures.

Dequantised float32 weights, any layer range, a KV cache per sequence. It is the oracle that
llama.cpp results are checked against (within rounding, not bit for bit) and the engine of
last resort. About 3x slower than llama.cpp at decode and 5.5x the GGUF's size in memory.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np

from meshagent.engine.runtime import EmbdItem
from meshagent.engine.stage import StageOutput
from meshagent.errors import EngineError, ModelError
from meshagent.models.gguf_file import Tensor
from meshagent.models.layout import LAYER_TENSOR, inspect_model, open_gguf

# llama.cpp's rope modes: llama rotates adjacent pairs; the qwen family rotates the two halves.
NEOX_ROPE = frozenset({"qwen2", "qwen3"})


@dataclass
class _Layer:
    attn_norm: np.ndarray
    wq: np.ndarray
    wk: np.ndarray
    wv: np.ndarray
    wo: np.ndarray
    ffn_norm: np.ndarray
    w_gate: np.ndarray
    w_up: np.ndarray
    w_down: np.ndarray
    bq: np.ndarray | None = None
    bk: np.ndarray | None = None
    bv: np.ndarray | None = None
    q_norm: np.ndarray | None = None
    k_norm: np.ndarray | None = None


@dataclass
class _Cache:
    pos: list[int] = field(default_factory=list)
    k: list[np.ndarray] = field(default_factory=list)  # per layer [n, n_kv, hd]
    v: list[np.ndarray] = field(default_factory=list)


def _tensor(t: Tensor) -> np.ndarray:
    data = gguf.quants.dequantize(t.data, t.tensor_type)
    return np.ascontiguousarray(data, dtype=np.float32)


class NumpyStage:
    """Layers [start, end) of a whole-model GGUF; the last stage also applies the head."""

    def __init__(self, model: Path, *, start: int, end: int) -> None:
        layout = inspect_model(model)
        if layout.split_refusal and (start, end) != (0, layout.n_layers):
            raise ModelError(f"cannot split {model.name}: {layout.split_refusal}")
        if layout.architecture not in ("llama", "qwen2", "qwen3"):
            raise ModelError(f"the numpy engine does not implement {layout.architecture!r}")
        r = open_gguf(model)
        arch = layout.architecture
        self.arch = arch
        self.start, self.end = start, end
        self.last = end == layout.n_layers
        self.n_embd = layout.n_embd
        self.n_head, self.n_head_kv, self.head_dim = (
            layout.n_head,
            layout.n_head_kv,
            layout.head_dim,
        )
        self.eps = float(r.fields[f"{arch}.attention.layer_norm_rms_epsilon"].contents())
        base_field = r.fields.get(f"{arch}.rope.freq_base")
        base = float(base_field.contents()) if base_field else 10000.0
        half = self.head_dim // 2
        self.inv_freq = base ** (-np.arange(half, dtype=np.float64) * 2 / self.head_dim)
        by_name = {t.name: t for t in r.tensors}
        grouped: dict[int, dict[str, np.ndarray]] = {i: {} for i in range(start, end)}
        for t in r.tensors:
            m = LAYER_TENSOR.match(t.name)
            if m and start <= int(m.group(1)) < end:
                grouped[int(m.group(1))][m.group(2)] = _tensor(t)
        self.layers = [self._layer(grouped[i]) for i in range(start, end)]
        self.output_norm = self.output = None
        if self.last:
            self.output_norm = _tensor(by_name["output_norm.weight"])
            head = by_name.get("output.weight") or by_name["token_embd.weight"]
            self.output = _tensor(head)
        self._caches: dict[int, _Cache] = {}

    @staticmethod
    def _layer(t: dict[str, np.ndarray]) -> _Layer:
        return _Layer(
            attn_norm=t["attn_norm.weight"],
            wq=t["attn_q.weight"],
            wk=t["attn_k.weight"],
            wv=t["attn_v.weight"],
            wo=t["attn_output.weight"],
            ffn_norm=t["ffn_norm.weight"],
            w_gate=t["ffn_gate.weight"],
            w_up=t["ffn_up.weight"],
            w_down=t["ffn_down.weight"],
            bq=t.get("attn_q.bias"),
            bk=t.get("attn_k.bias"),
            bv=t.get("attn_v.bias"),
            q_norm=t.get("attn_q_norm.weight"),
            k_norm=t.get("attn_k_norm.weight"),
        )

    def _rms(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps) * w

    def _rope(self, x: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """x: [n, heads, hd]; rotate by position as llama.cpp's rope mode for this arch."""
        angles = pos[:, None].astype(np.float64) * self.inv_freq[None, :]  # [n, hd/2]
        cos = np.cos(angles)[:, None, :].astype(np.float32)
        sin = np.sin(angles)[:, None, :].astype(np.float32)
        if self.arch in NEOX_ROPE:
            half = self.head_dim // 2
            a, b = x[..., :half], x[..., half:]
            return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)
        a, b = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = a * cos - b * sin
        out[..., 1::2] = a * sin + b * cos
        return out

    def _attend(self, i: int, layer: _Layer, h: np.ndarray, cache: _Cache, pos: np.ndarray):
        n = h.shape[0]
        q = h @ layer.wq.T
        k = h @ layer.wk.T
        v = h @ layer.wv.T
        if layer.bq is not None:
            q, k, v = q + layer.bq, k + layer.bk, v + layer.bv
        q = q.reshape(n, self.n_head, self.head_dim)
        k = k.reshape(n, self.n_head_kv, self.head_dim)
        v = v.reshape(n, self.n_head_kv, self.head_dim)
        if layer.q_norm is not None:
            q = self._rms(q, layer.q_norm)
            k = self._rms(k, layer.k_norm)
        q, k = self._rope(q, pos), self._rope(k, pos)
        keys = np.concatenate([cache.k[i], k]) if len(cache.k) > i else k
        values = np.concatenate([cache.v[i], v]) if len(cache.v) > i else v
        if len(cache.k) > i:
            cache.k[i], cache.v[i] = keys, values
        else:
            cache.k.append(keys)
            cache.v.append(values)
        all_pos = np.asarray(cache.pos + list(pos))
        group = self.n_head // self.n_head_kv
        kk = np.repeat(keys, group, axis=1).transpose(1, 0, 2)  # [heads, t, hd]
        vv = np.repeat(values, group, axis=1).transpose(1, 0, 2)
        scores = q.transpose(1, 0, 2) @ kk.transpose(0, 2, 1) / math.sqrt(self.head_dim)
        scores = np.where(all_pos[None, None, :] <= pos[None, :, None], scores, -np.inf)
        scores -= scores.max(axis=-1, keepdims=True)
        weights = np.exp(scores)
        weights /= weights.sum(axis=-1, keepdims=True)
        out = (weights @ vv).transpose(1, 0, 2).reshape(n, self.n_head * self.head_dim)
        return out @ layer.wo.T

    def _run(self, seq_id: int, pos0: int, x: np.ndarray) -> np.ndarray:
        cache = self._caches.setdefault(seq_id, _Cache())
        expected = len(cache.pos)
        if pos0 != expected:
            raise EngineError(f"sequence {seq_id} is at position {expected}, got {pos0}")
        pos = np.arange(pos0, pos0 + x.shape[0])
        x = x.astype(np.float32)
        for i, layer in enumerate(self.layers):
            x = x + self._attend(i, layer, self._rms(x, layer.attn_norm), cache, pos)
            h = self._rms(x, layer.ffn_norm)
            gate = h @ layer.w_gate.T
            x = x + ((gate / (1.0 + np.exp(-gate))) * (h @ layer.w_up.T)) @ layer.w_down.T
        cache.pos.extend(int(p) for p in pos)
        return x

    def forward(self, items: Sequence[EmbdItem], *, all_logits: bool = False) -> StageOutput:
        """As `StageEngine.forward`; `all_logits` returns every row's logits (last stage)."""
        hidden = [self._run(it.seq_id, it.pos, it.hidden) for it in items]
        assert all(h.dtype == np.float32 for h in hidden), "float64 crept into the residual"
        if not self.last:
            return StageOutput(hidden, [None] * len(items))
        assert self.output is not None and self.output_norm is not None
        logits: list[np.ndarray | None] = []
        for it, h in zip(items, hidden, strict=True):
            rows = h if all_logits else h[-1:]
            lg = self._rms(rows, self.output_norm) @ self.output.T
            logits.append((lg if all_logits else lg[0]) if it.want_logits or all_logits else None)
        return StageOutput(None, logits)

    def clear_sequence(self, seq_id: int) -> None:
        self._caches.pop(seq_id, None)

    def trim_sequence(self, seq_id: int, keep: int) -> None:
        cache = self._caches.get(seq_id)
        if cache is not None:
            del cache.pos[keep:]
            cache.k = [k[:keep] for k in cache.k]
            cache.v = [v[:keep] for v in cache.v]

    def reset(self) -> None:
        self._caches.clear()
