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


class ViewRefused(ViewStoreError):
    """The view refused a write that would not land on the state it was folded from: its
    generation changed (``reason="lost"``: lost or replaced) or a partition's fence is not
    the one the write continues from (``reason="hole"``). Retrying the same write cannot
    help: the writer reads its partitions back from the log (``streams.resume``)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
