# Common development recipes. `just --list` shows them.

venv := ".venv/bin"

# Start an agent on the embedded default model
up *ARGS:
    {{venv}}/meshagent up {{ARGS}}

# Run the whole test suite
test *ARGS:
    {{venv}}/python -m pytest {{ARGS}}

# Lint and check formatting
lint:
    {{venv}}/ruff check .
    {{venv}}/ruff format --check .

# API decode speed vs llama-cpp-python called directly
bench-serve *ARGS:
    {{venv}}/python bench/serve.py {{ARGS}}

# net-sim (root): split serving in REGIME (lan, wan, longhaul, mixed, all), a report in net-sim/reports/
sim REGIME="wan" *ARGS:
    {{venv}}/python net-sim/sim.py split --regime {{REGIME}} {{ARGS}}

# net-sim (root): split serving in wan with a 200-request soak
sim-soak *ARGS:
    {{venv}}/python net-sim/sim.py soak {{ARGS}}

# net-sim (root): kill, partition and power-cut a stage host under load
sim-faults *ARGS:
    {{venv}}/python net-sim/sim.py faults {{ARGS}}

# net-sim (root): 200 requests over 4 agents in wan while stage hosts are killed, stopped, cut
sim-churn *ARGS:
    {{venv}}/python net-sim/sim.py churn {{ARGS}}

# net-sim (root): conversations of two turns through a split in wan, kept prefixes
sim-prefix *ARGS:
    {{venv}}/python net-sim/sim.py prefix {{ARGS}}

# net-sim (root): mDNS on a LAN, and the relay between isolated hosts
sim-discovery *ARGS:
    {{venv}}/python net-sim/sim.py discovery {{ARGS}}

# net-sim (root): the link emulator's own latency, packet rate and throughput
sim-limits *ARGS:
    {{venv}}/python net-sim/limits.py {{ARGS}}

# net-sim (root): every pair of NAT kinds, 20 runs each: direct or relayed, how fast
sim-nat *ARGS:
    {{venv}}/python net-sim/sim.py nat {{ARGS}}
