"""How this agent serves its model: one settings object, built once from the agent's config
and read where each setting is used (placement, loading a part, the runner, recovery)."""

from __future__ import annotations

from dataclasses import dataclass

from meshagent.config import PREFIX_CACHE_AUTO, AgentConfig


@dataclass(frozen=True)
class ServingSettings:
    slots: int = 4  # --slots
    slot_ctx: int = 2048  # --ctx-size: tokens of context per slot
    threads: int = 0  # --threads (0: one per core)
    max_queue: int = 64  # --max-queue
    wire_dtype: str = "auto"  # --wire-dtype: auto, f16 or f32
    replay_deadline: float = 30.0  # seconds a request waits for its split to serve again
    grace: float = 10.0  # --grace: seconds requests in flight get before their part goes
    speculation: str = "auto"  # --speculation, for requests that do not choose
    draft_model: str = ""  # --draft-model: a GGUF whose drafts a model served whole verifies
    prefix_cache: int = PREFIX_CACHE_AUTO  # --prefix-cache: bytes, 0 (off) or auto
    vram: int = 0  # GPU memory offered here (`--max-vram`), all devices together
    headroom: float = 0.1  # placement: memory a plan leaves free on each peer
    threshold: float = 0.25  # placement: how much better a new plan must be
    # As whole-model serving: off. On CPUs llama.cpp's flash attention is slower for decode
    # and its results change with the thread count, which peers do not share.
    flash_attn: bool | None = False

    @classmethod
    def of(cls, config: AgentConfig, *, vram: int = 0) -> ServingSettings:
        """The settings `config` gives, with `vram` bytes of GPU memory offered."""
        given = {name: getattr(config, field) for name, field in _FROM_CONFIG.items()}
        return cls(**given, vram=vram)


# Each setting taken from the agent's config: its field there (the command line's name).
_FROM_CONFIG = {
    "slots": "slots",
    "slot_ctx": "ctx_size",
    "threads": "threads",
    "max_queue": "max_queue",
    "wire_dtype": "wire_dtype",
    "replay_deadline": "replay_deadline",
    "grace": "grace",
    "speculation": "speculation",
    "draft_model": "draft_model",
    "prefix_cache": "prefix_cache",
}
