"""The test tree holds no packages, so pytest imports every test file by its bare name: two files
with one name in different folders stop the whole collection ("import file mismatch"), as
``test_gateway_workers.py`` in unit and integration once did."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_every_test_file_has_a_name_of_its_own() -> None:
    where: defaultdict[str, list[str]] = defaultdict(list)
    for path in TESTS.rglob("test_*.py"):
        where[path.name].append(str(path.relative_to(TESTS)))
    assert len(where) > 50  # the tree was found
    clashes = {name: paths for name, paths in where.items() if len(paths) > 1}
    assert not clashes, f"rename one of each: {clashes}"
