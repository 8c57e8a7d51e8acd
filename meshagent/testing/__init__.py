"""Code for tests and benchmarks, not for a running agent: the fake engine (deterministic
logits, fake split stages), the simulated network, the staged in-process pipeline and the numpy
reference engine.

Modules here may import the rest of the package; nothing outside `meshagent.testing` may import
them (tests/test_layering.py checks it).
"""
