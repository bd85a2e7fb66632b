"""The package layers hold (import-linter's contracts in pyproject.toml), and the CLI registers every command."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_import_contracts_hold() -> None:
    lint = Path(sys.executable).with_name("lint-imports")
    out = subprocess.run([str(lint), "--config", str(ROOT / "pyproject.toml"), "--no-cache"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    # Every contract in pyproject.toml is checked and kept (the count follows the file, so adding a
    # contract cannot silently leave it unchecked).
    import tomllib

    wanted = len(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"])
    assert f"Contracts: {wanted} kept, 0 broken" in out.stdout, out.stdout


def test_cli_registers_every_command_module() -> None:
    from conductor import cli

    names = {c.name for c in cli.app.registered_commands}
    groups = {g.name for g in cli.app.registered_groups}
    assert {"worker", "router", "balance", "explain", "simulate", "bridge", "engine", "demo", "policies"} <= names
    assert {"dev", "view", "bench"} <= groups
    modules = {p.stem for p in (ROOT / "conductor" / "cli").glob("*.py")} - {"__init__", "common"}
    assert modules == {m.__name__.rsplit(".", 1)[1] for m in cli.COMMAND_MODULES}
