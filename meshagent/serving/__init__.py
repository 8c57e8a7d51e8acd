"""Turning requests into tokens: batching, sampling, stop conditions, chat templates."""
