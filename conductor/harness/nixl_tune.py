"""A delay for NIXL's progress thread in the vLLM kit's engines (installed by ``scripts/vllm-kit``).

NIXL's Python API (1.5) builds every agent with its progress thread on and ``pthrDelay = 0``: the
thread polls UCX without ever sleeping, so each engine with a NIXL connector keeps a core busy
even when idle (two P/D engines load a 2-core machine to 13-17 and slow the third engine's TTFT
from ~15 ms to 0.1-10 s). The kit's copy of this file (``conductor_nixl_tune.py`` in its
site-packages; a ``.pth`` line calls :func:`install` at every start) makes the agent take the delay in
``KIT_NIXL_PTHR_DELAY_US`` instead; in a process without that variable it does nothing.

The same start-up hook also asks Linux for the AMX tile state (:func:`allow_amx`). vLLM's CPU
attention picks its AMX kernel on CPUs that have AMX (bf16, blocks of 32), and a process that
runs an AMX instruction before asking dies of SIGILL. An aggregated engine's first forward is a
prefill whose bf16 matmuls (oneDNN) ask on its behalf; a P/D decode engine's first forward can be
a one-token step over pulled KV that no such matmul precedes, and its worker died on the first
hand-off (seen on a Xeon with AMX, 2026-11-29). Asking first costs one system call, and nothing
where the CPU or the kernel has no AMX.

It runs in the kit's own venv, where Conductor is not installed: standard library only.
"""

from __future__ import annotations

import ctypes
import importlib.abc
import importlib.machinery
import importlib.util
import os
import platform
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

ENV = "KIT_NIXL_PTHR_DELAY_US"


def _patch(bindings: ModuleType, delay_us: int) -> None:
    make: Callable[..., Any] = getattr(bindings, "nixlAgent")  # noqa: B009  # a compiled module: no stubs

    def agent(name: str, config: Any, *args: Any, **kwargs: Any) -> Any:
        config.pthrDelay = delay_us
        return make(name, config, *args, **kwargs)

    setattr(bindings, "nixlAgent", agent)  # noqa: B010  # the API module looks it up at each call


class _Finder(importlib.abc.MetaPathFinder):
    """Patches ``nixl_cu*._bindings`` (NIXL's compiled module) right after it loads."""

    def __init__(self, delay_us: int) -> None:
        self.delay_us = delay_us

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if not (fullname.startswith("nixl_") and fullname.endswith("._bindings")):
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        loader = spec.loader if spec is not None else None
        if spec is None or loader is None:
            return spec
        run = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            _patch(module, self.delay_us)

        loader.exec_module = exec_module  # type: ignore[method-assign]  # this spec's loader only
        return spec


ARCH_PRCTL = 158
"""x86-64's ``arch_prctl`` system call."""
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18


def allow_amx() -> bool:
    """Ask Linux for the AMX tile data state for this process (what oneDNN asks before its AMX
    kernels); True when granted. False, and nothing else, on other systems and CPUs."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.syscall(ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)) == 0
    except (OSError, AttributeError):
        return False


def install() -> None:
    """Allow AMX (:func:`allow_amx`); hook NIXL's import when ``KIT_NIXL_PTHR_DELAY_US`` holds a
    number of microseconds."""
    allow_amx()
    value = os.environ.get(ENV, "")
    if value.isdigit():
        sys.meta_path.insert(0, _Finder(int(value)))

