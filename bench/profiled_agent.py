"""`meshagent` with its main thread profiled on request: SIGUSR1 starts cProfile (timed by the
thread's own CPU clock, so waiting costs nothing), SIGUSR2 stops it and writes
`$MESHAGENT_PROFILE_DIR/<pid>.<n>.prof`. For `bench/profile_split.py` (`start_agent`'s
`launcher`); run as `python bench/profiled_agent.py up ...`."""

from __future__ import annotations

import cProfile
import os
import runpy
import signal
import sys
import time

_profile: list[cProfile.Profile] = []
_written = [0]


def _start(signum: int, frame: object) -> None:
    if not _profile:
        p = cProfile.Profile(time.thread_time)
        p.enable()
        _profile.append(p)


def _stop(signum: int, frame: object) -> None:
    if _profile:
        p = _profile.pop()
        p.disable()
        _written[0] += 1
        out = os.environ.get("MESHAGENT_PROFILE_DIR", ".")
        p.dump_stats(os.path.join(out, f"{os.getpid()}.{_written[0]}.prof"))


if __name__ == "__main__":
    signal.signal(signal.SIGUSR1, _start)
    signal.signal(signal.SIGUSR2, _stop)
    sys.argv = ["meshagent", *sys.argv[1:]]
    runpy.run_module("meshagent", run_name="__main__", alter_sys=True)
