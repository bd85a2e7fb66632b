"""Waiting on a system of real processes: poll until something shows, fail at once when one of
them exits (with its log's tail) or at the deadline."""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any


def log_tails(procs: Mapping[str, subprocess.Popen[bytes]], log_dir: Path, chars: int = 1500) -> str:
    """The end of each process's ``<name>.log`` in ``log_dir``."""
    out = []
    for name in procs:
        log = log_dir / f"{name}.log"
        out.append(f"--- {name}.log\n{log.read_text(errors='replace')[-chars:] if log.exists() else '(none)'}")
    return "\n".join(out)


async def wait_for(what: str, probe: Callable[[], Awaitable[Any]], procs: Mapping[str, subprocess.Popen[bytes]],
                   log_dir: Path, *, timeout: float = 40.0, every: float = 0.1) -> Any:
    """``probe()``'s first truthy answer; the processes of ``procs`` (name → process, logging to
    ``log_dir/<name>.log``) must stay up meanwhile."""
    deadline = time.monotonic() + timeout
    while True:
        for name, p in procs.items():
            assert p.poll() is None, f"conductor {name} exited\n{log_tails(procs, log_dir)}"
        got = await probe()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}\n{log_tails(procs, log_dir)}"
        await asyncio.sleep(every)
