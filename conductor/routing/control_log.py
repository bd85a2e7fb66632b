"""The ``control`` topic's I/O: publish an operator's command, read the commands back.

The fold itself is pure (:mod:`conductor.routing.control`); this module is what the
admin API, ``conductor control`` and ``conductor explain`` use to reach the log.
A command is checked against the policy factory before it is published, so a typo
is refused at once instead of being skipped by every router.
"""

from __future__ import annotations

import time
from typing import Any

from conductor.costmodel.profiles import load_profile, profile_from_dict
from conductor.routing.control import ControlState, control_key, fold_control
from conductor.routing.policies import make_policy
from conductor.settings import Settings
from schemas import ControlCommand, envelope
from streams.follow import Earliest, Follower, OnBad
from streams.kafka import ensure_topics, producer
from streams.topics import topics


def policy_check(settings: Settings) -> Any:
    """The check every router applies (:meth:`Router.check_policy`), from settings alone."""
    profile = load_profile(settings.model_profile)

    def check(name: str | None, params: dict[str, Any]) -> None:
        make_policy(name or settings.policy, params, profile)

    return check


async def publish_control(settings: Settings, cmd: ControlCommand, *, producer_id: str = "conductor-admin") -> int:
    """Check ``cmd`` (ConfigError if its policy or params are bad), publish it, return its offset."""
    if cmd.action in ("set_policy", "set_params"):
        policy_check(settings)(cmd.policy, dict(cmd.params))
    elif cmd.action == "set_profile":  # one the routers would skip would also replace the last good one
        profile_from_dict(dict(cmd.profile or {}), source="set_profile")
    t = topics(settings.topic_config())
    await ensure_topics(settings.kafka(), (t.control,))
    prod = producer(settings.kafka())
    await prod.start()
    try:
        env = envelope(cmd, producer_id=producer_id, producer_seq=time.time_ns() // 1000,
                       ts_ms=int(time.time() * 1000))
        md = await (await t.control.send(prod, env, control_key(cmd), partition=0))
        return int(md.offset)
    finally:
        await prod.stop()


async def control_records(settings: Settings, upto: int | None = None) -> list[tuple[int, ControlCommand]]:
    """The ``control`` topic's commands with their offsets (up to ``upto`` inclusive)."""
    topic = topics(settings.topic_config()).control
    out: list[tuple[int, ControlCommand]] = []
    # Another's topic: an unreadable record is skipped here (the fold skips it the same way).
    async with Follower(settings.kafka(), [(topic, Earliest())], on_bad=OnBad.SKIP, name="control reader",
                        max_records=None, track_end=True) as follower:
        end = follower.ends.get((topic.name, 0), 0)
        if upto is not None:
            end = min(end, upto + 1)
        deadline = time.monotonic() + 10.0
        while follower.positions.get((topic.name, 0), 0) < end and time.monotonic() < deadline:
            for batch in await follower.fetch():
                for rec in batch.records:
                    if rec.offset < end and rec.env is not None and isinstance(rec.env.body, ControlCommand):
                        out.append((rec.offset, rec.env.body))
    return out


async def current_control(settings: Settings) -> ControlState:
    """The control state every router holds once caught up (the same fold, the same check)."""
    return fold_control(await control_records(settings), check=policy_check(settings))


__all__ = ["control_records", "current_control", "policy_check", "publish_control"]
