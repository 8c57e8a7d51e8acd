"""The capture hook: copies one graph tensor (a stage's output residual) out of llama.cpp,
and restores another (a Gemma stage's scaled input) to the rows it was given.

The hook is C (`native/capture.c`, built with the package as `meshagent.engine._capture`);
if that build is missing, a Python callback does the same job more slowly, with a warning.
"""

from __future__ import annotations

import ctypes
import glob
import os
from dataclasses import dataclass
from pathlib import Path

import llama_cpp
import numpy as np
import structlog

from meshagent.errors import EngineError

log = structlog.get_logger(__name__)

NAME_LEN = 64


class CaptureState(ctypes.Structure):
    """Mirrors `meshagent_capture` in native/capture.c."""

    _fields_ = [
        ("name", ctypes.c_char * NAME_LEN),
        ("dst", ctypes.c_void_p),
        ("capacity", ctypes.c_size_t),
        ("offset", ctypes.c_size_t),
        ("status", ctypes.c_int32),
        ("hits", ctypes.c_int32),
        ("restore", ctypes.c_char * NAME_LEN),
        ("src", ctypes.c_void_p),
        ("src_size", ctypes.c_size_t),
        ("src_offset", ctypes.c_size_t),
        ("restored", ctypes.c_int32),
    ]


@dataclass
class CaptureHook:
    callback: object  # a llama_cpp.ggml_backend_sched_eval_callback
    native: bool


_hook: CaptureHook | None = None
_py_callback_ref: object = None


def ggml_library(stem: str) -> ctypes.CDLL:
    """The ggml library `stem` (e.g. "libggml-base") that libllama uses, made global so that
    code linked against it reaches the same copy."""
    libdir = Path(llama_cpp.__file__).parent / "lib"
    candidates = sorted(glob.glob(str(libdir / f"{stem}.so.0"))) or sorted(
        glob.glob(str(libdir / f"{stem}.*"))
    )
    if not candidates:
        raise EngineError(f"{stem} not found next to llama-cpp-python in {libdir}")
    return ctypes.CDLL(candidates[0], mode=os.RTLD_NOW | ctypes.RTLD_GLOBAL)


def _ggml_base() -> ctypes.CDLL:
    """The libggml-base.so.0 libllama uses, made global so the hook links to the same copy."""
    return ggml_library("libggml-base")


def _native_library() -> ctypes.CDLL | None:
    here = Path(__file__).parent
    built = sorted(here.glob("_capture*.so"))
    if not built:
        return None
    lib = ctypes.CDLL(str(built[0]))
    lib.meshagent_capture_abi.restype = ctypes.c_int32
    if lib.meshagent_capture_abi() != ctypes.sizeof(CaptureState):
        log.warning("native.capture_abi_mismatch", path=str(built[0]))
        return None
    return lib


def _python_callback(ggml: ctypes.CDLL) -> object:
    ggml.ggml_get_name.restype = ctypes.c_char_p
    ggml.ggml_get_name.argtypes = [ctypes.c_void_p]
    ggml.ggml_nbytes.restype = ctypes.c_size_t
    ggml.ggml_nbytes.argtypes = [ctypes.c_void_p]
    ggml.ggml_is_contiguous.restype = ctypes.c_bool
    ggml.ggml_is_contiguous.argtypes = [ctypes.c_void_p]
    for f in (ggml.ggml_backend_tensor_get, ggml.ggml_backend_tensor_set):
        f.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]

    def restore(tensor: int, state: CaptureState) -> bool:
        if not ggml.ggml_is_contiguous(tensor):
            state.status = 2
            return True
        n = ggml.ggml_nbytes(tensor)
        if state.src_offset + n > state.src_size:
            state.status = 3
            return True
        ggml.ggml_backend_tensor_set(tensor, state.src + state.src_offset, 0, n)
        state.src_offset += n
        state.restored += 1
        return True

    def capture(tensor: int, ask: bool, user_data: int) -> bool:
        state = ctypes.cast(user_data, ctypes.POINTER(CaptureState)).contents
        name = ggml.ggml_get_name(tensor)
        if state.restore and name == state.restore:
            return True if ask else restore(tensor, state)
        if not state.name or name != state.name:
            return not ask
        if ask:
            return True
        state.hits += 1
        if not ggml.ggml_is_contiguous(tensor):
            state.status = 2
            return True
        n = ggml.ggml_nbytes(tensor)
        if state.offset + n > state.capacity:
            state.status = 1
            return True
        ggml.ggml_backend_tensor_get(tensor, state.dst + state.offset, 0, n)
        state.offset += n
        return True

    return llama_cpp.ggml_backend_sched_eval_callback(capture)


def capture_hook() -> CaptureHook:
    """The evaluation callback to give llama.cpp contexts that capture a tensor."""
    global _hook, _py_callback_ref
    if _hook is None:
        ggml = _ggml_base()
        lib = None
        try:
            lib = _native_library()
        except OSError as e:
            log.warning("native.capture_load_failed", error=str(e))
        if lib is not None:
            ptr = ctypes.cast(lib.meshagent_capture_eval, ctypes.c_void_p).value
            _hook = CaptureHook(llama_cpp.ggml_backend_sched_eval_callback(ptr), native=True)
        else:
            log.warning(
                "native.capture_fallback",
                why="native/capture.c was not built with the package (no C compiler?); "
                "using a slower Python callback. Reinstall with a C compiler to fix.",
            )
            _py_callback_ref = _python_callback(ggml)
            _hook = CaptureHook(_py_callback_ref, native=False)
    return _hook


class Capture:
    """One context's capture target (the tensor name and a growable float32 buffer) and
    restore target (a tensor overwritten with the decode's input rows); either may be ""."""

    def __init__(self, tensor_name: str, n_embd: int = 0, *, restore: str = "") -> None:
        self.state = CaptureState()
        self.target(tensor_name)
        self.restore(restore)
        self.bind(n_embd)

    @property
    def capturing(self) -> bool:
        return bool(self.state.name)

    def target(self, tensor_name: str) -> None:
        """The graph tensor to copy out (read by the hook at every decode)."""
        if len(tensor_name) >= NAME_LEN:
            raise EngineError(f"tensor name too long to capture: {tensor_name}")
        self.state.name = tensor_name.encode()

    def restore(self, tensor_name: str) -> None:
        """The graph tensor to overwrite with the rows given to `arm`, once computed."""
        if len(tensor_name) >= NAME_LEN:
            raise EngineError(f"tensor name too long to restore: {tensor_name}")
        self.state.restore = tensor_name.encode()

    def bind(self, n_embd: int) -> None:
        """Set the row width (the model's embedding length) once the model is loaded."""
        self.n_embd = n_embd
        self._buf = np.empty((0, n_embd), np.float32)

    @property
    def user_data(self) -> ctypes.c_void_p:
        return ctypes.cast(ctypes.pointer(self.state), ctypes.c_void_p)

    def arm(self, n_tokens: int, source: np.ndarray | None = None) -> None:
        """Ready for a decode of `n_tokens` rows; `source` (float32, contiguous, alive until
        `check`) the rows a restore writes back."""
        self.state.src = None if source is None else source.ctypes.data
        self.state.src_size = 0 if source is None else source.nbytes
        self.state.src_offset = 0
        self.state.restored = 0
        if not self.capturing:
            self.state.status = 0
            return
        if self._buf.shape[0] < n_tokens:
            self._buf = np.empty((n_tokens, self.n_embd), np.float32)
        self.state.dst = self._buf.ctypes.data
        self.state.capacity = self._buf.nbytes
        self.state.offset = 0
        self.state.status = 0
        self.state.hits = 0

    def check_restored(self, n_tokens: int) -> None:
        """Raise unless the restore wrote back all `n_tokens` rows (a llama.cpp that renamed
        or fused the tensor would leave it scaled: wrong, silently)."""
        want = n_tokens * self.n_embd * 4
        if self.state.restore and (self.state.status or self.state.src_offset != want):
            raise EngineError(
                f"restore of {self.state.restore.decode()} failed: status {self.state.status}, "
                f"{self.state.src_offset} of {want} bytes in {self.state.restored} pieces"
            )

    def collect(self, n_tokens: int) -> np.ndarray:
        want = n_tokens * self.n_embd * 4
        if self.state.status or self.state.offset != want:
            raise EngineError(
                f"capture of {self.state.name.decode()} failed: status {self.state.status}, "
                f"got {self.state.offset} of {want} bytes in {self.state.hits} pieces"
            )
        return self._buf[:n_tokens].copy()
