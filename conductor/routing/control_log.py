"""The ``control`` topic's I/O: publish an operator's command, read the commands back.

The fold itself is pure (:mod:`conductor.routing.control`); this module is what the
admin API, ``conductor control`` and ``conductor explain`` use to reach the log.
A command is checked against the policy factory before it is published, so a typo
is refused at once instead of being skipped by every router.
"""

from __future__ import annotations

import time
from typing import Any

from aiokafka import TopicPartition

from conductor.costmodel.profiles import load_profile
from conductor.routing.control import ControlState, fold_control
from conductor.routing.policies import make_policy
from conductor.settings import Settings
from schemas import ControlCommand, DecodeError, decode, encode, envelope, headers
from streams.kafka import consumer, end_offsets, ensure_topics, producer
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
    t = topics(settings.topic_config())
    await ensure_topics(settings.kafka(), (t.control,))
    prod = producer(settings.kafka())
    await prod.start()
    try:
        env = envelope(cmd, producer_id=producer_id, producer_seq=time.time_ns() // 1000,
                       ts_ms=int(time.time() * 1000))
        md = await prod.send_and_wait(t.control.name, encode(env), key=(cmd.node_id or cmd.policy or cmd.action).encode(),
                                      headers=headers(env), partition=0)
        return int(md.offset)
    finally:
        await prod.stop()


async def control_records(settings: Settings, upto: int | None = None) -> list[tuple[int, ControlCommand]]:
    """The ``control`` topic's commands with their offsets (up to ``upto`` inclusive)."""
    name = topics(settings.topic_config()).control.name
    c = consumer(settings.kafka(), group_id=None)
    await c.start()
    out: list[tuple[int, ControlCommand]] = []
    try:
        if not (c.partitions_for_topic(name) or set()):
            await c.topics()
            if not (c.partitions_for_topic(name) or set()):
                return out
        tp = TopicPartition(name, 0)
        c.assign([tp])
        end = (await end_offsets(c, [tp]))[tp]
        if upto is not None:
            end = min(end, upto + 1)
        await c.seek_to_beginning(tp)
        pos = 0
        deadline = time.monotonic() + 10.0
        while pos < end and time.monotonic() < deadline:
            for msgs in (await c.getmany(tp, timeout_ms=200)).values():
                for m in msgs:
                    if m.offset >= end:
                        break
                    pos = m.offset + 1
                    try:
                        body = decode(m.value).body
                    except DecodeError:
                        continue
                    if isinstance(body, ControlCommand):
                        out.append((m.offset, body))
    finally:
        await c.stop()
    return out


async def current_control(settings: Settings) -> ControlState:
    """The control state every router holds once caught up (the same fold, the same check)."""
    return fold_control(await control_records(settings), check=policy_check(settings))


__all__ = ["control_records", "current_control", "policy_check", "publish_control"]
