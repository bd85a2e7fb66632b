"""Real vLLM engines for the ``vllm`` suite (tests/vllm/README.md): started once per session, concurrently.

Every test here skips, with the reason, when the kit (``scripts/vllm-kit``) is not installed.
The engines are shared by the whole session, so a test sends prompts of its own (``unique_text``)
and reads counters as differences, never as absolute values.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from conductor.harness.bench.ingest import start_worker_process, stop_worker_process
from conductor.harness.devstack import free_port
from conductor.harness.settings import load_harness_settings
from conductor.harness.vllm_kit import BLOCK_SIZE, VllmEngine, kit_available, kit_dir, start_engines, tiny_model_dir
from conductor.settings import Settings
from state.redis_view import RedisViewStore
from streams.kafka import ensure_topics
from streams.topics import topics

START_TIMEOUT_S = 420.0
"""Three engines starting at once on a 2-core machine: ~100 s each measured, with room."""


CHAT_TEMPLATE = (
    "{%- if tools %}<tools>{{ tools | tojson }}</tools>{% endif -%}"
    "{%- if documents %}<docs>{{ documents | tojson }}</docs>{% endif -%}"
    "{%- if enable_thinking is defined %}<think>{{ enable_thinking }}</think>{% endif -%}"
    "{%- for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor -%}"
    "{%- if add_generation_prompt %}<|assistant|>{% endif -%}"
)
"""The aggregated engine's chat template (the tiny model has none): it renders tools, documents, a
template kwarg and the generation prompt, so test_gateway_chat_vllm sees each of them change the ids."""


@dataclass(frozen=True)
class VllmEngines:
    """The session's engines: one aggregated (no KV connector), one P/D pair over NIXL (``kv_both`` each)."""

    aggregated: VllmEngine
    prefill: VllmEngine
    decode: VllmEngine

    def all(self) -> tuple[VllmEngine, ...]:
        return (self.aggregated, self.prefill, self.decode)


@pytest.fixture(scope="session")
def vllm_kit() -> Path:
    """The kit's directory; skips the test (with the command that makes the kit) when it is not installed."""
    kit = kit_dir(load_harness_settings())
    reason = kit_available(kit)
    if reason:
        pytest.skip(reason)
    return kit


@pytest.fixture(scope="session")
def tiny_model(vllm_kit: Path) -> Path:
    """The tiny Llama's directory (config.json, tokenizer.json, tokenizer_config.json; dummy weights)."""
    return tiny_model_dir(vllm_kit)


@pytest.fixture(scope="session")
async def vllm_engines(vllm_kit: Path, tiny_model: Path,
                       tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[VllmEngines]:
    """The three engines, started concurrently once per session and always stopped; logs in a session temp dir.

    The aggregated engine also serves what the single-engine tests need, so none starts an engine
    of its own (a start is 70-100 s here): a chat template (``CHAT_TEMPLATE``), the render route
    (``--enable-scale-out``) and the cached tokens of each prompt in its usage
    (``--enable-prompt-tokens-details``)."""
    logs = tmp_path_factory.mktemp("vllm-logs")
    template = logs / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    common = {"kit": vllm_kit, "block_size": BLOCK_SIZE, "start_timeout_s": START_TIMEOUT_S}
    engines = VllmEngines(
        aggregated=VllmEngine(tiny_model, logs, name="vllm-agg", **common,  # type: ignore[arg-type]
                              extra_args=("--chat-template", str(template), "--enable-scale-out",
                                          "--enable-prompt-tokens-details")),
        prefill=VllmEngine(tiny_model, logs, name="vllm-p", pd=True, **common),  # type: ignore[arg-type]
        decode=VllmEngine(tiny_model, logs, name="vllm-d", pd=True, **common),  # type: ignore[arg-type]
    )
    await start_engines(*engines.all())
    try:
        yield engines
    finally:
        await asyncio.gather(*(e.stop() for e in engines.all()), return_exceptions=True)


@pytest.fixture
async def vllm_aggregated(vllm_engines: VllmEngines) -> VllmEngine:
    """The aggregated engine (prefix caching, KV events, no KV connector), running."""
    return await _running(vllm_engines.aggregated)


@pytest.fixture
async def vllm_pd(vllm_engines: VllmEngines) -> tuple[VllmEngine, VllmEngine]:
    """(prefill, decode): two engines with the NixlConnector as ``kv_both``, running."""
    return await _running(vllm_engines.prefill), await _running(vllm_engines.decode)


async def _running(engine: VllmEngine) -> VllmEngine:
    # A test that killed an engine leaves it for the next one to start again.
    if not engine.running:
        await engine.start()
    return engine


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=120.0) as client:
        yield client


@pytest.fixture
def unique_text() -> str:
    """Words no other test sends: a prompt prefix that no engine has cached yet."""
    tag = uuid.uuid4().hex
    return " ".join(f"{tag[i:i + 4]}" for i in range(0, 32, 4)) + " "


@pytest.fixture
def vllm_settings(settings: Settings) -> Settings:
    """The test's settings (own topics and namespace on the session's broker and Redis), at the engines' block size."""
    return settings.model_copy(update={"block_size": BLOCK_SIZE, "web_port": free_port(), "heartbeat_ttl_s": 10.0})


@pytest.fixture
async def view_worker(vllm_settings: Settings, tmp_path: Path) -> AsyncIterator[RedisViewStore]:
    """The test's topics, a `conductor worker` folding them into Redis, and the view it writes."""
    await ensure_topics(vllm_settings.kafka(), topics(vllm_settings.topic_config()).all())
    proc = start_worker_process(vllm_settings, tmp_path / "worker.log")
    store = RedisViewStore.connect(vllm_settings.redis(), vllm_settings.view_namespace)
    try:
        yield store
    finally:
        stop_worker_process(proc)
        await store.clear()
        await store.close()

