"""Turning a client's prompt into the token ids the engines will prefill.

By default the engines' own endpoints, so the gateway's block keys are the engine's by construction:

- A chat goes to vLLM's ``/v1/chat/completions/render`` (vLLM 0.32, served with
  ``--enable-scale-out``): the client's own request,
  rendered exactly as the engine renders it (tools, ``tool_choice``, documents, reasoning effort,
  ``chat_template_kwargs``, the generation prompt, truncation...), answered with its token ids and,
  for images and audio, each item's hash and placeholder range, which become the routing
  request's ``mm_items`` (the router puts them into the block keys as vLLM does).
- Where that route is off or absent (403: vLLM without ``--enable-scale-out``, its default;
  404/405/501 without an OpenAI error: SGLang, an older vLLM; learnt once per engine URL), ``/tokenize`` with every field vLLM's ``TokenizeChatRequest`` takes
  (:data:`TOKENIZE_CHAT_FIELDS`), the chat request's ``documents`` and ``reasoning_effort`` folded
  into ``chat_template_kwargs`` the way the chat request folds them. Multimodal items are then
  tokenized (their placeholders are in the ids) but carry no hash: the engine's blocks from the
  first item on include the item's hash and never match, so such a request is routed on the text
  before its first item (:attr:`Prompt.unhashed_media`, counted by the gateway). Not mirrored on
  this path: ``tool_choice`` (only Kimi K3's template reads it), an engine started with
  ``--exclude-tools-when-tool-choice-none``, ``truncate_prompt_tokens``.
- A completion: ``/tokenize`` with its text and ``add_special_tokens``.

An engine that refuses the prompt (4xx: a bad tool, an unknown model) refuses the client's
request: :class:`PromptRejected` carries its answer to the client. A local ``tokenizer.json`` (the
``tokenizers`` library: ``--tokenizer PATH``, else the model's own where :func:`find_tokenizer` finds
it) tokenizes text completions without a round trip, a long one on a worker thread; chats still go
to the engine, which owns the template. Where neither names a file, the door asks an engine which
files it serves (:class:`ModelFilesTokenizer`: ``/v1/models``' ``root``, as vLLM and SGLang load
the model) and tokenizes locally once it finds them on its own host and they encode as the engine
does. Each door logs at start-up which way it tokenizes, and when it changes.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import httpx
from tokenizers import Tokenizer

from conductor.frontdoor.directory import EngineDirectory
from conductor.frontdoor.protocol import ClientRequest, Prompt

log = logging.getLogger(__name__)

RENDER_PATH = "/v1/chat/completions/render"
TOKENIZE_CHAT_FIELDS = ("tools", "chat_template", "chat_template_kwargs", "add_generation_prompt",
                        "continue_final_message", "add_special_tokens", "mm_processor_kwargs", "media_io_kwargs")
"""What vLLM 0.32's ``/tokenize`` takes for a chat besides ``model`` and ``messages``."""
_UNSET = (None, "auto")
"""Values vLLM's ``merge_kwargs`` leaves out when it lays request fields over the template kwargs."""


class TokenizeError(RuntimeError):
    """No tokenizer answered."""


class PromptRejected(Exception):
    """The engine's tokenizer refused the prompt (4xx): the client's error, its answer passed through."""

    def __init__(self, status: int, body: Any) -> None:
        super().__init__(f"the engine refused the prompt ({status})")
        self.status, self.body = status, body


class PromptTokenizer(Protocol):
    async def prompt(self, req: ClientRequest) -> Prompt: ...


def media_parts(req: ClientRequest) -> int:
    """Content parts of a chat that are not text (images, audio, video, embeddings)."""
    n = 0
    for m in req.messages or ():
        content = m.get("content")
        if isinstance(content, list):
            n += sum(1 for p in content if isinstance(p, dict) and p.get("type", "text") != "text")
    return n


def render_body(req: ClientRequest) -> dict[str, Any]:
    """The chat as the engine would run it, for its render route (no tensors back: ids and hashes only)."""
    return {"model": req.model, "messages": list(req.messages or ()), **req.prompt_fields, "mm_payload": "none"}


def tokenize_body(req: ClientRequest) -> dict[str, Any]:
    """vLLM's ``/tokenize`` request for ``req``: a chat's template inputs as its chat request would
    pass them (``documents``, ``reasoning_effort`` and the thinking switch it implies laid over the
    client's ``chat_template_kwargs``, as ``ChatCompletionRequest.build_chat_params`` does)."""
    f = req.prompt_fields
    if not req.chat:
        body: dict[str, Any] = {"model": req.model, "prompt": req.prompt_text or ""}
        if "add_special_tokens" in f:
            body["add_special_tokens"] = f["add_special_tokens"]
        return body
    body = {"model": req.model, "messages": list(req.messages or ())}
    body.update({k: f[k] for k in TOKENIZE_CHAT_FIELDS if k in f})
    kwargs = dict(f.get("chat_template_kwargs") or {})
    extra: dict[str, Any] = {"documents": f.get("documents"), "reasoning_effort": f.get("reasoning_effort")}
    if f.get("reasoning_effort") is not None and "enable_thinking" not in kwargs:
        extra["enable_thinking"] = f["reasoning_effort"] != "none"
    kwargs.update({k: v for k, v in extra.items() if v not in _UNSET})
    if kwargs:
        body["chat_template_kwargs"] = kwargs
    return body


def rendered_prompt(answer: Any) -> Prompt:
    """A render answer (vLLM's ``GenerateRequest``) as a :class:`Prompt`; TypeError (or KeyError,
    ValueError) when it is not one."""
    if not isinstance(answer, dict) or not isinstance(answer.get("token_ids"), list):
        raise TypeError("the render answer has no token_ids")
    ids = [int(t) for t in answer["token_ids"]]
    items: list[tuple[str, int, int]] = []
    features = answer.get("features") or {}
    hashes: Mapping[str, Sequence[str]] = features.get("mm_hashes") or {}
    places: Mapping[str, Sequence[Mapping[str, int]]] = features.get("mm_placeholders") or {}
    for modality, hs in hashes.items():
        for h, p in zip(hs, places.get(modality) or (), strict=True):
            items.append((str(h), int(p["offset"]), int(p["length"])))
    return Prompt(ids, tuple(sorted(items, key=lambda it: it[1])))


class EngineTokenizer:
    """The engines' render and ``/tokenize`` routes, round robin, the next engine when one fails.

    ``urls``: the engines' base URLs, or an :class:`~conductor.frontdoor.directory.EngineDirectory`
    (the engines found through the view, refreshed as they come and go)."""

    def __init__(self, client: httpx.AsyncClient, urls: Sequence[str] | EngineDirectory, model: str | None = None) -> None:
        if not isinstance(urls, EngineDirectory) and not urls:
            raise ValueError("no engine URL to tokenize with")
        self.client = client
        self.directory = urls if isinstance(urls, EngineDirectory) else None
        self._urls = [] if isinstance(urls, EngineDirectory) else list(urls)
        self._next = itertools.count()
        self.model = model
        self.renders: dict[str, bool] = {}
        """Engine URL → whether it serves the render route (absent: not asked yet)."""

    @property
    def urls(self) -> list[str]:
        return self.directory.urls() if self.directory is not None else self._urls

    async def prompt(self, req: ClientRequest) -> Prompt:
        if req.prompt_ids is not None:
            return Prompt(list(req.prompt_ids))
        last: Exception | None = None
        if self.directory is not None:
            await self.directory.refresh()
        urls = self.urls
        if not urls:
            raise TokenizeError("no engine to tokenize with: none announces an endpoint in the view "
                                "(conductor bridge --engine-url) and no --engine was given")
        for _ in range(len(urls)):
            url = urls[next(self._next) % len(urls)]
            try:
                if req.chat and self.renders.get(url, True):
                    rendered = await self._render(url, req)
                    if rendered is not None:
                        return rendered
                return await self._tokenize(url, req)
            except (httpx.HTTPError, KeyError, ValueError, TypeError) as e:
                last = e
        raise TokenizeError(f"no engine could tokenize: {type(last).__name__}: {last}")

    async def _render(self, url: str, req: ClientRequest) -> Prompt | None:
        """The engine's rendering of the chat; None when its render route is off or absent (remembered)."""
        r = await self.client.post(url + RENDER_PATH, json=render_body(req))
        # 403: vLLM 0.32 answers every scale-out route so until started with --enable-scale-out.
        if r.status_code == 403 or (r.status_code in (404, 405, 501) and not _openai_error(r)):
            self.renders[url] = False
            return None
        _raise_for(r)
        self.renders[url] = True
        return rendered_prompt(r.json())

    async def _tokenize(self, url: str, req: ClientRequest) -> Prompt:
        r = await self.client.post(f"{url}/tokenize", json=tokenize_body(req))
        _raise_for(r)
        ids = [int(t) for t in r.json()["tokens"]]
        return Prompt(ids, unhashed_media=media_parts(req) if req.chat else 0)


def _openai_error(r: httpx.Response) -> bool:
    """The answer is an OpenAI-style error object (the route exists and refused), not a bare 404."""
    try:
        body = r.json()
    except ValueError:
        return False
    return isinstance(body, dict) and isinstance(body.get("error"), dict)


def _raise_for(r: httpx.Response) -> None:
    """A refusal of the prompt (400, 422, or another 4xx as an OpenAI error: an unknown model):
    :class:`PromptRejected`; any other failure (a route the engine lacks, 5xx): an error to try
    the next engine with."""
    if r.status_code in (400, 422) or (400 <= r.status_code < 500 and _openai_error(r)):
        try:
            body = r.json()
        except ValueError:
            body = {"error": {"message": r.text[:500], "type": "invalid_request_error", "param": None,
                              "code": "prompt_rejected"}}
        raise PromptRejected(r.status_code, body)
    r.raise_for_status()


OFF_LOOP_CHARS = 4096
"""A text prompt longer than this is encoded on a worker thread (a 200k-token prompt takes ~370 ms of
CPU, which on the event loop stalls every other request); a shorter one costs less than the hop."""


def find_tokenizer(model: str | None, hub: Path | None = None) -> str | None:
    """The ``tokenizer.json`` of ``model`` as the engines load it, or None: ``model`` itself (a file or a
    model directory, as ``vllm serve /models/x`` is given), else its newest snapshot in the Hugging Face
    cache ``hub`` (default ``~/.cache/huggingface/hub``) when ``model`` is a hub name (``org/name``)."""
    if not model:
        return None
    p = Path(model).expanduser()
    if p.is_file() and p.name == "tokenizer.json":
        return str(p)
    if (p / "tokenizer.json").is_file():
        return str(p / "tokenizer.json")
    if model.count("/") != 1 or model.startswith(("/", ".")):
        return None
    snapshots = (hub or Path.home() / ".cache" / "huggingface" / "hub") / f"models--{model.replace('/', '--')}" / "snapshots"
    with contextlib.suppress(OSError):
        found = sorted((s / "tokenizer.json" for s in snapshots.iterdir() if (s / "tokenizer.json").is_file()),
                       key=lambda f: f.stat().st_mtime)
        if found:
            return str(found[-1])
    return None


def prompt_tokenizer(engine: PromptTokenizer, path: str | None, model: str | None) -> tuple[PromptTokenizer, str]:
    """What a front door tokenizes with, and the sentence its start-up logs: ``path`` (``--tokenizer``), else
    the model's own ``tokenizer.json`` where :func:`find_tokenizer` finds it, for text completions with the
    ``engine`` (render or ``/tokenize``) for chats; else the ``engine`` for all. ``ValueError`` for a bad ``path``."""
    found = path or find_tokenizer(model)
    if found is None:
        if isinstance(engine, EngineTokenizer):
            return ModelFilesTokenizer(engine), (
                f"tokenizing through the engines' /tokenize: no tokenizer.json found for model {model!r}; text "
                "prompts go local once an engine's /v1/models names model files found on this host "
                "(--tokenizer PATH names them)")
        return engine, (f"tokenizing through the engines' /tokenize: no tokenizer.json found for model {model!r} "
                        "(--tokenizer PATH tokenizes text prompts locally)")
    try:
        local = LocalTokenizer(found, engine)
    except ValueError:
        if path:
            raise
        return engine, f"tokenizing through the engines' /tokenize: {found} does not load"
    return local, f"tokenizing text prompts locally with {found}; chats through the engines' render or /tokenize"


class LocalTokenizer:
    """The engines' ``tokenizer.json`` for text completions, no round trip; chats go to ``fallback`` (the engine).

    ``path``: the file, or the model's directory holding it (a Hugging Face snapshot, as vLLM loads
    it). The ids are the engine's own: its ``/tokenize`` encodes a text prompt with the same file
    and ``add_special_tokens`` (tests/vllm/test_gateway_tokenizer_vllm.py)."""

    def __init__(self, path: str, fallback: PromptTokenizer | None) -> None:
        if os.path.isdir(path):
            path = os.path.join(path, "tokenizer.json")
        try:
            self.tok = Tokenizer.from_file(path)
        except Exception as e:  # noqa: BLE001 — the library raises bare Exception (bad JSON, missing file)
            raise ValueError(f"--tokenizer {path}: {e}") from None
        self.fallback = fallback

    async def prompt(self, req: ClientRequest) -> Prompt:
        if req.prompt_ids is not None:
            return Prompt(list(req.prompt_ids))
        if req.chat:
            if self.fallback is None:
                raise TokenizeError("chat prompts need the engine's /tokenize (its chat template)")
            return await self.fallback.prompt(req)
        special = bool(req.prompt_fields.get("add_special_tokens", True))
        text = req.prompt_text or ""
        # encode_batch_fast: the same ids as encode, without the character offsets (nothing here reads
        # them), for ~30 % less CPU; it lets go of the GIL while it works, so a long prompt's thread
        # leaves the loop running.
        if len(text) <= OFF_LOOP_CHARS:
            [enc] = self.tok.encode_batch_fast([text], add_special_tokens=special)
        else:
            [enc] = await asyncio.to_thread(self.tok.encode_batch_fast, [text], add_special_tokens=special)
        return Prompt(list(enc.ids))


PROBE_TEXT = "Conductor checks its tokenizer: 0123456789, Ünïcødé, 日本語, emoji 🙂 and  two  spaces."
"""What a door encodes both ways before it trusts model files it found (special tokens on, as a completion)."""
MODELS_RETRY_S = 30.0
"""How long after an engine could not be asked (down, or not answering ``/v1/models``) a door asks again."""


class ModelFilesTokenizer:
    """The engines' routes until an engine names the model's files and they are on this host.

    A text completion for a model not settled yet starts one look in the background (the request
    itself goes to the engine, as before): an engine's ``/v1/models`` gives each served name's
    ``root``, the path or hub name the engine loaded (vLLM, SGLang); :func:`find_tokenizer` looks
    for its ``tokenizer.json`` here. Files found are used only when they encode :data:`PROBE_TEXT`
    to the engine's own ``/tokenize`` ids (an engine started with another ``--tokenizer`` does
    not match). A model whose engine answered is settled either way; one no engine answered for
    is asked again after ``retry_s``. Chats stay with the engine (its template)."""

    def __init__(self, engine: EngineTokenizer, *, retry_s: float = MODELS_RETRY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.engine = engine
        self.retry_s = retry_s
        self.clock = clock
        self.local: dict[str, LocalTokenizer] = {}
        """Served model name → its files, checked against an engine."""
        self._again: dict[str, float] = {}
        """Served model name → when it may be looked for again (``inf``: settled)."""
        self._looking: asyncio.Task[None] | None = None

    async def prompt(self, req: ClientRequest) -> Prompt:
        if req.chat or req.prompt_ids is not None:
            return await self.engine.prompt(req)
        tok = self.local.get(req.model or "")
        if tok is not None:
            return await tok.prompt(req)
        self.look(req)
        return await self.engine.prompt(req)

    async def warm(self, *, tries: int = 120, every_s: float = 1.0) -> None:
        """At start-up, settle every model the first engine to answer serves, before any request
        asks: the first requests then neither wait on the engine's ``/tokenize`` nor share the
        gateway with the look, and the log says which way each model tokenizes before traffic.
        Tries every ``every_s`` while no engine is known or answers; a model no engine names
        stays for :meth:`prompt` to look for when it is asked for."""
        for attempt in range(tries):
            if attempt:
                await asyncio.sleep(every_s)
            if self.engine.directory is not None:
                await self.engine.directory.refresh()
            for url in self.engine.urls:
                try:
                    r = await self.engine.client.get(f"{url}/v1/models")
                except httpx.HTTPError:
                    continue  # not up yet
                try:
                    r.raise_for_status()
                    cards = r.json().get("data") or []
                except (httpx.HTTPError, ValueError, AttributeError):
                    return  # it answered without a model list: asking again gives none either
                for model in dict.fromkeys(c.get("id") for c in cards if isinstance(c, dict)):
                    if isinstance(model, str) and model not in self.local:
                        while self._looking is not None:  # a request's look: let it end
                            await asyncio.wait({self._looking})
                        task = self.look(ClientRequest(chat=False, model=model, stream=False, include_usage=False,
                                                       max_tokens=None, prompt_text=PROBE_TEXT, prompt_ids=None,
                                                       messages=None, cache_salt=None, lora_name=None))
                        if task is not None:
                            await asyncio.wait({task})
                return

    def look(self, req: ClientRequest) -> asyncio.Task[None] | None:
        """Start looking for the files of ``req``'s model unless a look runs or it is not due; the
        look, or None."""
        model = req.model or ""
        if self._looking is not None or self.clock() < self._again.get(model, 0.0):
            return None
        self._again[model] = self.clock() + self.retry_s  # until the look ends
        probe = dataclasses.replace(req, chat=False, prompt_text=PROBE_TEXT, prompt_ids=None, messages=None,
                                    prompt_fields={})
        self._looking = asyncio.ensure_future(self._look(model, probe))
        self._looking.add_done_callback(self._looked)
        return self._looking

    def _looked(self, task: asyncio.Task[None]) -> None:
        self._looking = None
        if not task.cancelled() and task.exception() is not None:
            log.warning("looking for the model's tokenizer failed: %r", task.exception())

    async def _look(self, model: str, probe: ClientRequest) -> None:
        if self.engine.directory is not None:
            await self.engine.directory.refresh()
        for url in self.engine.urls:
            try:
                r = await self.engine.client.get(f"{url}/v1/models")
                r.raise_for_status()
                cards = r.json().get("data") or []
            except (httpx.HTTPError, ValueError, AttributeError):
                continue
            roots = [c.get("root") for c in cards if isinstance(c, dict) and c.get("id") == model]
            root = roots[0] if roots and isinstance(roots[0], str) else None
            self._again[model] = math.inf  # an engine answered: settled, found or not
            found = find_tokenizer(root) if root else None
            if found is None:
                log.info("tokenizing %r through the engines: %s", model,
                         f"no tokenizer.json for {root!r} on this host" if root else f"{url} serves no model {model!r}")
                return
            try:
                local = LocalTokenizer(found, self.engine)
                mine, theirs = await local.prompt(probe), await self.engine.prompt(probe)
            except (ValueError, TokenizeError, PromptRejected) as e:
                log.warning("tokenizing %r through the engines: %s could not be checked: %s", model, found, e)
                return
            if mine.token_ids != theirs.token_ids:
                log.warning("tokenizing %r through the engines: %s encodes differently from the engine (started "
                            "with another --tokenizer?)", model, found)
                return
            self.local[model] = local
            log.info("tokenizing text prompts for %r locally with %s (the files the engine at %s serves)",
                     model, found, url)
            return
