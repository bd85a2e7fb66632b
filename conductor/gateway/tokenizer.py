"""Turning a client's prompt into the token ids the engines will see.

By default the engine's own ``/tokenize`` (vLLM and SGLang serve one; chat templates are
applied there), so the gateway's block keys are the engine's by construction. With
``--tokenizer PATH`` a local ``tokenizer.json`` (the ``tokenizers`` library) tokenizes text
prompts without a round trip; chat prompts still go to the engine, which owns the template.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any, Protocol

import httpx
from tokenizers import Tokenizer

from conductor.gateway.directory import EngineDirectory
from conductor.gateway.protocol import ClientRequest


class TokenizeError(RuntimeError):
    """No tokenizer answered."""


class PromptTokenizer(Protocol):
    async def tokens(self, req: ClientRequest) -> list[int]: ...


class EngineTokenizer:
    """POST /tokenize to the engines, round robin, the next one when one fails.

    ``urls``: the engines' base URLs, or an :class:`~conductor.gateway.directory.EngineDirectory`
    (the engines found through the view, refreshed as they come and go)."""

    def __init__(self, client: httpx.AsyncClient, urls: Sequence[str] | EngineDirectory, model: str | None = None) -> None:
        if not isinstance(urls, EngineDirectory) and not urls:
            raise ValueError("no engine URL to tokenize with")
        self.client = client
        self.directory = urls if isinstance(urls, EngineDirectory) else None
        self._urls = [] if isinstance(urls, EngineDirectory) else list(urls)
        self._next = itertools.count()
        self.model = model

    @property
    def urls(self) -> list[str]:
        return self.directory.urls() if self.directory is not None else self._urls

    async def tokens(self, req: ClientRequest) -> list[int]:
        if req.prompt_ids is not None:
            return list(req.prompt_ids)
        body: dict[str, Any] = {"model": req.model}
        if req.chat:
            body.update(messages=list(req.messages or ()), add_generation_prompt=True)
        else:
            body["prompt"] = req.prompt_text or ""
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
                r = await self.client.post(f"{url}/tokenize", json=body)
                if r.status_code >= 500:
                    raise httpx.HTTPStatusError(f"{r.status_code}", request=r.request, response=r)
                r.raise_for_status()
                return [int(t) for t in r.json()["tokens"]]
            except (httpx.HTTPError, KeyError, ValueError, TypeError) as e:
                last = e
        raise TokenizeError(f"no engine could tokenize: {type(last).__name__}: {last}")


class LocalTokenizer:
    """A ``tokenizer.json`` for text prompts; chat prompts go to ``fallback`` (the engine)."""

    def __init__(self, path: str, fallback: PromptTokenizer | None) -> None:
        try:
            self.tok = Tokenizer.from_file(path)
        except Exception as e:  # noqa: BLE001 — the library raises bare Exception (bad JSON, missing file)
            raise ValueError(f"--tokenizer {path}: {e}") from None
        self.fallback = fallback

    async def tokens(self, req: ClientRequest) -> list[int]:
        if req.prompt_ids is not None:
            return list(req.prompt_ids)
        if req.chat:
            if self.fallback is None:
                raise TokenizeError("chat prompts need the engine's /tokenize (its chat template)")
            return await self.fallback.tokens(req)
        return list(self.tok.encode(req.prompt_text or "", add_special_tokens=True).ids)
