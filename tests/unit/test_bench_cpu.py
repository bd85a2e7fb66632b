"""The benches' CPU accounting (conductor/harness/cpu.py): /proc parsing, process trees, the report."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conductor.harness.bench.idle import core_percent
from conductor.harness.cpu import (
    CpuMeter,
    ProcStat,
    cpu_delta,
    cpu_report,
    cpu_snapshot,
    listener_pid,
    parse_stat,
    server_pids,
    tree_ticks,
)

linux = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")


def test_a_stat_line_with_spaces_and_parentheses_in_the_command() -> None:
    line = "4242 (tokio (rt) w) S 17 4242 4242 0 -1 4194560 100 0 0 0 250 75 30 12 20 0 9 0 1 2 3"
    assert parse_stat(line) == ProcStat(pid=4242, ppid=17, own_ticks=325, reaped_ticks=42)


def test_a_tree_counts_live_descendants_and_reaped_children_but_not_its_parent_or_siblings() -> None:
    stats = {p.pid: p for p in (
        ProcStat(1, 0, 1000, 0),       # init: not in the tree
        ProcStat(10, 1, 100, 5),        # the root (5 ticks of children it reaped)
        ProcStat(11, 10, 20, 0),        # its worker
        ProcStat(12, 11, 3, 0),         # the worker's own child
        ProcStat(20, 1, 700, 0),        # a sibling of the root
    )}
    assert tree_ticks(stats, 10) == 100 + 5 + 20 + 3
    assert tree_ticks(stats, 11) == 23
    assert tree_ticks(stats, 99) is None


def test_the_report_totals_what_could_be_read_and_names_the_rest() -> None:
    used = cpu_delta({"gateway": 1.0, "worker": 2.0, "broker": None, "redis": 0.5},
                     {"gateway": 1.5, "worker": 3.0, "broker": 4.0, "redis": 0.75})
    assert used == {"gateway": 0.5, "worker": 1.0, "broker": None, "redis": 0.25}
    r = cpu_report(used, 100, in_process=["bridges"])
    assert r["control_cpu_s"] == 1.75
    assert r["control_cpu_s_by_process"] == {"gateway": 0.5, "redis": 0.25, "worker": 1.0}
    assert r["control_cpu_ms_per_request"] == 17.5
    assert r["control_cpu_ms_per_request_by_process"]["worker"] == 10.0
    assert r["control_cpu_unreadable"] == ["broker"] and r["control_cpu_in_bench_process"] == ["bridges"]
    empty = cpu_report({"gateway": None}, 0, prefix="gateway_control_")
    assert empty["gateway_control_cpu_s"] is None and empty["gateway_control_cpu_ms_per_request"] is None


def test_without_proc_every_process_is_unreadable(tmp_path: Path) -> None:
    assert cpu_snapshot({"gateway": 1}, proc=tmp_path / "nothing") == {"gateway": None}


def test_core_percent_is_a_share_of_one_core() -> None:
    assert core_percent({"worker": 1.5, "redis": 0.3, "gone": None}, 30.0) == {"redis": 1.0, "worker": 5.0}


@linux
def test_a_meter_sees_a_childs_work_and_its_grandchilds() -> None:
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\n"
    # Once told to, the child starts a grandchild that burns 0.3 s of CPU, burns 0.3 s itself, waits
    # for the grandchild (still alive while measured: not reaped before the child is asked), says so.
    script = (f"import subprocess, sys\nsys.stdin.readline()\np = subprocess.Popen([sys.executable, '-c', {burn!r}])\n"
              f"{burn}p.wait()\nprint('done', flush=True)\nsys.stdin.readline()\n")
    child = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdin is not None and child.stdout is not None
    try:
        meter = CpuMeter({"child": child.pid, "gone": 2**22 + 12345}).start()
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline() == "done\n"
        r = meter.report(3)
    finally:
        child.kill()
        child.wait()
    # Both burns (the grandchild's through its parent's reaped time), and the grandchild's start-up.
    assert r["control_cpu_s_by_process"]["child"] >= 0.55
    assert r["control_cpu_ms_per_request"] >= 550 / 3
    assert r["control_cpu_unreadable"] == ["gone"] and meter.wall_s > 0


@linux
def test_the_server_behind_a_local_port_is_found() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert listener_pid(port) == os.getpid()
        assert server_pids(f"127.0.0.1:{port}", f"redis://127.0.0.1:{port}/0") == {"broker": os.getpid(),
                                                                                 "redis": os.getpid()}
    assert server_pids("kafka.example.com:9092", None) == {"broker": None}  # not on this machine
