"""Conductor: routing policy, routing worker, balance scheduler and the CLI."""

__version__ = "0.1.0"
