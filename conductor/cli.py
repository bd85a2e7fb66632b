"""``conductor``: the command line. Each area registers its commands from its own module."""

from __future__ import annotations

import importlib
import json
import logging
import sys

import typer
from rich.console import Console

from .errors import ConductorError
from .settings import Settings, load_settings

app = typer.Typer(
    help="Conductor: a KVCache-centric global scheduler for prefill/decode-disaggregated LLM serving.\n\n"
    "Configuration comes from CONDUCTOR_* environment variables (see README).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
dev_app = typer.Typer(help="The embedded broker and Redis for development, tests and demos.", no_args_is_help=True)
view_app = typer.Typer(help="Inspect or rebuild the cache-location view.", no_args_is_help=True)
bench_app = typer.Typer(help="Benchmarks that print their numbers (one JSON line with --json).", no_args_is_help=True)
app.add_typer(dev_app, name="dev")
app.add_typer(view_app, name="view")
app.add_typer(bench_app, name="bench")
GROUPS = {"app": app, "dev": dev_app, "view": view_app, "bench": bench_app}

err = Console(stderr=True)

# Command modules, each with ``register(groups)``. Order is the order of --help.
COMMAND_MODULES = (
    "conductor.commands.dev",
    "conductor.commands.pipeline",
    "conductor.commands.routing",
    "conductor.commands.balance",
    "conductor.commands.audit",
    "conductor.commands.simulate",
    "conductor.commands.engines",
)


def settings_or_exit(**overrides: object) -> Settings:
    """Load the settings; on a bad value print the field and exit 2."""
    try:
        return load_settings(**overrides)
    except ConductorError as e:
        err.print(f"[red]error:[/red] {e}")
        raise typer.Exit(2) from None


def print_json(obj: object) -> None:
    sys.stdout.write(json.dumps(obj, sort_keys=False, default=str) + "\n")
    sys.stdout.flush()


def print_result(out: dict[str, object], json_out: bool) -> None:
    """A benchmark's or command's result: one JSON line, or ``key: value`` lines."""
    if json_out:
        print_json(out)
    else:
        for k, v in out.items():
            typer.echo(f"{k}: {v}")


def _register_all() -> None:
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name == name:
                continue  # an area not built yet
            raise
        module.register(GROUPS)


@app.callback()
def _root(verbose: bool = typer.Option(False, "--verbose", "-v", help="debug logs")) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


_register_all()


def main() -> None:
    try:
        app()
    except ConductorError as e:
        err.print(f"[red]error:[/red] {e}")
        sys.exit(2)
