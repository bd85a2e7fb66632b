"""``conductor gateway --workers N``: N gateway processes serving one listening socket.

One gateway process is one core at most (Python's event loop). The parent binds the port once
(port 0 gives a free one), forks N workers that inherit the socket, as gunicorn does, and waits;
the kernel hands each new connection to a worker blocked in ``accept``, so a worker still
starting takes none. Each worker is a full gateway (its own producer, colocated router or reply
inbox, HTTP server) with its own id, ``<gateway id>-w<i>``: its own producer id on the log and,
with ``--routing log``, its own reply topic. What must be shared already is: reservations,
pending blocks and in-flight charges go through Redis, decisions through the log.

The parent prints one ready line once every worker is ready (the first worker's, plus
``workers`` and ``gateway_ids``); SIGTERM or SIGINT is passed to every worker, which drains as
one gateway does. A worker that ends on its own ends the others: the supervisor (systemd,
Kubernetes) restarts the whole, so the port never serves with fewer workers than asked.

Needs ``os.fork`` (Linux, macOS) and a parent with no threads yet (forking a threaded process can
leave a lock held forever in the child): :func:`check_supported` says so before anything starts.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import socket
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any

from conductor.errors import ConfigError

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1

Ready = Callable[[dict[str, Any]], None]
Work = Callable[[int, Ready], int]
"""One worker's life: ``work(index, ready)`` serves until stopped and returns its exit status;
it calls ``ready(line)`` once it serves."""


def check_supported(workers: int) -> None:
    """:class:`ConfigError` naming ``--workers`` where N > 1 cannot run here."""
    if workers <= 1:
        return
    if not hasattr(os, "fork"):
        raise ConfigError(
            f"--workers {workers} forks worker processes, and this platform ({sys.platform}) has no "
            "fork: run one gateway per port behind a load balancer instead"
        )
    if threading.active_count() > 1:
        raise ConfigError(
            f"--workers {workers}: this process already runs {threading.active_count()} threads, "
            "and forking it could leave a lock held in a worker"
        )


def _end_with(parent: int) -> None:
    """Linux: this worker gets SIGTERM when the parent dies, even by SIGKILL (no orphan keeps the
    port); elsewhere a worker outlives a killed parent until it is stopped."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # it died before the line above
        os.kill(os.getpid(), signal.SIGTERM)


def worker_ids(gateway_id: str, workers: int) -> list[str]:
    """Each worker's gateway id: ``gateway_id`` itself for one, ``<gateway_id>-w<i>`` for several."""
    return [gateway_id] if workers <= 1 else [f"{gateway_id}-w{i}" for i in range(workers)]


def run_workers(workers: int, sock: socket.socket, work: Work, announce: Ready) -> int:
    """Fork ``workers`` processes running ``work`` (``sock`` inherited), ``announce`` the ready line
    once each has called its ``ready``, pass SIGTERM/SIGINT on, and wait for them all. Returns the
    exit status: 0 when every worker ended with 0 after a signal, else 1."""
    r, w = os.pipe()
    pids: list[int] = []
    parent = os.getpid()
    for i in range(workers):
        pid = os.fork()
        if pid == 0:  # the worker
            os.close(r)
            code = 1
            try:
                _end_with(parent)
                with os.fdopen(w, "w", buffering=1) as out:

                    def ready(line: dict[str, Any], out: Any = out) -> None:
                        out.write(json.dumps(line) + "\n")
                        out.flush()

                    code = work(i, ready)
            except BaseException:  # noqa: BLE001 - said on stderr; the parent sees the status
                traceback.print_exc()
            finally:
                os._exit(code)
        pids.append(pid)
    os.close(w)
    sock.close()  # the workers hold it
    stopping = False

    def stop_all(signum: int = signal.SIGTERM, _frame: Any = None) -> None:
        nonlocal stopping
        stopping = True
        for p in pids:
            try:
                os.kill(p, signal.SIGTERM)
            except ProcessLookupError:
                pass

    signal.signal(signal.SIGTERM, stop_all)
    signal.signal(signal.SIGINT, stop_all)
    lines: list[dict[str, Any]] = []
    with os.fdopen(r) as inbox:
        for raw in inbox:  # EOF once every worker closed its end: ready or gone
            lines.append(json.loads(raw))
            if len(lines) == workers:
                first = min(lines, key=lambda x: int(x.get("worker", 0)))
                announce(
                    {
                        **first,
                        "gateway_id": first["gateway_id"],
                        "workers": workers,
                        "gateway_ids": [x["gateway_id"] for x in sorted(lines, key=lambda x: int(x["worker"]))],
                    }
                )
    if len(lines) < workers and not stopping:
        log.error("a gateway worker ended before it was ready: stopping the others")
        stop_all()
    failed = len(lines) < workers and not stopping
    left = set(pids)
    while left:
        pid, status = os.waitpid(-1, 0)
        if pid not in left:
            continue
        left.discard(pid)
        code = os.waitstatus_to_exitcode(status)
        if not stopping:
            log.error("gateway worker %d ended (status %d) while serving: stopping the others", pid, code)
            failed = True
            stop_all()
        elif code != 0:
            failed = True
    return 1 if failed else 0
