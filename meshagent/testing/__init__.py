"""Code for tests and benchmarks, not for a running agent: the fake engine (`fake_engine.py`:
deterministic logits, fake split stages), tiny random-weight GGUF models (`tiny_gguf.py`), the
numpy reference engine (`numpy_ref.py`), the simulated network (`sim_network.py`) and agents'
overlay, gossip and dialer on it (`sim_agents.py`), a member of a running agent's mesh
(`member.py`) and the hostile member built on it (`hostile.py`), and the schemas, tools and
reference log-probabilities that structured-output tests and benchmarks share
(`structured_output.py`), and the copy-shaped prompts speculation is measured on
(`workloads.py`).

Modules here may import the rest of the package; nothing else in the package may import them
(tests/test_layering.py checks it).
"""
