"""Inference engines behind one interface: llama.cpp, and later the stage and numpy engines."""
