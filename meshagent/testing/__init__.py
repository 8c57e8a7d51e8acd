"""Test doubles that ship with the package so tests, benchmarks and net-sim share them.

Nothing outside `meshagent.testing` imports from it.
"""
