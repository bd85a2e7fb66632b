"""``conductor dev up|status|down``: the embedded broker and Redis."""

from __future__ import annotations

import shlex
import time
from pathlib import Path

import typer

from conductor.cli.common import err, print_json, settings_or_exit
from conductor.harness.devstack import EmbeddedStack


def register(groups: dict[str, typer.Typer]) -> None:
    dev = groups["dev"]

    def _stack(data_dir: Path | None) -> EmbeddedStack:
        s = settings_or_exit()
        return EmbeddedStack(data_dir or s.data_dir, host=s.bind_host)

    @dev.command("up")
    def up(
        data_dir: Path = typer.Option(None, help="where pids, logs and Redis files go [default: CONDUCTOR_DATA_DIR]"),
        kafka_port: int = typer.Option(0, help="broker port (0 = a free one)"),
        redis_port: int = typer.Option(0, help="Redis port (0 = a free one)"),
        json_out: bool = typer.Option(False, "--json", help="print one JSON line"),
    ) -> None:
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

    @dev.command("status")
    def status(
        data_dir: Path = typer.Option(None, help="the data directory given to `dev up`"),
        json_out: bool = typer.Option(False, "--json"),
    ) -> None:
        """Say whether the embedded servers of a data directory run, and where."""
        st = _stack(data_dir).status()
        if json_out:
            print_json(st)
        else:
            for k, v in st.items():
                typer.echo(f"{k}: {v}")
        raise typer.Exit(0 if st.get("running") else 1)

    @dev.command("down")
    def down(data_dir: Path = typer.Option(None, help="the data directory given to `dev up`")) -> None:
        """Stop exactly the processes `dev up` started (by pid)."""
        stopped = _stack(data_dir).down()
        err.print(f"stopped {len(stopped)} process(es): {' '.join(map(str, stopped)) or '-'}")
