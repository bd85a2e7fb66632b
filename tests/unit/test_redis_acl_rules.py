"""The Redis ACL rules of ``state.acl`` as docs/operations.md prints them: one source, no drift."""

from __future__ import annotations

from pathlib import Path

from state.acl import CLUSTER, acl_rules, commands

DOC = Path(__file__).resolve().parents[2] / "docs" / "operations.md"


def test_the_operations_guide_prints_the_rules_the_code_defines() -> None:
    text = DOC.read_text()
    assert "ACL SETUSER conductor on >PASSWORD " + " ".join(acl_rules("cv")) + "\n" in text
    assert "On a Redis Cluster add `" + " ".join(f"+{c}" for c in CLUSTER) + "`" in text


def test_the_rules_name_keys_of_one_namespace_and_nothing_administrative() -> None:
    rules = acl_rules("ns", cluster=True, db=2)
    assert rules[:4] == ["resetkeys", "~{ns}|*", "resetchannels", "-@all"]
    granted = {r[1:] for r in rules[4:]}
    assert granted == set(commands(cluster=True, db=2)) and "select" in granted and "select" not in commands()
    assert not granted & {"flushall", "flushdb", "keys", "config", "debug", "shutdown", "acl", "publish", "@all"}
