"""What every command module shares: the command groups, error output, settings and result printing."""

from __future__ import annotations

import json
import logging
import sys

import typer
from rich.console import Console

from conductor.errors import ConductorError
from conductor.settings import Settings, load_settings

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


@app.callback()
def _root(verbose: bool = typer.Option(False, "--verbose", "-v", help="debug logs")) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
