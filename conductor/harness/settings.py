"""What only the harness reads: its own small settings object, from the same ``CONDUCTOR_*``
variables as the product's :class:`~conductor.settings.Settings`.

The product's settings know these variables' names (``HARNESS_VARIABLES``) and leave them to
this object, so an install without the harness accepts them and a child process inherits them.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from conductor.errors import ConfigError


class HarnessSettings(BaseSettings):
    """The harness's settings: read from the environment when built, validated, frozen."""

    # extra="ignore": every other CONDUCTOR_* variable is the product's (Settings checks those).
    model_config = SettingsConfigDict(env_prefix="CONDUCTOR_", extra="ignore", frozen=True)

    vllm_kit: Path | None = Field(
        default=None,
        description="the real-vLLM kit that scripts/vllm-kit makes (a venv with vLLM's CPU build and a tiny "
        "model; tests -m vllm); unset = ~/.cache/conductor/vllm-kit",
    )


def load_harness_settings() -> HarnessSettings:
    """Build and validate the harness's settings; a bad value raises :class:`ConfigError` naming the variable."""
    try:
        return HarnessSettings()
    except ValidationError as e:
        lines = [f"{'.'.join(str(p) for p in err['loc'])} (CONDUCTOR_{str(err['loc'][0]).upper()}): {err['msg']}"
                 for err in e.errors()]
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(lines)) from None


__all__ = ["HarnessSettings", "load_harness_settings"]
