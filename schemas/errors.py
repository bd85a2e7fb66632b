"""One root for Conductor's errors, at the bottom of the package graph so every layer can raise them;
adapters translate driver errors into these (``raise ViewStoreError(...) from e``)."""


class ConductorError(Exception):
    """Root of every error Conductor raises on purpose."""


class ConfigError(ConductorError):
    """A setting is missing or invalid; the message names the field."""


class StackError(ConductorError):
    """The embedded broker or Redis could not be started, reached or stopped."""


class ViewStoreError(ConductorError):
    """The view store (Redis) failed or is unreachable."""
