"""The vLLM command executor's decisions, against a fake view and a fake HTTP transport.

A ``replicate`` is two calls (the holder prefills with ``do_remote_decode``, this engine pulls
with the returned params); everything else is answered without a call: unsupported actions,
tokenless commands, expired and repeated ids, prefixes already held or no longer held, a
holder the view cannot reach or that runs no KV connector.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import httpx
import pytest

from conductor.bridge.commands import NO_BLOCK_API, VllmCommandExecutor
from schemas import KvCommand, KvCommandResult, chain_keys
from state.view import NodeState, ViewSnapshot

BS = 32
TOKENS = list(range(1, 4 * BS + 1))  # 4 blocks
KEYS = chain_keys(TOKENS, BS)
NOW = 1_000_000
HOLDER_URL, TARGET_URL = "http://holder:8000", "http://target:8000"
PARAMS = {"do_remote_prefill": True, "remote_block_ids": [1, 2, 3, 4], "remote_engine_id": "e", "remote_port": 5600}


class FakeView:
    """The view as the executor reads it: both nodes live, with endpoints and the prefixes given."""

    def __init__(self, held: dict[str, int], **holder: Any) -> None:
        self.held = held
        self.holder = {"endpoint": HOLDER_URL, "kv_transfer": True, "last_heartbeat_ms": NOW, **holder}
        self.reads = 0

    async def snapshot(self, chain: Sequence[int], *, now_ms: int | None = None) -> ViewSnapshot:
        self.reads += 1
        assert list(chain) == KEYS
        nodes = (NodeState("holder", "both", model="tiny", **self.holder),
                 NodeState("target", "both", model="tiny", endpoint=TARGET_URL, kv_transfer=True,
                           last_heartbeat_ms=NOW, total_kv_blocks=1000))
        return ViewSnapshot(NOW, nodes, {n: (h, h, h) for n, h in self.held.items()}, {})

    async def nodes(self) -> list[NodeState]:
        return list((await self.snapshot(KEYS)).nodes)


class Engines:
    """Both engines' HTTP APIs: records every call; the holder hands back ``PARAMS``."""

    def __init__(self, holder_params: dict[str, Any] | None = PARAMS, holder_down: bool = False,
                 pull_failures: int = 0) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.holder_params = holder_params
        self.holder_down = holder_down
        self.pull_failures = pull_failures

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else {}
        self.calls.append((str(request.url), body))
        if request.url.host == "holder":
            if self.holder_down:
                raise httpx.ConnectError("connection refused", request=request)
            return httpx.Response(200, json={"choices": [{"text": "x"}], "kv_transfer_params": self.holder_params})
        if self.pull_failures:
            self.pull_failures -= 1
            return httpx.Response(500, json={"error": {"message": "Internal server error"}})
        return httpx.Response(200, json={"choices": [{"text": "x"}], "kv_transfer_params": None})


def executor(view: FakeView, engines: Engines, published: list[KvCommandResult] | None = None,
             now: int = NOW) -> VllmCommandExecutor:
    async def sink(envs: list[Any]) -> None:
        if published is not None:
            published.extend(e.body for e in envs)

    client = httpx.AsyncClient(transport=httpx.MockTransport(engines))
    return VllmCommandExecutor("target", TARGET_URL, view, sink, block_size=BS, model="tiny", client=client,
                               clock_ms=lambda: now)


def command(action: str = "replicate", **kw: Any) -> KvCommand:
    base: dict[str, Any] = {"command_id": f"c-{action}", "action": action, "block_keys": KEYS, "from_node": "holder",
                            "token_ids": TOKENS, "block_size": BS, "deadline_ms": NOW + 5_000}
    if action == "replicate":
        base.update(to_node="target", to_tier="hbm")
    elif action in ("demote", "migrate"):
        base.update(from_node="target", to_tier="dram")
    else:
        base.update(from_node="target")
    base.update(kw)
    return KvCommand(**base)


async def test_replicate_is_a_prefill_on_the_holder_then_a_pull_here_answered_once() -> None:
    view, engines, published = FakeView({"holder": 4}), Engines(), []
    ex = executor(view, engines, published)
    r = await ex.handle(command())
    assert (r.status, r.blocks, r.error) == ("done", 4, None) and r.duration_ms > 0
    (u1, b1), (u2, b2) = engines.calls
    assert u1 == f"{HOLDER_URL}/v1/completions" and b1["kv_transfer_params"] == {"do_remote_decode": True}
    assert b1["prompt"] == TOKENS and b1["max_tokens"] == 1 and b1["model"] == "tiny"
    assert u2 == f"{TARGET_URL}/v1/completions" and b2["kv_transfer_params"] == PARAMS and b2["prompt"] == TOKENS
    # The same id again: the first result, no call, no view read; published both times.
    again = await ex.handle(command())
    assert again == r and len(engines.calls) == 2 and view.reads == 1
    assert published == [r, r]


async def test_only_the_missing_blocks_count_and_only_what_the_holder_holds_is_asked_for() -> None:
    engines = Engines()
    r = await executor(FakeView({"holder": 3, "target": 1}), engines).handle(command())
    assert (r.status, r.blocks) == ("done", 2)
    assert [len(b["prompt"]) for _, b in engines.calls] == [3 * BS, 3 * BS]  # a prefix: from block 0 to the last held


@pytest.mark.parametrize("action", ["demote", "migrate", "evict"])
async def test_per_block_actions_are_unsupported_on_vllm(action: str) -> None:
    engines, published = Engines(), []
    r = await executor(FakeView({"target": 4}), engines, published).handle(command(action))
    assert (r.status, r.error, r.reason) == ("failed", "unsupported", NO_BLOCK_API[action])
    assert engines.calls == [] and published == [r]


@pytest.mark.parametrize("kw", [{"token_ids": None, "block_size": None}, {"block_size": 16},
                                {"token_ids": list(range(500, 500 + 4 * BS))}])
async def test_a_replicate_without_this_engines_tokens_is_unsupported(kw: dict[str, Any]) -> None:
    engines = Engines()
    r = await executor(FakeView({"holder": 4}), engines).handle(command(**kw))
    assert (r.status, r.error) == ("failed", "unsupported") and engines.calls == []


async def test_expired_repeated_and_foreign_commands_call_nothing() -> None:
    view, engines = FakeView({"holder": 4}), Engines()
    late = executor(view, engines, now=NOW + 6_000)
    r = await late.handle(command())
    assert r.status == "expired" and "after its deadline" in r.reason
    assert await late.handle(command()) == r  # a repeat of an expired id is still expired
    assert await late.handle(command(to_node="other")) is None
    ex = executor(view, engines)
    refused = await ex.handle(command("evict"))
    assert await ex.handle(command("evict")) == refused
    assert engines.calls == [] and view.reads == 0


@pytest.mark.parametrize(("held", "holder", "engines", "status", "error"), [
    ({"holder": 4, "target": 4}, {}, Engines(), "done", None),  # already held: nothing to pull
    ({"target": 0}, {}, Engines(), "failed", "not_held"),
    ({"holder": 4}, {"endpoint": None}, Engines(), "failed", "source_unreachable"),
    ({"holder": 4}, {"last_heartbeat_ms": NOW - 60_000}, Engines(), "failed", "source_unreachable"),
    ({"holder": 4}, {"kv_transfer": False}, Engines(), "failed", "unsupported"),
    ({"holder": 4}, {}, Engines(holder_down=True), "failed", "source_unreachable"),
    ({"holder": 4}, {}, Engines(holder_params=None), "failed", "unsupported"),
])
async def test_what_the_view_and_the_holder_say_decides(held: dict[str, int], holder: dict[str, Any],
                                                        engines: Engines, status: str, error: str | None) -> None:
    r = await executor(FakeView(held, **holder), engines).handle(command())
    assert (r.status, r.error) == (status, error), r.reason
    target_calls = [u for u, _ in engines.calls if u.startswith(TARGET_URL)]
    assert target_calls == [] or status == "done"


async def test_a_failed_pull_is_tried_once_more_within_the_deadline() -> None:
    engines = Engines(pull_failures=1)  # vLLM's 500 when the KV load failed (a NIXL handshake timed out)
    r = await executor(FakeView({"holder": 4}), engines).handle(command())
    assert (r.status, r.blocks) == ("done", 4) and "second attempt" in r.reason
    assert len(engines.calls) == 4  # the hand-off again: a new prefill on the holder, a new pull
    engines = Engines(pull_failures=2)
    r = await executor(FakeView({"holder": 4}), engines).handle(command())
    assert (r.status, r.error) == ("failed", "internal_error") and len(engines.calls) == 4
