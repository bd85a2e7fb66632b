"""One root for Conductor's errors; adapters translate driver errors into these."""


class ConductorError(Exception):
    """Root of every error Conductor raises on purpose."""


class ConfigError(ConductorError):
    """A setting is missing or invalid; the message names the field."""


class StackError(ConductorError):
    """The embedded broker or Redis could not be started, reached or stopped."""


class ViewStoreError(ConductorError):
    """The view store (Redis) failed or is unreachable."""
