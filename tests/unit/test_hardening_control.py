"""The control topic (issue 36, item 11): compacted by keys whose survivors fold to the same state,
and a follower that does not report itself started before it has caught up."""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any, get_args

import pytest

from conductor.costmodel.guard import wire
from conductor.costmodel.profiles import DEFAULT_PROFILE, load_profile
from conductor.errors import ConfigError
from conductor.routing import control_follow
from conductor.routing.control import ControlState, control_key, fold_control
from conductor.routing.control_follow import ControlFollower
from conductor.routing.control_log import publish_control
from conductor.settings import Settings
from schemas import ControlCommand
from schemas.records import ControlAction
from streams.topics import TopicConfig, topics

BASE = load_profile(DEFAULT_PROFILE)
NODES = ("n1", "n2", "n3")


def command(rng: random.Random) -> ControlCommand:
    action: ControlAction = rng.choice(get_args(ControlAction))
    if action == "set_policy":
        return ControlCommand(action=action, policy=rng.choice(["a", "b"]), params={"k": rng.randrange(9)})
    if action == "set_params":
        return ControlCommand(action=action, policy=rng.choice([None, "a", "b"]), params={"k": rng.randrange(9)})
    if action == "set_profile":
        return ControlCommand(action=action, profile={**wire(BASE), "name": f"p{rng.randrange(9)}"})
    return ControlCommand(action=action, node_id=rng.choice(NODES))


def compacted(records: list[tuple[int, ControlCommand]]) -> list[tuple[int, ControlCommand]]:
    """What Kafka's compaction leaves: the last record of each key, at its own offset."""
    last = {control_key(c): o for o, c in records}
    return [(o, c) for o, c in records if last[control_key(c)] == o]


def decides(st: ControlState) -> tuple[Any, ...]:
    return (st.policy, None if st.params is None else dict(st.params), st.profile and st.profile.name, st.offset,
            st.excluded, tuple(st.node_status(n) == "active" for n in NODES))


@pytest.mark.parametrize("seed", range(200))
def test_the_compacted_topic_folds_to_the_state_routers_decide_with(seed: int) -> None:
    rng = random.Random(seed)
    records = [(i * 3, command(rng)) for i in range(rng.randrange(1, 40))]
    assert decides(fold_control(compacted(records))) == decides(fold_control(records))


def test_the_control_topic_is_compacted_after_the_audit_retention() -> None:
    c = topics(TopicConfig("conductor.", 4, audit_retention_ms=7_000)).control
    assert dict(c.configs)["cleanup.policy"] == "compact" and dict(c.configs)["min.compaction.lag.ms"] == "7000"
    kept = topics(TopicConfig("conductor.", 4, audit_retention_ms=-1)).control  # decisions kept for good: control too
    assert dict(kept.configs) == {"cleanup.policy": "delete", "retention.ms": "-1"}


async def test_a_profile_the_routers_would_skip_is_not_published() -> None:
    # Published, it would replace the last good profile once compacted.
    with pytest.raises(ConfigError, match="ttft_ratio_p90"):
        await publish_control(Settings(), ControlCommand(action="set_profile",
                                                         profile={**wire(BASE), "ttft_ratio_p90": 30.0}))


class SlowFollower:
    """A control topic whose catch-up takes 5 fetches."""

    def __init__(self, *_: Any, **__: Any) -> None:
        self.fetches = 0
        self.positions: dict[tuple[str, int], int] = {}
        self.ends = {("conductor.control", 0): 5}

    async def start(self) -> None:
        return None

    async def fetch(self, timeout_ms: int = 0) -> list[Any]:
        self.fetches += 1
        self.positions[("conductor.control", 0)] = self.fetches
        return []

    @property
    def caught_up(self) -> bool:
        return self.fetches >= 5


async def test_the_follower_starts_only_once_caught_up(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [0.0]

    def monotonic() -> float:
        clock[0] += 11.0  # every fetch slower than the old 10 s deadline
        return clock[0]

    monkeypatch.setattr(control_follow, "Follower", SlowFollower)
    monkeypatch.setattr(control_follow, "time", SimpleNamespace(monotonic=monotonic))
    follower = ControlFollower(Settings(), router=object())  # type: ignore[arg-type]
    await follower.start()
    assert follower.caught_up and follower.position == 5
    # A tool that may go on without it still can.
    impatient = ControlFollower(Settings(), router=object())  # type: ignore[arg-type]
    await impatient.start(catch_up_timeout_s=20.0)
    assert not impatient.caught_up
