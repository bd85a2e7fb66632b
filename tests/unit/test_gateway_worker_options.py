"""``conductor gateway --workers N`` (issue 35 item 4): where it cannot run it says so before
anything starts; each worker gets its own gateway id (its producer id on the log)."""

from __future__ import annotations

import os
import threading

import pytest

from conductor.errors import ConfigError
from conductor.gateway import workers


def test_one_worker_needs_nothing() -> None:
    workers.check_supported(1)
    assert workers.worker_ids("gw-a", 1) == ["gw-a"]


def test_several_workers_have_ids_of_their_own() -> None:
    assert workers.worker_ids("gw-a", 3) == ["gw-a-w0", "gw-a-w1", "gw-a-w2"]


def test_without_fork_several_workers_fail_naming_the_option(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(os, "fork")
    with pytest.raises(ConfigError, match="--workers 2 forks"):
        workers.check_supported(2)


def test_a_process_with_threads_is_not_forked() -> None:
    stop = threading.Event()
    t = threading.Thread(target=stop.wait)
    t.start()
    try:
        with pytest.raises(ConfigError, match="--workers 2: this process already runs"):
            workers.check_supported(2)
    finally:
        stop.set()
        t.join()
