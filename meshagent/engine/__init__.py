"""Inference engines behind one interface: whole models and stages on llama.cpp. The in-process
staged pipeline and the numpy reference, used by tests and benchmarks, are in `meshagent.testing`.
"""
