from tests.gossip.conftest import _logs_to_current_stderr
from tests.net.conftest import sim_env

__all__ = ["_logs_to_current_stderr", "sim_env"]
