from tests.net.conftest import clock, env, sim_env

__all__ = ["clock", "env", "sim_env"]
