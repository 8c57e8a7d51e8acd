"""Placement: where each layer of a model runs, decided by every agent from the same snapshot."""
