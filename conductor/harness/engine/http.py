"""The emulated engine's HTTP face: the protocol vLLM and SGLang serve, so a gateway cannot tell.

- ``POST /v1/completions``, ``POST /v1/chat/completions`` (JSON or SSE streaming, usage
  with ``prompt_tokens_details.cached_tokens``, ``prompt_token_ids`` with ``return_token_ids``),
  ``POST /tokenize``, ``POST /v1/chat/completions/render``, ``GET /v1/models``,
  ``GET /health``, ``GET /metrics``. A chat's prompt is rendered from its messages, tools and
  template variables, which a chat request and a ``/tokenize`` request set as vLLM 0.32 sets
  them (:func:`chat_template_vars`), so a gateway that drops a field gets other ids.
- vLLM disaggregated serving: a request with ``kv_transfer_params.do_remote_decode``
  is prefilled here, answered with one token and the ``kv_transfer_params`` a decode
  instance needs (``do_remote_prefill``, ``remote_engine_id``, ``remote_request_id``,
  ``remote_block_ids``, ``remote_host``, ``remote_port``); a request carrying
  ``do_remote_prefill`` pulls that KV from the named peer (``POST /kv/pull``, which
  takes the profile's transfer time) before it decodes.
- SGLang disaggregated serving: the same request goes to both instances with
  ``bootstrap_host`` / ``bootstrap_port`` / ``bootstrap_room``; the prefill instance
  marks the room ready when its prefill ends; the decode instance waits on
  ``GET /kv/bootstrap/{room}`` at the prefill's bootstrap address before decoding.
  ``GET /server_info`` / ``/model_info`` (and their ``/get_*`` names) answer what the
  SGLang router reads when a worker registers, so ``sglang-router`` can front these engines.

The decode side really waits for its peer: a dead or unknown peer makes the decode
request fail (502, code ``kv_transfer_failed``), never hang.

Tokenization is a stand-in: one token per whitespace-separated word, its id a hash
of the word, so prompts sharing a text prefix share a token prefix (and block keys).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import make_asgi_app
from tokenizers import Tokenizer

from conductor.harness.engine.emulated import EmulatedEngine
from conductor.harness.engine.metrics import engine_registry

VOCAB = 50_000
MAX_MODEL_LEN = 131_072
DEFAULT_MAX_TOKENS = 16
TRANSFER_KEEP_S = 120.0
"""A prefill's KV waits this long for its decode peer to pull it (vLLM aborts such requests too)."""
BOOTSTRAP_WAIT_S = 30.0


def emulated_tokens(text: str) -> list[int]:
    """The emulated tokenizer: one id per whitespace-separated word (stable across processes)."""
    return [int.from_bytes(hashlib.blake2b(w.encode(), digest_size=4).digest(), "big") % VOCAB + 100
            for w in text.split()]


def chat_prompt(messages: list[dict[str, Any]], tools: list[Any] | None = None,
                template_vars: dict[str, Any] | None = None) -> str:
    """The emulated chat template. Like a real one it renders the tools and every template variable
    (``chat_template_kwargs`` and what the request lays over them: :func:`chat_template_vars`); it ends
    with the generation prompt (by default), nothing (``continue_final_message``), or an end of turn."""
    v = dict(template_vars or {})
    head = []
    if tools:
        head.append("<|tools|> " + " ".join(json.dumps(t, sort_keys=True, separators=(",", ":")) for t in tools))
    head += [f"<|{k}|> {json.dumps(v[k], sort_keys=True, separators=(',', ':'))}" for k in sorted(v)
             if k not in ("add_generation_prompt", "continue_final_message")]
    parts = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):  # OpenAI content parts: keep the text ones
            content = " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
        parts.append(f"<|{m.get('role', 'user')}|> {content or ''}")
    end = ("<|assistant|>" if v.get("add_generation_prompt", True)
           else "" if v.get("continue_final_message") else "<|eot|>")
    return " ".join([*head, *parts, end]).strip()


def chat_template_vars(body: dict[str, Any], *, tokenize: bool) -> dict[str, Any]:
    """The variables a chat template sees, as vLLM 0.32 lays a request's fields over its
    ``chat_template_kwargs`` (unset values, None or "auto", left out): a chat request's generation
    prompt, ``continue_final_message``, ``documents``, ``reasoning_effort`` (and the thinking switch it
    implies); a ``/tokenize`` request's first two only."""
    kwargs = dict(body.get("chat_template_kwargs") or {})
    agp, cfm = body.get("add_generation_prompt", True), body.get("continue_final_message", False)
    if agp and cfm:
        raise BadRequest("continue_final_message", "Cannot set both `continue_final_message` and "
                         "`add_generation_prompt` to True.")
    over: dict[str, Any] = {"add_generation_prompt": agp, "continue_final_message": cfm}
    if not tokenize:
        over.update(documents=body.get("documents"), reasoning_effort=body.get("reasoning_effort"))
        if body.get("reasoning_effort") is not None and "enable_thinking" not in kwargs:
            over["enable_thinking"] = body["reasoning_effort"] != "none"
    return kwargs | {k: x for k, x in over.items() if x not in (None, "auto")}


def output_text(request_id: str, i: int) -> str:
    return f" w{int.from_bytes(hashlib.blake2b(f'{request_id}/{i}'.encode(), digest_size=2).digest(), 'big')}"


class BadRequest(ValueError):
    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def error(status: int, message: str, code: str, *, param: str | None = None, kind: str = "invalid_request_error",
          headers: dict[str, str] | None = None) -> JSONResponse:
    """An OpenAI-style error body."""
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status, headers=headers)


def prompt_tokens(body: dict[str, Any], chat: bool, *, tokenize: bool = False,
                  encode: Callable[[str], list[int]] = emulated_tokens) -> list[int]:
    """Token ids of a completions ``prompt`` (text or ids) or a chat (``messages``, ``tools`` and the
    template variables of a chat request, or of a ``/tokenize`` request when ``tokenize``); text is
    tokenized by ``encode`` (the engine's ``--tokenizer``, else :func:`emulated_tokens`)."""
    if chat:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) for m in msgs):
            raise BadRequest("messages", "messages must be a non-empty list of {role, content} objects")
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise BadRequest("tools", "tools must be a list")
        return encode(chat_prompt(msgs, tools, chat_template_vars(body, tokenize=tokenize)))
    p = body.get("prompt")
    if isinstance(p, str):
        return encode(p)
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in p):
        return list(p)
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
        return encode(p[0])
    raise BadRequest("prompt", "prompt must be a string or a list of token ids")


def max_tokens_of(body: dict[str, Any]) -> int:
    v = body.get("max_tokens", body.get("max_completion_tokens"))
    if v is None:
        return DEFAULT_MAX_TOKENS
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise BadRequest("max_tokens", "max_tokens must be a positive integer")
    return v


@dataclass
class _Kv:
    """A finished prefill's KV, held until its decode peer pulls it."""

    tokens: int = 0
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    created: float = field(default_factory=time.monotonic)


class _Completion:
    """One response: the OpenAI JSON object or SSE chunks of a completion or a chat completion."""

    def __init__(self, chat: bool, model: str, request_id: str, prompt: int, cached: int) -> None:
        self.chat, self.model, self.rid = chat, model, request_id
        self.id = ("chatcmpl-" if chat else "cmpl-") + request_id
        self.created = int(time.time())
        self.prompt, self.cached = prompt, cached

    def usage(self, out: int) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt, "completion_tokens": out, "total_tokens": self.prompt + out,
                "prompt_tokens_details": {"cached_tokens": self.cached}}

    def whole(self, out: int, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        text = "".join(output_text(self.rid, i) for i in range(out))
        choice: dict[str, Any] = ({"index": 0, "message": {"role": "assistant", "content": text},
                                   "logprobs": None, "finish_reason": "length"} if self.chat else
                                  {"index": 0, "text": text, "logprobs": None, "finish_reason": "length"})
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [choice], "usage": self.usage(out),
                **(extra or {})}

    def chunk(self, text: str | None, finish: str | None = None, *, first: bool = False) -> bytes:
        if self.chat:
            delta: dict[str, Any] = {}
            if first:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        obj = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
               "created": self.created, "model": self.model, "choices": [choice]}
        return b"data: " + json.dumps(obj).encode() + b"\n\n"

    def usage_chunk(self, out: int) -> bytes:
        obj: dict[str, Any] = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
               "created": self.created, "model": self.model, "choices": [], "usage": self.usage(out)}
        return b"data: " + json.dumps(obj).encode() + b"\n\n"


class _Refused(Exception):
    """A request answered with an error before it runs (or before its decode): ``response`` says why."""

    def __init__(self, response: Response) -> None:
        super().__init__(response.status_code)
        self.response = response


class EngineHttp:
    """The HTTP routes of one emulated engine (built by :func:`engine_app`)."""

    def __init__(self, engine: EmulatedEngine, host: str, port: int, client: httpx.AsyncClient | None = None,
                 tokenizer: str | None = None) -> None:
        self.engine = engine
        self.encode: Callable[[str], list[int]] = emulated_tokens
        """How text becomes ids: a ``tokenizer.json`` when given (as a real engine's), else the emulated words."""
        if tokenizer is not None:
            tok = Tokenizer.from_file(tokenizer)
            self.encode = lambda text: list(tok.encode(text).ids)
        self.host, self.port = host, port
        self.client = client or httpx.AsyncClient(timeout=httpx.Timeout(BOOTSTRAP_WAIT_S + 5, connect=2.0))
        self.kv: dict[str, _Kv] = {}

    @property
    def model(self) -> str:
        return self.engine.config.model

    def _slot(self, key: str) -> _Kv:
        now = time.monotonic()
        for k in [k for k, v in self.kv.items() if now - v.created > TRANSFER_KEEP_S]:
            del self.kv[k]
        return self.kv.setdefault(key, _Kv())

    async def _send_kv(self, key: str, wait_s: float) -> dict[str, Any]:
        """Hand one prefill's KV to its decode peer: wait until it is ready, take the transfer time.
        The answer: the tokens handed over, this engine's id and the transfer's model time."""
        slot = self._slot(key)
        await asyncio.wait_for(slot.ready.wait(), wait_s)
        self.kv.pop(key, None)
        e = self.engine
        model_s = e.profile.transfer_seconds(slot.tokens, "hbm", remote=True)
        await asyncio.sleep(model_s / e.config.time_scale)
        return {"tokens": slot.tokens, "engine_id": e.config.node_id, "transfer_model_s": round(model_s, 6)}

    async def _pull(self, kvp: dict[str, Any]) -> dict[str, Any]:
        """Pull the KV a peer holds for us (vLLM-style ``kv_transfer_params``); its JSON answer."""
        url = f"http://{kvp.get('remote_host')}:{kvp.get('remote_port')}/kv/pull"
        r = await self.client.post(url, json={"remote_request_id": kvp.get("remote_request_id")})
        r.raise_for_status()
        got = r.json()
        if not isinstance(got, dict):
            raise TypeError("the peer's /kv/pull answer is not an object")
        return got

    # --- routes -----------------------------------------------------------------

    async def pull(self, request: Request) -> Response:
        body = await request.json()
        key = str(body.get("remote_request_id", ""))
        if key not in self.kv:
            return error(404, f"no KV held for {key!r}", "kv_not_found")
        return JSONResponse(await self._send_kv(key, 1.0))

    async def bootstrap(self, room: str) -> Response:
        try:
            return JSONResponse(await self._send_kv(f"room:{room}", BOOTSTRAP_WAIT_S))
        except TimeoutError:
            return error(504, f"bootstrap room {room} saw no prefill in {BOOTSTRAP_WAIT_S:.0f}s", "kv_not_found")

    async def generate(self, request: Request, chat: bool) -> Response:
        """``/v1/completions`` (``chat`` False) and ``/v1/chat/completions``: a whole request, or one
        half of a P/D hand-off (NIXL-style ``kv_transfer_params`` or SGLang's ``bootstrap_room``)."""
        e = self.engine
        try:
            body, tokens, max_tokens = await self._read(request, chat)
            rid = request.headers.get("x-request-id") or uuid.uuid4().hex
            kvp = body.get("kv_transfer_params") or {}
            room = body.get("bootstrap_room")
            if kvp.get("do_remote_decode") or (room is not None and e.config.role == "prefill"):
                return await self._prefill_half(chat, rid, tokens, kvp, room)
            if kvp.get("do_remote_prefill") or room is not None:
                cached = await self._receive_kv(body, rid, tokens, kvp, room)
            else:
                cached = await e.prefill_now(rid, tokens)
        except _Refused as x:
            return x.response
        comp = _Completion(chat, self.model, rid, len(tokens), cached)
        total = e.decode_output_tokens(max_tokens)
        made: asyncio.Queue[int] = asyncio.Queue()
        e.decode_now(rid, len(tokens), max_tokens, made.put_nowait)
        if not body.get("stream"):
            made_n = 0
            while made_n < total:
                made_n += await made.get()
            # vLLM's return_token_ids: the prompt as the engine prefilled it.
            return JSONResponse(comp.whole(total, {"prompt_token_ids": tokens} if body.get("return_token_ids") else None))
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        return StreamingResponse(self._stream(comp, made, total, include_usage), media_type="text/event-stream")

    async def _read(self, request: Request, chat: bool) -> tuple[dict[str, Any], list[int], int]:
        """The body, its prompt's tokens and its ``max_tokens``; :class:`_Refused` (400) naming what is wrong."""
        try:
            body = await request.json()
        except ValueError:
            raise _Refused(error(400, "the body is not JSON", "invalid_json")) from None
        if not isinstance(body, dict):
            raise _Refused(error(400, "the body must be a JSON object", "invalid_json"))
        try:
            return body, prompt_tokens(body, chat, encode=self.encode), max_tokens_of(body)
        except BadRequest as x:
            raise _Refused(error(400, str(x), "invalid_value", param=x.param)) from x

    async def _prefill_half(self, chat: bool, rid: str, tokens: list[int], kvp: dict[str, Any],
                            room: Any) -> Response:
        """The prefill half: run it, hold the KV for the peer, answer with one token. A CPP member
        (``chunk_end``) computes only its chunk and holds the KV up to ``chunk_end``."""
        e = self.engine
        received = 0
        if kvp.get("chunk_end") is not None:
            tokens, received = await self._cpp_chunk(rid, tokens, kvp)
        cached = await e.prefill_now(rid, tokens, received_tokens=received)
        if room is not None:
            slot = self._slot(f"room:{room}")
            extra: dict[str, Any] = {}
        else:
            key = f"{rid}-{uuid.uuid4().hex[:8]}"
            slot = self._slot(key)
            bs = e.config.block_size
            extra = {"kv_transfer_params": {
                "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": e.config.node_id,
                "remote_request_id": key, "remote_block_ids": list(range(-(-len(tokens) // bs))),
                "remote_host": self.host, "remote_port": self.port, "tp_size": 1,
            }}
        slot.tokens = len(tokens)
        slot.ready.set()
        return JSONResponse(_Completion(chat, self.model, rid, len(tokens), cached).whole(1, extra))

    async def _cpp_chunk(self, rid: str, tokens: list[int], kvp: dict[str, Any]) -> tuple[list[int], int]:
        """A CPP member's chunk: the KV before it pulled from the previous member first (when it
        is not the first); the prompt up to ``chunk_end`` and the tokens whose KV it received."""
        e = self.engine
        received, got = 0, {}
        end = kvp.get("chunk_end")
        if not isinstance(end, int) or isinstance(end, bool) or not 1 <= end <= len(tokens):
            raise _Refused(error(400, f"kv_transfer_params.chunk_end must be 1..{len(tokens)}", "invalid_value",
                                 param="kv_transfer_params.chunk_end"))
        if kvp.get("do_remote_prefill"):
            try:
                got = await self._pull(kvp)
            except (httpx.HTTPError, ValueError, TypeError) as x:
                raise _Refused(error(502, f"KV transfer from the previous CPP member failed: {type(x).__name__}: {x}",
                                     "kv_transfer_failed", kind="server_error")) from x
            received = int(got.get("tokens") or 0)
            if received >= end:
                raise _Refused(error(400, f"received the KV of {received} tokens, past chunk_end {end}",
                                     "invalid_value", param="kv_transfer_params.chunk_end"))
        e.report_row({"event": "cpp_chunk", "request_id": rid, "node": e.config.node_id,
                      "received_tokens": received, "received_from": got.get("engine_id") if received else None,
                      "chunk_end": end, "prompt_tokens": len(tokens)})
        return tokens[:end], received

    async def _receive_kv(self, body: dict[str, Any], rid: str, tokens: list[int], kvp: dict[str, Any],
                          room: Any) -> int:
        """The decode half: the KV brought over from the prefill peer first; the tokens it covers
        (the whole prompt, else :class:`_Refused`)."""
        e = self.engine
        try:
            if room is not None:
                url = f"http://{body.get('bootstrap_host')}:{body.get('bootstrap_port')}/kv/bootstrap/{room}"
                r = await self.client.get(url)
                r.raise_for_status()
                got = r.json()
            else:
                got = await self._pull(kvp)
            received = int(got.get("tokens") or 0)
        except (httpx.HTTPError, ValueError, TypeError, AttributeError) as x:
            raise _Refused(error(502, f"KV transfer from the prefill peer failed: {type(x).__name__}: {x}",
                                 "kv_transfer_failed", kind="server_error")) from x
        e.report_row({"event": "kv_received", "request_id": rid, "node": e.config.node_id,
                      "received_tokens": received, "received_from": got.get("engine_id"),
                      "transfer_model_s": got.get("transfer_model_s"), "prompt_tokens": len(tokens)})
        if received < len(tokens):  # a decode needs the whole prompt's KV
            raise _Refused(error(502, f"the prefill peer handed over the KV of {received} of {len(tokens)} prompt tokens",
                                 "kv_transfer_failed", kind="server_error"))
        return received

    async def _stream(self, comp: _Completion, made: asyncio.Queue[int], total: int, usage: bool) -> AsyncIterator[bytes]:
        got = 0
        while got < total:
            n = await made.get()
            out = b"".join(comp.chunk(output_text(comp.rid, got + i), first=(got + i == 0)) for i in range(n))
            got += n
            yield out
        yield comp.chunk(None if comp.chat else "", "length")
        if usage:
            yield comp.usage_chunk(total)
        yield b"data: [DONE]\n\n"

    async def tokenize(self, request: Request) -> Response:
        body = await request.json()
        try:
            if "messages" in body:
                tokens = prompt_tokens(body, chat=True, tokenize=True, encode=self.encode)
            else:
                tokens = prompt_tokens({"prompt": body.get("prompt", body.get("text"))}, chat=False, encode=self.encode)
        except BadRequest as x:
            return error(400, str(x), "invalid_value", param=x.param)
        return JSONResponse({"count": len(tokens), "max_model_len": MAX_MODEL_LEN, "tokens": tokens})

    async def render_chat(self, request: Request) -> Response:
        """vLLM's ``/v1/chat/completions/render``: the chat request's prompt as the engine would run it
        (``token_ids``; the emulated template keeps only text, so no multimodal ``features``)."""
        try:
            _, tokens, max_tokens = await self._read(request, chat=True)
        except _Refused as x:
            return x.response
        return JSONResponse({"request_id": uuid.uuid4().hex, "token_ids": tokens, "features": None,
                             "sampling_params": {"max_tokens": max_tokens}, "model": self.model})

    async def model_info(self) -> Response:
        # SGLang's /model_info (/get_model_info): what its router reads when a worker registers.
        return JSONResponse({"model_path": self.model, "tokenizer_path": None, "is_generation": True,
                             "preferred_sampling_params": None, "weight_version": "emulated"})

    async def server_info(self) -> Response:
        # SGLang's /server_info (/get_server_info): the role in P/D serving, parallelism, capacity.
        c = self.engine.config
        mode = {"prefill": "prefill", "decode": "decode"}.get(c.role, "null")
        return JSONResponse({"model_path": self.model, "served_model_name": self.model, "disaggregation_mode": mode,
                             "disaggregation_bootstrap_port": self.port, "dp_size": 1, "tp_size": 1,
                             "page_size": c.block_size, "max_total_num_tokens": c.kv_blocks * c.block_size,
                             "context_length": MAX_MODEL_LEN, "version": "conductor-emulated"})

    async def models(self) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": self.model, "object": "model", "created": 0, "owned_by": "conductor-emulated",
             "max_model_len": MAX_MODEL_LEN}]})

def engine_app(engine: EmulatedEngine, host: str, port: int, tokenizer: str | None = None) -> FastAPI:
    """The FastAPI app of one emulated engine reachable at ``http://host:port`` (text tokenized by
    ``tokenizer``, a ``tokenizer.json``, when given)."""
    h = EngineHttp(engine, host, port, tokenizer=tokenizer)
    app = FastAPI(title=f"conductor emulated engine {engine.config.node_id}", docs_url=None, redoc_url=None)

    async def completions(request: Request) -> Response:
        return await h.generate(request, chat=False)

    async def chat(request: Request) -> Response:
        return await h.generate(request, chat=True)

    async def health() -> Response:
        return Response(status_code=200)

    app.add_api_route("/v1/completions", completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", chat, methods=["POST"])
    app.add_api_route("/tokenize", h.tokenize, methods=["POST"])
    app.add_api_route("/v1/chat/completions/render", h.render_chat, methods=["POST"])
    app.add_api_route("/v1/models", h.models, methods=["GET"])
    app.add_api_route("/health", health, methods=["GET"])
    for path in ("/model_info", "/get_model_info"):  # SGLang's names, read by its router
        app.add_api_route(path, h.model_info, methods=["GET"])
    for path in ("/server_info", "/get_server_info"):
        app.add_api_route(path, h.server_info, methods=["GET"])
    app.add_api_route("/kv/pull", h.pull, methods=["POST"])
    app.add_api_route("/kv/bootstrap/{room}", h.bootstrap, methods=["GET"])
    app.mount("/metrics", make_asgi_app(registry=engine_registry(engine)))  # vLLM's names, on the API port as vLLM
    app.router.on_shutdown.append(h.client.aclose)
    return app
