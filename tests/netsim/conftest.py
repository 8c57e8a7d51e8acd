import sys
from pathlib import Path

# `net-sim/` is not importable by name (its hyphen); its package `netsim` lives inside it.
NET_SIM = Path(__file__).resolve().parents[2] / "net-sim"
if str(NET_SIM) not in sys.path:
    sys.path.insert(0, str(NET_SIM))
