"""Helpers for testing pipelines: toy stages, topologies and the leak check."""
