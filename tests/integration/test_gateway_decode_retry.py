"""A vLLM P/D prefill whose decode failed before taking the request (issue 36 item 6): its blocks
stay pinned on the prefill instance for a decode to pull, so the retry that keeps that prefill
instance sends only the decode half, and the new decode pulls those blocks (freeing them) instead
of a second prefill pinning a second copy.

Uses the in-process stack of ``test_gateway_upstream`` (fake engines whose every call the test scripts)."""

from __future__ import annotations

from typing import Any

import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from test_gateway_upstream import completion, outcome_of, stack

from conductor.settings import Settings

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


async def refuse(kind: str, body: dict[str, Any], request: Request) -> Response:
    """A decode instance that answers the call whole with 503: it never took the request."""
    return JSONResponse({"error": {"message": "busy", "code": "unavailable"}}, status_code=503)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_failed_decode_is_retried_alone_on_the_prefill_that_holds_its_kv(
    settings: Settings, stream: bool
) -> None:
    async with stack(settings, {"p0": "prefill", "d0": "decode", "d1": "decode"}) as s:
        s.engines.on["d0"] = refuse
        s.engines.on["d1"] = refuse
        async with s.client() as c:
            r = await c.post("/v1/completions", json=completion(stream=stream))
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_live_instance", r.text  # both excluded
        assert s.engines.count("prefill", "p0") == 1  # one prefill for all the decodes tried
        decodes = [call for call in s.engines.calls if call.kind == "decode"]
        assert {call.node for call in decodes} == {"d0", "d1"}
        params = [call.body["kv_transfer_params"] for call in decodes]
        assert len(params) == 2 and params[0] == params[1]  # the second decode pulls what the first was sent
        o = await outcome_of(s)
        assert len(o.attempts) >= 2 and set(o.excluded) == {"d0", "d1"}


async def test_the_retried_decode_serves_the_request(settings: Settings) -> None:
    async with stack(settings, {"p0": "prefill", "d0": "decode", "d1": "decode"}) as s:
        s.engines.on["d0"] = refuse
        async with s.client() as c:
            r = await c.post("/v1/completions", json=completion(), headers={"x-request-id": "one-prefill"})
        assert r.status_code == 200 and r.json()["choices"][0]["text"], r.text
        assert s.engines.count("prefill", "p0") == 1
        assert [call.node for call in s.engines.calls if call.kind == "decode"][-1] == "d1"
