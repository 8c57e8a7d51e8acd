"""The error hierarchy: every error a user can see says what to do about it."""


class MeshError(Exception):
    """Root of meshagent's own errors."""


class ConfigError(MeshError):
    """The configuration or a command-line value is unusable."""


class ModelError(MeshError):
    """A model file is missing, unreadable or unsupported."""


class CatalogError(MeshError):
    """A catalogue entry is malformed, forged or out of range, or a catalogue change cannot
    be made (a name that is not catalogued, a full catalogue)."""


class NotCatalogued(CatalogError):
    """No model of that name is in the mesh's catalogue."""


class EngineError(MeshError):
    """The inference engine failed to load or run."""


class OutOfRange(EngineError):
    """A token id, sequence or position outside what the model and its slots hold, refused
    before it reaches llama.cpp (which would abort the process): a bug, or a peer's message
    that was not checked where it arrived."""


class SplitUnavailable(EngineError):
    """A split serving the model lost a stage or cannot reach one. Temporary: the mesh
    replans or the stage comes back, and the split serves again; retry shortly."""


class ModelMoved(SplitUnavailable):
    """The mesh moved the model: another agent serves it now. A request carried here from
    another agent's API continues there (`api/carried.py`); others retry."""


class ContextOverflow(MeshError):
    """A request needs more context than the model's slot offers."""

    def __init__(self, message: str, *, prompt_tokens: int, limit: int) -> None:
        super().__init__(message)
        self.prompt_tokens = prompt_tokens
        self.limit = limit


class QueueFull(MeshError):
    """The request queue is at its bound; the client should retry later."""


class ShuttingDown(MeshError):
    """The agent is stopping and takes no new work."""
