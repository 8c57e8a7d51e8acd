"""A llama.cpp model and context: loading, batches of tokens or embeddings, KV per sequence."""

from __future__ import annotations

import ctypes
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import llama_cpp
import numpy as np
import structlog

from meshagent.engine.base import check_tokens
from meshagent.engine.checkpoints import Checkpoint, read_state, write_state
from meshagent.engine.native import Capture, capture_hook
from meshagent.errors import EngineError, ModelError, OutOfRange

log = structlog.get_logger(__name__)

_LEVELS = {3: "warning", 4: "error"}  # ggml_log_level values worth surfacing


@llama_cpp.llama_log_callback
def _llama_log(level: int, text: bytes, _user: ctypes.c_void_p) -> None:
    if level in _LEVELS and text:
        getattr(log, _LEVELS[level])("llama.cpp", message=text.decode(errors="replace").strip())


_backend_ready = False

# llama.cpp's CPU backend multiplies K-quant and IQ weights (Q4_K_M and the like) by a batch
# of 8 or more rows with its tiled kernels, and a smaller batch with its dot products; the two
# round differently, so a draft's window or a prompt chunk of 8 tokens or more gives other
# logits than one-token steps (decision 11). meshagent turns the tiled kernels off unless the
# environment chooses; llama.cpp reads the variable once per process, at its first product.
TILED_ENV = "GGML_CPU_TILED_MM"
TILED_WINDOWS = (
    f"llama.cpp's tiled K-quant kernels are on ({TILED_ENV} is set): batches of 8 or more "
    f"tokens round otherwise than one-token steps; unset {TILED_ENV} or set it to 0"
)


# On CPUs with wide integer kernels (AVX2 and up, ARM's dot products), llama.cpp 0.3.36 can
# repack weights of these types into interleaved blocks when it loads them ("extra buffer
# types"), and then multiplies them by one row with one kernel and by 4 rows or more with
# another, which rounds otherwise (decision 12): on such a model a window of 4 tokens or more,
# or a prompt chunk, is not what one-token steps compute, so drafts and kept prefixes would
# change tokens. Repacked decode is faster (about 1.3x on a 2-core AVX-512 EPYC), but agents
# load without repacking unless $MESHAGENT_REPACK asks for it.
REPACK_ENV = "MESHAGENT_REPACK"
REPACKED_TYPES = frozenset(
    {"Q4_0", "Q8_0", "Q2_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "MXFP4", "Q1_0"}
)


def init_backend() -> None:
    global _backend_ready
    if not _backend_ready:
        os.environ.setdefault(TILED_ENV, "0")
        llama_cpp.llama_log_set(_llama_log, ctypes.c_void_p(0))
        llama_cpp.llama_backend_init()
        _backend_ready = True


def cpu_has_amx() -> bool:
    """True on CPUs with Intel AMX tiles (Linux's /proc/cpuinfo; False where unknown)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " amx_tile" in flags


def _env_on(name: str) -> bool:
    """A switch in the environment read as llama.cpp reads its own (C's atoi: a number, and
    non-zero is on); unset is off."""
    digits = re.match(r"\s*([+-]?\d+)", os.environ.get(name, "0"))
    return digits is not None and int(digits.group(1)) != 0


def repack_on() -> bool:
    """Whether llama.cpp may repack weights in this process: where $MESHAGENT_REPACK is set
    to a non-zero number, and never on AMX CPUs (see `model_params`)."""
    return _env_on(REPACK_ENV) and not cpu_has_amx()


def inexact_model(weight_types: Iterable[str]) -> str:
    """Why a model with weights of `weight_types` computes a window of several tokens
    otherwise than one-token steps in this process, whatever the build ('' where its types
    are not repacked here)."""
    repacked = sorted(set(weight_types) & REPACKED_TYPES) if repack_on() else []
    if not repacked:
        return ""
    return (
        f"llama.cpp repacks this model's {', '.join(repacked)} weights ({REPACK_ENV} is set) "
        f"and multiplies 4 or more rows of them otherwise than one row; unset {REPACK_ENV} "
        "or set it to 0"
    )


def built_with_llamafile() -> bool:
    """Whether llama.cpp was built with LLAMAFILE (tinyBLAS), whose kernels compute a batch of
    two or more tokens with other arithmetic than one token (docs/speculation.md)."""
    return b"LLAMAFILE = 1" in llama_cpp.llama_print_system_info()


def tiled_kernels_on() -> bool:
    """Whether llama.cpp's tiled K-quant kernels are on in this process, reading the variable
    as llama.cpp does (C's atoi: non-zero is on). Unset means off: `init_backend`, which runs
    before llama.cpp computes anything here, sets it to 0."""
    return _env_on(TILED_ENV)


def inexact_build() -> str:
    """Why this process's llama.cpp computes a batch of several tokens otherwise than one
    token, whatever the model ('' where nothing says so; the load-time window check still
    measures the model at hand)."""
    reasons = [LLAMAFILE_WINDOWS] if built_with_llamafile() else []
    if tiled_kernels_on():
        reasons.append(TILED_WINDOWS)
    return "; ".join(reasons)


# Why a draft's window cannot compute what one-token steps compute (engine/windows.py).
# llama.cpp's CPU flash attention splits a one-token step's attention over the threads past
# 512 tokens of context, and a window's not: a short check would pass where long contexts
# differ.
FLASH_ATTN_WINDOWS = "flash attention computes one-token steps otherwise"
LLAMAFILE_WINDOWS = (
    "llama.cpp was built with LLAMAFILE: reinstall llama-cpp-python with "
    'CMAKE_ARGS="-DGGML_LLAMAFILE=OFF" (README)'
)


def model_params(*, vocab_only: bool = False, gpu_layers: int = 0) -> llama_cpp.llama_model_params:
    """llama.cpp's model parameters as meshagent loads every model.

    Extra buffer types (weights repacked for AMX, or for the CPU's wider kernels) are off on
    AMX CPUs: llama.cpp 0.3.36's AMX matrix multiply crashes the process there (seen on a
    Xeon with amx_tile, for any batch of more than one token of a Q4_1 model); and elsewhere
    unless $MESHAGENT_REPACK asks for them (`repack_on`, decision 12).

    `gpu_layers`: how many of the model's last layers go on the GPUs (llama.cpp's
    `n_gpu_layers`; more than the model has: its output head too); 0 keeps every layer in
    system memory, whatever llama.cpp's own default. A CPU build ignores it."""
    params = llama_cpp.llama_model_default_params()
    params.vocab_only = vocab_only
    params.n_gpu_layers = gpu_layers
    if not repack_on():
        params.use_extra_bufts = False
    return params


def load_model(path: Path, *, vocab_only: bool = False, gpu_layers: int = 0) -> ctypes.c_void_p:
    if not path.is_file():
        raise ModelError(f"model file not found: {path}")
    init_backend()
    params = model_params(vocab_only=vocab_only, gpu_layers=gpu_layers)
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
    if not model:
        raise ModelError(f"llama.cpp could not load {path}: is it a valid GGUF model file?")
    return model


def _by_sequence(seq_ids: Sequence[int]) -> list[int]:
    """Item indices in ascending sequence id. With a KV stream per sequence, llama.cpp builds
    each micro-batch from a run of consecutive, increasing sequence ids starting at the first
    row not yet used; in ascending order the rows therefore keep the batch's order (which the
    capture of hidden states needs) and consecutive ids share one micro-batch."""
    return sorted(range(len(seq_ids)), key=lambda i: seq_ids[i])


@dataclass(frozen=True)
class EmbdItem:
    """Hidden states of one sequence's tokens, positions pos..pos+n-1."""

    seq_id: int
    pos: int
    hidden: np.ndarray  # float32 [n, n_embd]
    want_logits: int = 0  # logits of the last this many rows (a draft's window: several)


class LlamaRuntime:
    """One loaded model with a context of `slots` sequences of `slot_ctx` tokens each.

    `capture` set: the context also copies out the named graph tensor on every decode (every
    row is marked as an output so the last layer keeps all rows).
    """

    def __init__(
        self,
        path: Path,
        *,
        slots: int,
        slot_ctx: int,
        threads: int = 0,
        max_batch_tokens: int = 512,
        unified_kv: bool = False,
        flash_attn: bool | None = None,
        capture: Capture | None = None,
        gpu_layers: int = 0,
    ) -> None:
        self.model = load_model(path, gpu_layers=gpu_layers)
        self.slots = slots
        self.slot_ctx = slot_ctx
        # llama.cpp never batches more than the context holds (and aborts if asked to).
        max_batch_tokens = min(max_batch_tokens, slot_ctx * slots)
        self.max_batch_tokens = max_batch_tokens
        self.capture = capture
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self.n_embd = int(llama_cpp.llama_model_n_embd(self.model))
        self.n_layers = int(llama_cpp.llama_model_n_layer(self.model))
        # Recurrent and hybrid models keep one state per sequence, the summary after its last
        # token: a sequence can be cleared but not cut back to an earlier position.
        self.rewindable = not (
            llama_cpp.llama_model_is_recurrent(self.model)
            or llama_cpp.llama_model_is_hybrid(self.model)
        )
        # Such a sequence is cut back from a checkpoint taken before its last decode of
        # several tokens (engine/checkpoints.py): far enough for a rejected draft.
        self.checkpoints: dict[int, Checkpoint] = {}
        cp = llama_cpp.llama_context_default_params()
        cp.n_ctx = slot_ctx * slots
        cp.n_batch = max_batch_tokens
        cp.n_ubatch = max_batch_tokens
        cp.n_seq_max = slots
        # Split caches (a KV stream per sequence) give every slot a guaranteed size and make a
        # batched sequence compute bit for bit what it computes alone; a unified cache lays
        # sequences out differently and changes the attention's rounding.
        cp.kv_unified = unified_kv
        self.threads = threads or os.cpu_count() or 1
        cp.n_threads = self.threads
        cp.n_threads_batch = self.threads
        cp.no_perf = True
        if flash_attn is not None:
            cp.flash_attn_type = 1 if flash_attn else 0
        if capture is not None:
            capture.bind(self.n_embd)
            cp.cb_eval = capture_hook().callback
            cp.cb_eval_user_data = capture.user_data
        ctx = llama_cpp.llama_init_from_model(self.model, cp)
        if not ctx:
            llama_cpp.llama_model_free(self.model)
            raise EngineError(
                f"llama.cpp could not create a context of {slots} x {slot_ctx} tokens; "
                "try a smaller --ctx-size or fewer --slots"
            )
        self.ctx = ctx
        self._memory = llama_cpp.llama_get_memory(ctx)
        self._tokens = llama_cpp.llama_batch_init(max_batch_tokens, 0, 1)
        self._embd = llama_cpp.llama_batch_init(max_batch_tokens, self.n_embd, 1)
        self._embd_view = np.ctypeslib.as_array(
            self._embd.embd, shape=(max_batch_tokens * self.n_embd,)
        )

    def meta(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(512)
        n = llama_cpp.llama_model_meta_val_str(self.model, key.encode(), buf, len(buf))
        return buf.value.decode(errors="replace") if n >= 0 else None

    def _set_row(self, batch: llama_cpp.llama_batch, n: int, seq: int, pos: int, out: bool) -> None:
        batch.pos[n] = pos
        batch.n_seq_id[n] = 1
        batch.seq_id[n][0] = seq
        batch.logits[n] = out

    def _check_size(self, n: int) -> None:
        if n > self.max_batch_tokens:
            raise EngineError(f"batch of {n} tokens exceeds {self.max_batch_tokens}")

    # llama.cpp aborts the process on a sequence id past its slots (and reads -1 as every
    # sequence), on a token id past its vocabulary, and places positions past a slot's end in
    # no slot: whatever the caller, such values are refused here, before any llama.cpp call.

    def _check_seq(self, seq_id: int) -> None:
        if not 0 <= seq_id < self.slots:
            raise OutOfRange(
                f"sequence {seq_id} is not one of the {self.slots} slots (0-{self.slots - 1})"
            )

    def _check_span(self, seq_id: int, pos: int, n: int) -> None:
        """Positions pos..pos+n-1 of a sequence: within its slot."""
        self._check_seq(seq_id)
        if pos < 0 or pos + n > self.slot_ctx:
            raise OutOfRange(
                f"{n} positions from {pos} of sequence {seq_id} do not fit its slot "
                f"(positions 0-{self.slot_ctx - 1})"
            )

    def decode_tokens(
        self, items: Sequence[tuple[int, int, Sequence[int], int]]
    ) -> list[np.ndarray | None]:
        """items: (seq_id, pos, tokens, rows). Returns per item the logits of its last token
        (rows 1), of its last `rows` tokens as one array (rows > 1), or None (rows 0)."""
        batch = self._tokens
        self._check_size(sum(len(tokens) for _, _, tokens, _ in items))
        for seq, pos, tokens, _ in items:
            self._check_span(seq, pos, len(tokens))
            check_tokens(tokens, self.n_vocab)
        for seq, pos, tokens, _ in items:
            self._checkpoint(seq, pos, tuple(tokens))
        order = _by_sequence([seq for seq, _, _, _ in items])
        n = 0
        wanted: list[range | None] = [None] * len(items)
        for idx in order:
            seq, pos, tokens, want = items[idx]
            for i, tok in enumerate(tokens):
                batch.token[n] = tok
                self._set_row(batch, n, seq, pos + i, False)
                n += 1
            if want:
                first = n - min(int(want), len(tokens))
                for r in range(first, n):
                    batch.logits[r] = True
                wanted[idx] = range(first, n)
        batch.n_tokens = n
        self._decode(batch, n)
        out: list[np.ndarray | None] = []
        for idx, r in enumerate(wanted):
            if r is None:
                out.append(None)
            elif int(items[idx][3]) == 1:
                out.append(self.logits(r[-1]))
            else:
                out.append(np.stack([self.logits(i) for i in r]))
        return out

    def decode_embd(
        self, items: Sequence[EmbdItem]
    ) -> tuple[list[np.ndarray] | None, list[np.ndarray | None]]:
        """Run hidden states through the layers. Returns (per item, its captured residual rows,
        or None without capture; per item, its last row's logits if it asked for one, an
        array of its last `want_logits` rows' logits if for more, else None).

        With a capture, all items of one call must be single tokens, or the call must hold
        one item: see `StageEngine` for why."""
        batch = self._embd
        total = sum(it.hidden.shape[0] for it in items)
        self._check_size(total)
        for it in items:
            self._check_span(it.seq_id, it.pos, it.hidden.shape[0])
        for it in items:
            self._checkpoint(it.seq_id, it.pos, it.hidden)
        embd = self._embd_view
        order = _by_sequence([it.seq_id for it in items])
        n = 0
        starts = [0] * len(items)
        rows: list[range | None] = [None] * len(items)
        capture = self.capture
        all_rows = capture is not None and capture.capturing
        for idx in order:
            it = items[idx]
            k = it.hidden.shape[0]
            embd[n * self.n_embd : (n + k) * self.n_embd] = it.hidden.reshape(-1)
            for i in range(k):
                self._set_row(batch, n + i, it.seq_id, it.pos + i, all_rows)
            starts[idx] = n
            n += k
            if it.want_logits:
                wanted = range(n - min(int(it.want_logits), k), n)
                for r in wanted:
                    batch.logits[r] = True
                rows[idx] = wanted
        batch.n_tokens = n
        if capture is not None:
            # A restore writes back the rows as given (in batch order, as llama.cpp reads them).
            capture.arm(n, embd[: n * self.n_embd] if capture.state.restore else None)
        self._decode(batch, n)
        if capture is not None:
            capture.check_restored(n)
        logits = [
            None
            if r is None
            else self.logits(r[-1])
            if items[i].want_logits == 1
            else np.stack([self.logits(j) for j in r])
            for i, r in enumerate(rows)
        ]
        if not all_rows:
            return None, logits
        captured = capture.collect(n)
        hidden = [
            captured[starts[i] : starts[i] + it.hidden.shape[0]] for i, it in enumerate(items)
        ]
        return hidden, logits

    def _decode(self, batch: llama_cpp.llama_batch, n: int) -> None:
        if n == 0:
            raise EngineError("empty batch")
        rc = llama_cpp.llama_decode(self.ctx, batch)
        if rc != 0:
            raise EngineError(f"llama_decode failed with code {rc}")

    def _checkpoint(self, seq_id: int, pos: int, inputs: tuple[int, ...] | np.ndarray) -> None:
        """Before a decode of `inputs` at `pos`: a recurrent sequence's checkpoint, if it
        decodes several tokens (one token is never cut back: the last checkpoint goes)."""
        if self.rewindable:
            return
        self.checkpoints.pop(seq_id, None)
        if len(inputs) < 2:
            return
        state = read_state(self.ctx, seq_id) if self.length(seq_id) > 0 else None
        if isinstance(inputs, np.ndarray):
            inputs = inputs.copy()
        self.checkpoints[seq_id] = Checkpoint(pos, pos + len(inputs), state, inputs)

    def _roll_back(self, seq_id: int, keep: int) -> None:
        """Cut a recurrent sequence back to `keep` positions from its checkpoint: the state
        loaded, the KV cells past it removed, the kept inputs decoded again."""
        cp = self.checkpoints.pop(seq_id)
        if cp.state is None:
            llama_cpp.llama_memory_seq_rm(self._memory, seq_id, -1, -1)
        else:
            write_state(self.ctx, seq_id, cp.state)
            if not llama_cpp.llama_memory_seq_rm(self._memory, seq_id, cp.pos, -1):
                raise EngineError(f"llama.cpp could not cut sequence {seq_id} to {cp.pos}")
        n = keep - cp.pos
        if n == 0:
            return
        if isinstance(cp.inputs, np.ndarray):
            self.decode_embd([EmbdItem(seq_id, cp.pos, cp.inputs[:n])])
        else:
            self.decode_tokens([(seq_id, cp.pos, cp.inputs[:n], 0)])

    def checkpoint_bytes(self) -> int:
        return sum(cp.nbytes for cp in list(self.checkpoints.values()))

    def logits(self, row: int) -> np.ndarray:
        ptr = llama_cpp.llama_get_logits_ith(self.ctx, row)
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy()

    def clear(self, seq_id: int) -> None:
        self._check_seq(seq_id)
        self.checkpoints.pop(seq_id, None)
        llama_cpp.llama_memory_seq_rm(self._memory, seq_id, -1, -1)

    def length(self, seq_id: int) -> int:
        """How many positions of a sequence the context holds (0 for an empty one)."""
        self._check_seq(seq_id)
        return int(llama_cpp.llama_memory_seq_pos_max(self._memory, seq_id)) + 1

    def check_trim(self, seq_id: int, keep: int) -> None:
        """Raise if `trim(seq_id, keep)` would be refused; change nothing."""
        self._check_seq(seq_id)
        if keep < 0:
            raise OutOfRange(f"cannot trim sequence {seq_id} to {keep} tokens")
        if self._needs_roll_back(seq_id, keep):
            cp = self.checkpoints.get(seq_id)
            if cp is None or not cp.covers(self.length(seq_id), keep):
                raise EngineError(
                    f"cannot trim sequence {seq_id} to {keep} of {self.length(seq_id)} tokens: "
                    "this model keeps a recurrent state per sequence, which is cut back only "
                    "into its last decode of several tokens (clear the sequence and run its "
                    "tokens again)"
                )

    def _needs_roll_back(self, seq_id: int, keep: int) -> bool:
        return not self.rewindable and 0 < keep < self.length(seq_id)

    def trim(self, seq_id: int, keep: int) -> None:
        """Forget positions `keep` and later of a sequence (e.g. a rejected draft)."""
        self.check_trim(seq_id, keep)
        if self._needs_roll_back(seq_id, keep):
            self._roll_back(seq_id, keep)
            return
        self.checkpoints.pop(seq_id, None)
        if not llama_cpp.llama_memory_seq_rm(self._memory, seq_id, keep, -1):
            raise EngineError(f"llama.cpp could not trim sequence {seq_id} to {keep} tokens")

    def reset(self) -> None:
        self.checkpoints.clear()
        llama_cpp.llama_memory_clear(self._memory, True)

    def export_sequence(self, seq_id: int) -> bytes:
        """One sequence's state (its KV cells, its recurrent state, or both), as llama.cpp
        serialises it for `import_sequence` into a context of the same model."""
        self._check_seq(seq_id)
        size = int(llama_cpp.llama_state_seq_get_size(self.ctx, seq_id))
        buf = (ctypes.c_uint8 * size)()
        n = int(llama_cpp.llama_state_seq_get_data(self.ctx, buf, size, seq_id))
        return bytes(buf)[:n]

    def import_sequence(self, seq_id: int, state: bytes) -> None:
        """Replace a sequence's state with one from `export_sequence`."""
        self._check_seq(seq_id)
        self.checkpoints.pop(seq_id, None)
        buf = (ctypes.c_uint8 * len(state)).from_buffer_copy(state)
        if not llama_cpp.llama_state_seq_set_data(self.ctx, buf, len(state), seq_id):
            raise EngineError(f"llama.cpp could not load a state into sequence {seq_id}")

    def state_bytes(self) -> int:
        return int(llama_cpp.llama_state_get_size(self.ctx))

    def model_bytes(self) -> int:
        return int(llama_cpp.llama_model_size(self.model))

    def close(self) -> None:
        if self.ctx:
            llama_cpp.llama_batch_free(self._tokens)
            llama_cpp.llama_batch_free(self._embd)
            llama_cpp.llama_free(self.ctx)
            llama_cpp.llama_model_free(self.model)
            self.ctx = None


class RuntimeDelegate:
    """The KV-cache and lifecycle half of an engine, answered by its `LlamaRuntime`."""

    runtime: LlamaRuntime

    def clear_sequence(self, seq_id: int) -> None:
        self.runtime.clear(seq_id)

    def trim_sequence(self, seq_id: int, keep: int) -> None:
        self.runtime.trim(seq_id, keep)

    def reset(self) -> None:
        self.runtime.reset()

    def export_sequence(self, seq_id: int, keep: int) -> bytes:
        if self.runtime.length(seq_id) > keep:
            self.runtime.trim(seq_id, keep)
        return self.runtime.export_sequence(seq_id)

    def import_sequence(self, seq_id: int, state: bytes) -> None:
        self.runtime.import_sequence(seq_id, state)

    def memory_bytes(self) -> int:
        rt = self.runtime
        return rt.model_bytes() + rt.state_bytes() + rt.checkpoint_bytes()

    def close(self) -> None:
        self.runtime.close()
