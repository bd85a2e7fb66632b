"""``conductor dev up|status|down``: the embedded broker and Redis."""

from __future__ import annotations

import shlex
import time
from pathlib import Path
from typing import Annotated

import typer

from conductor.cli.common import JsonLine, err, print_json, settings_or_exit
from conductor.harness.devstack import EmbeddedStack

DataDir = Annotated[Path | None, typer.Option(help="where pids, logs and Redis files go [default: "
    "CONDUCTOR_DATA_DIR]")]
KafkaPort = Annotated[int, typer.Option(help="broker port (0 = a free one)")]
RedisPort = Annotated[int, typer.Option(help="Redis port (0 = a free one)")]
UpDataDir = Annotated[Path | None, typer.Option(help="the data directory given to `dev up`")]


def _stack(data_dir: Path | None) -> EmbeddedStack:
    s = settings_or_exit()
    return EmbeddedStack(data_dir or s.data_dir, host=s.bind_host)


def up(data_dir: DataDir = None, kafka_port: KafkaPort = 0, redis_port: RedisPort = 0,
       json_out: JsonLine = False) -> None:
    """Start the embedded broker and Redis, wait until both answer, print their URLs.

    Later conductor commands find the running stack by themselves (through the data
    directory's stack.json); the output is also shell-ready for other tools:
    `eval "$(conductor dev up)"` exports both URLs.

    Nothing is started when CONDUCTOR_KAFKA_URL and CONDUCTOR_REDIS_URL name real servers.
    """
    s = settings_or_exit()
    if s.kafka_url and s.redis_url:
        out = {"kafka_url": s.kafka_url, "redis_url": s.redis_url, "embedded": False}
        print_json(out) if json_out else err.print("external servers configured; nothing started")
        return
    t0 = time.monotonic()
    st = _stack(data_dir).up(kafka_port=kafka_port, redis_port=redis_port)
    out = {
        "kafka_url": s.kafka_url or st.kafka_url,
        "redis_url": s.redis_url or st.redis_url,
        "embedded": True,
        "broker_pid": st.broker_pid,
        "redis_pid": st.redis_pid,
        "ready_s": round(time.monotonic() - t0, 3),
    }
    if json_out:
        print_json(out)
    else:
        typer.echo(f"export CONDUCTOR_KAFKA_URL={shlex.quote(str(out['kafka_url']))}")
        typer.echo(f"export CONDUCTOR_REDIS_URL={shlex.quote(str(out['redis_url']))}")
        # With a Kafka URL set, the profile defaults to production, which Tansu cannot serve.
        typer.echo("export CONDUCTOR_PROFILE=embedded")
        err.print(f"ready in {out['ready_s']}s (broker pid {st.broker_pid}, redis pid {st.redis_pid})")


def status(data_dir: UpDataDir = None, json_out: Annotated[bool, typer.Option("--json")] = False) -> None:
    """Say whether the embedded servers of a data directory run, and where."""
    st = _stack(data_dir).status()
    if json_out:
        print_json(st)
    else:
        for k, v in st.items():
            typer.echo(f"{k}: {v}")
    raise typer.Exit(0 if st.get("running") else 1)


def down(data_dir: UpDataDir = None) -> None:
    """Stop exactly the processes `dev up` started (by pid)."""
    stopped = _stack(data_dir).down()
    err.print(f"stopped {len(stopped)} process(es): {' '.join(map(str, stopped)) or '-'}")


def register(groups: dict[str, typer.Typer]) -> None:
    dev = groups["dev"]
    dev.command("up")(up)
    dev.command("status")(status)
    dev.command("down")(down)
