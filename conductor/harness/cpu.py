"""CPU seconds of named processes over a bench's measured phase, read from ``/proc`` (Linux).

A bench names the processes it started (``{"gateway": pid, "worker": pid, ...}``), takes a
:func:`cpu_snapshot` before and after the phase it measures, and reports :func:`cpu_report`'s
fields: ``control_cpu_s``, ``control_cpu_s_by_process``, ``control_cpu_ms_per_request`` and
``control_cpu_ms_per_request_by_process``. A process's time is its own user + system time
plus that of its live descendants (a gateway's or an engine's own workers) and of the children
it has reaped, so a process that forks its workers is counted whole. Components that run inside
the bench's own process cannot be told apart from the client: a bench names them in
``in_process`` and they are listed as such, never guessed.

Where there is no ``/proc`` (macOS) or a process is gone, its time is None and the totals
count what could be read (``control_cpu_unreadable`` names the rest).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

PROC = Path("/proc")
_LISTEN = "0A"
"""The TCP state ``/proc/net/tcp`` gives a listening socket."""


@dataclass(frozen=True)
class ProcStat:
    """The ``/proc/<pid>/stat`` fields this module needs, CPU times in clock ticks."""

    pid: int
    ppid: int
    own_ticks: int
    """utime + stime."""
    reaped_ticks: int
    """cutime + cstime: children that exited and were waited for."""


def parse_stat(text: str) -> ProcStat:
    """One ``/proc/<pid>/stat`` line (the command may hold spaces and parentheses: split at the last ``)``)."""
    head, rest = text.rsplit(")", 1)
    pid = int(head.split("(", 1)[0])
    f = rest.split()
    # After the command: state ppid ... utime(14) stime(15) cutime(16) cstime(17), 1-based in proc(5).
    return ProcStat(pid=pid, ppid=int(f[1]), own_ticks=int(f[11]) + int(f[12]), reaped_ticks=int(f[13]) + int(f[14]))


def _read_stats(proc: Path = PROC) -> dict[int, ProcStat]:
    out: dict[int, ProcStat] = {}
    for d in proc.iterdir():
        if not d.name.isdigit():
            continue
        try:
            out[int(d.name)] = parse_stat((d / "stat").read_text())
        except (OSError, ValueError, IndexError):
            continue  # gone between the listing and the read, or not ours to read
    return out


def tree_ticks(stats: Mapping[int, ProcStat], root: int) -> int | None:
    """CPU ticks of ``root`` and every live descendant, each with the children it reaped; None if ``root`` is gone."""
    if root not in stats:
        return None
    children: dict[int, list[int]] = {}
    for s in stats.values():
        children.setdefault(s.ppid, []).append(s.pid)
    total, todo, seen = 0, [root], set()
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        s = stats[pid]
        total += s.own_ticks + s.reaped_ticks
        todo.extend(children.get(pid, ()))
    return total


def cpu_snapshot(pids: Mapping[str, int | None], proc: Path = PROC) -> dict[str, float | None]:
    """CPU seconds so far of each named process tree (None: gone, unknown, or no ``/proc``)."""
    if not proc.is_dir():
        return {name: None for name in pids}
    stats = _read_stats(proc)
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float | None] = {}
    for name, pid in pids.items():
        t = tree_ticks(stats, pid) if pid is not None else None
        out[name] = None if t is None else t / tick
    return out


def cpu_delta(before: Mapping[str, float | None], after: Mapping[str, float | None]) -> dict[str, float | None]:
    """Seconds each process used between two snapshots (None where either side could not be read)."""
    return {name: (None if b is None or after.get(name) is None else max(0.0, after[name] - b))  # type: ignore[operator]
            for name, b in before.items()}


def cpu_report(used: Mapping[str, float | None], requests: int, *, in_process: Iterable[str] = (),
               prefix: str = "control_") -> dict[str, Any]:
    """The bench fields for ``used`` (from :func:`cpu_delta`) over ``requests`` requests.

    ``in_process``: components that ran inside the bench's own process (their time is the
    client's too, so it is not counted). The totals add what could be read."""
    read = {k: v for k, v in used.items() if v is not None}
    total = sum(read.values())
    per = (lambda s: round(1000 * s / requests, 3)) if requests > 0 else (lambda s: None)
    return {
        f"{prefix}cpu_s": round(total, 3) if read else None,
        f"{prefix}cpu_s_by_process": {k: round(v, 3) for k, v in sorted(read.items())},
        f"{prefix}cpu_ms_per_request": per(total) if read else None,
        f"{prefix}cpu_ms_per_request_by_process": {k: per(v) for k, v in sorted(read.items())},
        f"{prefix}cpu_unreadable": sorted(k for k, v in used.items() if v is None),
        f"{prefix}cpu_in_bench_process": sorted(in_process),
    }


@dataclass
class CpuMeter:
    """Snapshots of a set of named processes: :meth:`start` before the measured phase, :meth:`report` after."""

    pids: dict[str, int | None]
    in_process: tuple[str, ...] = ()
    _before: dict[str, float | None] = field(default_factory=dict)
    _t0: float = 0.0
    wall_s: float = 0.0

    def start(self) -> CpuMeter:
        self._before = cpu_snapshot(self.pids)
        self._t0 = time.monotonic()
        return self

    def used(self) -> dict[str, float | None]:
        """Seconds used since :meth:`start` (and the wall seconds in :attr:`wall_s`)."""
        self.wall_s = time.monotonic() - self._t0
        return cpu_delta(self._before, cpu_snapshot(self.pids))

    def report(self, requests: int, prefix: str = "control_") -> dict[str, Any]:
        return cpu_report(self.used(), requests, in_process=self.in_process, prefix=prefix)


# --- servers named by URL -------------------------------------------------------------------------


def _listening_inodes(port: int, proc: Path = PROC) -> set[str]:
    inodes: set[str] = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = (proc / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if len(f) > 9 and f[3] == _LISTEN and int(f[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f[9])
    return inodes


def listener_pid(port: int, proc: Path = PROC) -> int | None:
    """The pid of the process listening on TCP ``port`` on this machine (None: none, or not ours to see)."""
    inodes = {f"socket:[{i}]" for i in _listening_inodes(port, proc)}
    if not inodes:
        return None
    for d in proc.iterdir():
        if not d.name.isdigit():
            continue
        try:
            for fd in (d / "fd").iterdir():
                if os.readlink(fd) in inodes:
                    return int(d.name)
        except OSError:
            continue
    return None


def _port(url: str) -> tuple[str, int | None]:
    parts = urlsplit(url if "//" in url else f"//{url.split(',')[0]}")
    return parts.hostname or "", parts.port


def server_pids(kafka_url: str | None, redis_url: str | None) -> dict[str, int | None]:
    """``broker`` and ``redis``: the pids serving these URLs when they run on this machine (the
    embedded stack's, or local servers'); None for a server elsewhere."""
    out: dict[str, int | None] = {}
    for name, url in (("broker", kafka_url), ("redis", redis_url)):
        if not url:
            continue
        host, port = _port(url)
        local = host in ("127.0.0.1", "localhost", "::1", "0.0.0.0", "")
        out[name] = listener_pid(port) if local and port else None
    return out


def affinity() -> list[int] | None:
    """The cores this process may run on (None where the platform does not say)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


__all__ = ["CpuMeter", "ProcStat", "affinity", "cpu_delta", "cpu_report", "cpu_snapshot", "listener_pid",
           "parse_stat", "server_pids", "tree_ticks"]
