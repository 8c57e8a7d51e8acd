from tests.gossip.conftest import _logs_to_current_stderr
from tests.net.conftest import clock, env, sim_env

__all__ = ["_logs_to_current_stderr", "clock", "env", "sim_env"]
