"""The view's Lua scripts: one file each in ``state/lua/`` (shipped as package data); another
package's ``lua/`` is read the same way (``lua(name, package)``).

Each file opens with comments saying what it does, its KEYS, ARGV and reply; :func:`lua`
drops that header, so what goes to Redis is the code alone.
"""

from __future__ import annotations

import functools
from importlib.resources import files


@functools.cache
def lua(name: str, package: str = "state") -> str:
    """The code of ``lua/<name>.lua`` in ``package`` (the view's own: ``state/lua/``), less its
    leading comment lines."""
    text = files(package).joinpath(f"lua/{name}.lua").read_text(encoding="utf-8")
    lines = text.splitlines(keepends=True)
    start = 0
    while start < len(lines) and lines[start].startswith("--"):
        start += 1
    return "".join(lines[start:])
