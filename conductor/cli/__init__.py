"""``conductor``: the command line, one module per area, each registered here by name.

A command module that goes missing fails this import (and the import-layer test), never
silently drops its commands.
"""

from __future__ import annotations

import sys

from rich.markup import escape

from conductor.cli import (
    admin,
    audit,
    balance,
    chaos,
    control,
    dev,
    engines,
    epp,
    fit,
    gateway,
    pipeline,
    plan,
    routing,
    simulate,
)
from conductor.cli.common import GROUPS, app, err, harness_library_missing
from conductor.errors import ConductorError

# Order is the order of --help.
COMMAND_MODULES = (dev, pipeline, routing, fit, control, admin, gateway, epp, balance, audit, chaos, simulate, engines,
                   plan)
for _module in COMMAND_MODULES:
    _module.register(GROUPS)


def main() -> None:
    try:
        app()
    except ConductorError as e:
        err.print(f"[red]error:[/red] {escape(str(e))}")
        sys.exit(2)
    except (ModuleNotFoundError, BaseExceptionGroup) as e:  # a harness command without the harness extra
        if (missing := harness_library_missing(e)) is None:
            raise
        err.print(f"[red]error:[/red] {escape(missing)}")
        sys.exit(2)


__all__ = ["app", "main"]
