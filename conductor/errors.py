"""Conductor's errors (defined in :mod:`schemas.errors`, which every layer may import)."""

from schemas.errors import ConductorError, ConfigError, StackError, ViewStoreError

__all__ = ["ConductorError", "ConfigError", "StackError", "ViewStoreError"]
