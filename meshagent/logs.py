"""structlog setup: pretty on a terminal, JSON lines otherwise."""

from __future__ import annotations

import logging
import sys

import structlog

LEVELS = ("debug", "info", "warning", "error")


class _Stderr:
    """Whatever sys.stderr is at the moment of writing, not at configuration time (it can be
    replaced afterwards, as test runners do)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure(level: str = "info", *, json: bool | None = None) -> None:
    """Configure structlog (and stdlib logging of libraries) for the whole process."""
    if level not in LEVELS:
        raise ValueError(f"log level must be one of {', '.join(LEVELS)}")
    numeric = getattr(logging, level.upper())
    if json is None:
        json = not sys.stderr.isatty()
    renderer: structlog.typing.Processor
    if json:
        renderer = structlog.processors.JSONRenderer()
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=True)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=_Stderr()),
        cache_logger_on_first_use=True,
    )
    # Libraries (hypercorn, zeroconf) log through stdlib; keep them quiet unless debugging.
    logging.basicConfig(level=max(numeric, logging.WARNING), stream=sys.stderr)
