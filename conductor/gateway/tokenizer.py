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

from conductor.gateway.protocol import ClientRequest


class TokenizeError(RuntimeError):
    """No tokenizer answered."""


class PromptTokenizer(Protocol):
    async def tokens(self, req: ClientRequest) -> list[int]: ...


class EngineTokenizer:
    """POST /tokenize to the engines, round robin, the next one when one fails."""

    def __init__(self, client: httpx.AsyncClient, urls: Sequence[str], model: str | None = None) -> None:
        if not urls:
            raise ValueError("no engine URL to tokenize with")
        self.client = client
        self.urls = list(urls)
        self._next = itertools.cycle(range(len(self.urls)))
        self.model = model

    async def tokens(self, req: ClientRequest) -> list[int]:
        if req.prompt_ids is not None:
            return list(req.prompt_ids)
        body: dict[str, Any] = {"model": req.model}
        if req.chat:
            body.update(messages=list(req.messages or ()), add_generation_prompt=True)
        else:
            body["prompt"] = req.prompt_text or ""
        last: Exception | None = None
        for _ in range(len(self.urls)):
            url = self.urls[next(self._next)]
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
        except Exception as e:  # the library raises its own exception type
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
