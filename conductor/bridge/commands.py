"""A real vLLM engine's KV command executor: ``kv-commands`` for one node → the engine's HTTP API.

vLLM has one way to put given blocks into its cache from outside: a P/D hand-off through its
KV connector. :class:`VllmCommandExecutor` carries out a ``replicate`` whose target is its
node as one: a prefill of the prefix on the holder with ``kv_transfer_params:
{"do_remote_decode": true}`` (``max_tokens`` 1, the prefix's token ids as the prompt), then a
one-token request on this engine with the ``kv_transfer_params`` the holder returned. The
engine pulls the KV over its connector (NIXL) and keeps it in its prefix cache; its own KV
events, through its bridge, are the proof on ``kv-events``. The result is ``done`` once both
HTTP calls succeeded. A pull that fails on this engine's side (vLLM answers 500 when a KV load
failed: the first pull from a holder includes a NIXL handshake, given 5 s) is tried once more,
with a new prefill on the holder, while the deadline allows; the result's reason says so.

What is decided is :func:`conductor.balance.executor.execute`'s (a command id carried out
once, deadlines, failure codes), over what the view says: the blocks this node already holds
(only the rest is pulled; all of them: ``done`` with no call) and how many leading blocks the
holder holds (none: ``not_held``). The holder is found through the view too: its heartbeats
announce its ``endpoint``. A command needs ``token_ids`` at this engine's block size (the
balance worker adds them); without them, and for ``demote``, ``migrate`` and ``evict`` (vLLM
has no per-block API: see :data:`NO_BLOCK_API`), the answer is ``failed``/``unsupported``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from conductor.balance.executor import CommandMemory, Execution, execute
from schemas import TIERS, Envelope, KvCommand, KvCommandResult, KvFailure, Tier, can_hand_off, chain_keys, envelope
from state.redis_view import RedisViewStore
from state.view import NodeState, ViewReader, ViewSnapshot

log = logging.getLogger(__name__)

NO_BLOCK_API = {
    "demote": "vLLM has no API to move chosen blocks to a lower tier: its offloading connector moves blocks to "
              "CPU memory on its own (and announces them with medium CPU)",
    "migrate": "vLLM has no API to move chosen blocks between its tiers: its offloading connector decides alone",
    "evict": "vLLM has no API to drop chosen blocks: /reset_prefix_cache clears the whole cache, not a prefix",
}
"""Why a vLLM engine answers these actions ``failed``/``unsupported``."""

HTTP_TIMEOUT_S = 120.0


@dataclass(frozen=True, slots=True)
class _Failed:
    error: KvFailure
    reason: str
    transient: bool = False
    """Worth one more try (the pull failed on this engine's side, the holder was fine)."""


@dataclass(frozen=True, slots=True)
class _HeldOnView:
    """This node's cache as the view indexes it, for one command's chain: the chain's leading
    blocks it holds on HBM (vLLM's device cache, the one a KV connector writes into)."""

    held: frozenset[int]
    blocks: int

    def tiers(self) -> Sequence[Tier]:
        return ("hbm",)

    def holds(self, key: int, tier: Tier) -> bool:
        return tier == "hbm" and key in self.held

    def capacity(self, tier: Tier) -> int:
        return self.blocks if tier == "hbm" else 0


def screen(cmd: KvCommand, *, node: str, now_ms: int, memory: CommandMemory, block_size: int) -> Execution | None:
    """What is answered without the view or an engine: a repeat (its first result), an expired
    command, or one a vLLM engine cannot carry out (remembered). ``None``: read the view and
    :func:`execute`. ``cmd`` must be this node's."""
    old = memory.get(cmd.command_id)
    if old is not None:
        return Execution(old, repeat=True)
    if cmd.deadline_ms is not None and now_ms > cmd.deadline_ms:
        return execute(cmd, node=node, cache=_HeldOnView(frozenset(), 0), now_ms=now_ms, memory=memory)
    why = refusal(cmd, node=node, block_size=block_size)
    if why is None:
        return None
    result = KvCommandResult(command_id=cmd.command_id, action=cmd.action, node=node, status="failed",
                             error="unsupported", reason=why)
    memory.remember(result)
    return Execution(result)


def refusal(cmd: KvCommand, *, node: str, block_size: int) -> str | None:
    """Why a vLLM engine cannot carry ``cmd`` out whatever its cache holds (None: it can try)."""
    if cmd.action != "replicate":
        return NO_BLOCK_API[cmd.action]
    if cmd.to_node != node:
        return f"the target {cmd.to_node} is not this engine: a vLLM engine pulls, it pushes nothing"
    if cmd.token_ids is None or cmd.block_size != block_size:
        return f"the command carries no token ids at this engine's block size ({block_size})"
    if chain_keys(cmd.token_ids, block_size)[: len(cmd.block_keys)] != list(cmd.block_keys):
        return "token_ids do not hash to block_keys"
    return None


def leading(snapshot: ViewSnapshot, node: str, tier: Tier) -> int:
    """Leading blocks of the snapshot's chain ``node`` holds on ``tier`` or a faster one."""
    return snapshot.prefix.get(node, (0, 0, 0))[TIERS.index(tier)]


class VllmCommandExecutor:
    """Carry out ``node_id``'s KV commands on the vLLM engine serving at ``engine_url``.

    ``view`` finds the holder's endpoint and what both nodes hold; ``results`` publishes each
    ``kv_command_result`` (an envelope list, as a bridge sink); ``model`` is the served model
    name (None: the engine's ``/v1/models`` is asked once). ``bytes_per_block`` only fills the
    result's ``bytes_moved``.
    """

    def __init__(
        self,
        node_id: str,
        engine_url: str,
        view: ViewReader,
        results: Callable[[list[Envelope]], Awaitable[Any]] | None = None,
        *,
        block_size: int,
        model: str | None = None,
        ttl_s: float = 5.0,
        bytes_per_block: int = 0,
        client: httpx.AsyncClient | None = None,
        clock_ms: Callable[[], int] = lambda: time.time_ns() // 1_000_000,
    ) -> None:
        self.node_id = node_id
        self.engine_url = engine_url.rstrip("/")
        self.view = view
        self.results = results
        self.block_size = block_size
        self.model = model
        self.ttl_s = ttl_s
        self.bytes_per_block = bytes_per_block
        self.client = client or httpx.AsyncClient(timeout=HTTP_TIMEOUT_S)
        self.clock_ms = clock_ms
        self.memory = CommandMemory()
        self.seq = 0
        self._own_view: RedisViewStore | None = None

    @classmethod
    def from_settings(cls, settings: Any, node_id: str, engine_url: str,
                      results: Callable[[list[Envelope]], Awaitable[Any]], *, model: str | None = None
                      ) -> VllmCommandExecutor:
        """An executor reading the Redis view (closed with it), at the settings' block size and TTL."""
        view = RedisViewStore.connect(settings.redis(), settings.view_namespace)
        ex = cls(node_id, engine_url, view, results, block_size=settings.block_size, model=model,
                 ttl_s=settings.heartbeat_ttl_s)
        ex._own_view = view
        return ex

    async def close(self) -> None:
        await self.client.aclose()
        if self._own_view is not None:
            await self._own_view.close()

    async def handle(self, cmd: KvCommand) -> KvCommandResult | None:
        """Carry ``cmd`` out if it is this node's; publish and return its result."""
        if cmd.executor != self.node_id:
            return None
        ex = screen(cmd, node=self.node_id, now_ms=self.clock_ms(), memory=self.memory, block_size=self.block_size)
        if ex is None:
            try:
                result = await self._replicate(cmd)
            except Exception as e:  # the view unreadable, a bad answer: a failed command changes nothing
                log.exception("command %s", cmd.command_id)
                result = KvCommandResult(command_id=cmd.command_id, action=cmd.action, node=self.node_id,
                                         status="failed", error="internal_error", reason=f"{type(e).__name__}: {e}")
                self.memory.remember(result)
        else:
            result = ex.result
            if ex.repeat:
                log.info("command %s already answered: %s", cmd.command_id, result.status)
        log.info("command %s %s: %s %s (%d blocks, %.0f ms) %s", cmd.command_id, cmd.action, result.status,
                 result.error or "", result.blocks, result.duration_ms, result.reason)
        if self.results is not None:
            env = envelope(result, producer_id=self.node_id, producer_seq=self.seq, ts_ms=self.clock_ms())
            self.seq += 1
            await self.results([env])
        return result

    async def run(self, commands: AsyncIterator[KvCommand]) -> None:
        """Execute ``commands`` one after another until the iterator ends or the task is cancelled."""
        async for cmd in commands:
            try:
                await self.handle(cmd)
            except Exception:  # one bad command must not stop the bridge
                log.exception("command %s failed", cmd.command_id)

    async def _replicate(self, cmd: KvCommand) -> KvCommandResult:
        assert cmd.token_ids is not None and cmd.to_node is not None
        keys = tuple(cmd.block_keys)
        snap = await self.view.snapshot(keys)
        nodes = {n.node_id: n for n in snap.nodes}
        me = nodes.get(self.node_id)
        held = frozenset(keys[: leading(snap, self.node_id, "hbm")])
        cache = _HeldOnView(held, (me.total_kv_blocks if me else 0) or 1 << 30)
        ex = execute(cmd, node=self.node_id, cache=cache, now_ms=self.clock_ms(), memory=self.memory,
                     source_prefix=leading(snap, cmd.from_node, cmd.from_tier), bytes_per_block=self.bytes_per_block)
        assert ex is not None and not ex.repeat
        if not ex.steps:
            return ex.result
        # One "pull" step: the blocks this node lacks, up to the last the holder holds. Its
        # BlocksMigrated proof is not published: the engine's own events are the proof.
        (step,) = ex.steps
        upto = max(keys.index(k) for k in step.keys) + 1
        holder = nodes.get(cmd.from_node)
        failed = self._unreachable(cmd.from_node, holder, snap.now_ms) or self._no_connector(holder, me)
        reason, t0 = "", time.perf_counter()
        if failed is None:
            assert holder is not None
            prompt = list(cmd.token_ids[: upto * self.block_size])
            failed = await self._hand_off(cmd, holder, prompt, attempt=1)
            if failed is not None and failed.transient and not self._expired(cmd):
                log.warning("command %s: %s; once more", cmd.command_id, failed.reason)
                reason = f"pulled on the second attempt (the first: {failed.reason})"
                failed = await self._hand_off(cmd, holder, prompt, attempt=2)
        if failed is not None:
            result = KvCommandResult(command_id=cmd.command_id, action=cmd.action, node=self.node_id,
                                     status="failed", error=failed.error, reason=failed.reason)
        else:
            result = ex.result.model_copy(update={"duration_ms": round(1000 * (time.perf_counter() - t0), 3),
                                                  "reason": reason})
        self.memory.remember(result)
        return result

    def _expired(self, cmd: KvCommand) -> bool:
        return cmd.deadline_ms is not None and self.clock_ms() > cmd.deadline_ms

    def _unreachable(self, node: str, state: NodeState | None, now_ms: int) -> _Failed | None:
        if state is None or not state.endpoint:
            return _Failed("source_unreachable", f"the view announces no endpoint for {node}")
        if not state.is_live(now_ms, self.ttl_s):
            return _Failed("source_unreachable", f"{node} is not live in the view")
        return None

    def _no_connector(self, holder: NodeState | None, me: NodeState | None) -> _Failed | None:
        for state, who in ((holder, "the holder"), (me, "this engine")):
            if state is not None and not can_hand_off(state.role, state.kv_transfer):
                return _Failed("unsupported", f"{who} ({state.node_id}) runs no KV connector: nothing can pull its KV")
        return None

    async def _hand_off(self, cmd: KvCommand, holder: NodeState, prompt: list[int], attempt: int) -> _Failed | None:
        """The holder prefills ``prompt`` and keeps its KV for a pull; this engine pulls it.
        None when both calls succeeded."""
        try:
            model = await self._model()
        except (httpx.HTTPError, LookupError, ValueError) as e:
            return _Failed("internal_error", f"this engine at {self.engine_url} named no model: {type(e).__name__} {e}")
        source_model = holder.model if holder.model not in ("", "default") else model
        headers = {"X-Request-Id": f"replicate-{cmd.command_id}-{attempt}"}
        body: dict[str, Any] = {"prompt": prompt, "max_tokens": 1, "temperature": 0.0, "stream": False}
        try:
            r = await self.client.post(f"{holder.endpoint}/v1/completions", headers=headers, json={
                **body, "model": source_model, "kv_transfer_params": {"do_remote_decode": True}})
        except httpx.HTTPError as e:
            return _Failed("source_unreachable", f"{cmd.from_node} at {holder.endpoint}: {type(e).__name__} {e}")
        if r.status_code != 200:
            return _Failed("source_unreachable", f"{cmd.from_node} answered {r.status_code}: {r.text[:200]}")
        params = r.json().get("kv_transfer_params")
        if not params:
            return _Failed("unsupported", f"{cmd.from_node} returned no kv_transfer_params: it runs no KV connector")
        try:
            r = await self.client.post(f"{self.engine_url}/v1/completions", headers=headers, json={
                **body, "model": model, "kv_transfer_params": params})
        except httpx.HTTPError as e:
            return _Failed("internal_error", f"this engine at {self.engine_url}: {type(e).__name__} {e}")
        if r.status_code != 200:
            # vLLM fails a request whose KV load failed (kv_load_failure_policy "fail") with a 500:
            # e.g. the first pull from a holder, whose NIXL handshake has 5 s to answer.
            return _Failed("internal_error", f"the pull failed: this engine answered {r.status_code}: {r.text[:200]}",
                           transient=r.status_code >= 500)
        return None

    async def _model(self) -> str:
        if self.model is None:
            r = await self.client.get(f"{self.engine_url}/v1/models")
            r.raise_for_status()
            self.model = str(r.json()["data"][0]["id"])
        return self.model
