"""A progress line for long work: a bar with rate on a terminal, sparse lines otherwise."""

from __future__ import annotations

import sys
import time
from typing import TextIO

from meshagent.wording import size


class ProgressBar:
    def __init__(self, label: str, *, out: TextIO | None = None, width: int = 30) -> None:
        self.label = label
        self.out = out or sys.stderr
        self.tty = self.out.isatty()
        self.width = width
        self._start = time.monotonic()
        self._last_draw = 0.0
        self._last_decile = -1

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        frac = done / total if total else 1.0
        rate = done / max(now - self._start, 1e-6)
        text = f"{self.label} {size(done)}/{size(total)} {size(rate)}/s"
        if self.tty:
            if now - self._last_draw < 0.1 and done < total:
                return
            self._last_draw = now
            filled = int(frac * self.width)
            bar = "#" * filled + "-" * (self.width - filled)
            self.out.write(f"\r[{bar}] {frac:4.0%} {text}")
            if done >= total:
                self.out.write("\n")
        else:
            decile = int(frac * 10)
            if decile == self._last_decile:
                return
            self._last_decile = decile
            self.out.write(f"{frac:4.0%} {text}\n")
        self.out.flush()
