"""``conductor epp`` in front of emulated engines, and a client that plays Envoy's side of ext_proc.

:class:`EppCluster` starts what :class:`~conductor.harness.gateway_cluster.GatewayCluster` starts
(a stream worker, a router, prefill and decode engines) and ``conductor epp`` (the engines named
with ``--engine``: the emulated engines announce no endpoint), plus the gateway when asked (the
bench compares the two). :class:`EnvoySide` opens one ``Process`` stream per HTTP request over
real gRPC with Envoy's own protos and sends what Envoy's ext_proc filter sends.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Self

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf import json_format, struct_pb2

from conductor.harness.gateway_cluster import ClusterError, GatewayCluster

MODES = {"full-duplex": processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED,
         "buffered": processing_mode_pb2.ProcessingMode.BUFFERED}


@dataclass
class EppCluster(GatewayCluster):
    with_gateway: bool = False
    """Start ``conductor gateway`` too (``gateway_url``), in front of the same engines."""
    epp_args: list[str] = field(default_factory=list)
    epp_address: str = ""
    epp_id: str = ""
    epp_ready: dict[str, Any] = field(default_factory=dict)
    """The picker's ready line (with ``--workers``: ``worker_ids``, ``worker_pids``)."""

    async def __aenter__(self) -> Self:
        env = await self._start_cluster()
        try:
            engines = [a for n, u in self.engine_urls.items() for a in ("--engine", f"{n}={u}")]
            self.epp_id = f"epp-test-{time.time_ns() % 10**9}"
            epp = await self.procs.start("epp", ["epp", "--port", "0", "--epp-id", self.epp_id, *engines,
                                                 *self.epp_args], env, stdout_pipe=True)
            self.epp_ready = await self._ready_line("epp", epp, timeout_s=120.0)  # --workers: several start
            self.epp_address = self.epp_ready["address"]
            if self.with_gateway:
                await self._start_gateway(engines)
        except BaseException:
            await self._stop_all()
            raise
        return self

    def envoy(self, own_connection: bool = False) -> EnvoySide:
        return EnvoySide(self.epp_address, own_connection=own_connection)


@dataclass
class Answer:
    """What the picker answered for one HTTP request."""

    responses: list[pb.ProcessingResponse]

    @property
    def immediate(self) -> pb.ImmediateResponse | None:
        for r in self.responses:
            if r.HasField("immediate_response"):
                return r.immediate_response
        return None

    @property
    def status(self) -> int:
        imm = self.immediate
        return imm.status.code if imm is not None else 200

    @property
    def error(self) -> dict[str, Any]:
        """The immediate response's OpenAI error object."""
        imm = self.immediate
        return json.loads(imm.body)["error"] if imm is not None else {}

    @property
    def headers(self) -> dict[str, str]:
        """Every request header the answers set (the headers' and the body's answers)."""
        out: dict[str, str] = {}
        for r in self.responses:
            which = r.WhichOneof("response")
            if which in ("request_headers", "request_body", "immediate_response"):
                common = getattr(r, which)
                mutation = common.headers if which == "immediate_response" else common.response.header_mutation
                for h in mutation.set_headers:
                    out[h.header.key] = h.header.raw_value.decode() or h.header.value
        return out

    @property
    def metadata(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for r in self.responses:
            if r.HasField("dynamic_metadata"):
                out.update(_plain(r.dynamic_metadata))
        return out

    @property
    def clears_route_cache(self) -> bool:
        return any(getattr(r, w).response.clear_route_cache for r in self.responses
                   if (w := r.WhichOneof("response")) in ("request_headers", "request_body"))

    @property
    def body_back(self) -> bytes:
        """The body streamed back to the proxy (full-duplex mode)."""
        return b"".join(r.request_body.response.body_mutation.streamed_response.body for r in self.responses
                        if r.HasField("request_body"))


def _plain(s: struct_pb2.Struct) -> dict[str, Any]:
    return dict(json_format.MessageToDict(s))


class EnvoySide:
    """Envoy's ext_proc filter, for tests and the bench: one ``Process`` stream per request."""

    def __init__(self, address: str, credentials: grpc.ChannelCredentials | None = None, *,
                 own_connection: bool = False) -> None:
        """``own_connection``: a TCP connection of its own (gRPC shares one per address across channels
        otherwise), as each of Envoy's worker threads has: what spreads streams over ``--workers``."""
        opts = [("grpc.use_local_subchannel_pool", 1)] if own_connection else []
        self.channel = (grpc.aio.secure_channel(address, credentials, options=opts) if credentials is not None
                        else grpc.aio.insecure_channel(address, options=opts))
        self.stub = pb_grpc.ExternalProcessorStub(self.channel)

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def request(self, body: bytes | None, *, path: str = "/v1/completions", method: str = "POST",
                      headers: Mapping[str, str] | None = None, chunks: int = 1, mode: str = "full-duplex",
                      announce_mode: bool = True, subset: Sequence[str] | None = None,
                      timeout_s: float = 30.0, cancel_after_s: float | None = None) -> Answer:
        """Send one request's headers and body (cut into ``chunks`` body messages, the last with
        ``end_of_stream``) as Envoy does in ``mode``, and collect the picker's answers until it has
        answered the body (or answered at once). Buffered mode waits for the headers' answer first,
        as Envoy does. ``cancel_after_s``: end the stream that long after the body is sent, reading
        no answer (Envoy's cancel when the client goes away)."""
        hdrs = {":method": method, ":path": path, ":authority": "inference-gateway", ":scheme": "http",
                "content-type": "application/json", "x-request-id": secrets.token_hex(8), **(headers or {})}
        first = pb.ProcessingRequest(request_headers=pb.HttpHeaders(
            headers=base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode())
                                                for k, v in hdrs.items()]),
            end_of_stream=body is None))
        if announce_mode:
            first.protocol_config.request_body_mode = MODES[mode]
        if subset is not None:
            st = struct_pb2.Struct()
            st.update({"x-gateway-destination-endpoint-subset": list(subset)})
            first.metadata_context.filter_metadata["envoy.lb.subset_hint"].CopyFrom(st)
        call = self.stub.Process(timeout=timeout_s)
        out: list[pb.ProcessingResponse] = []
        try:
            await call.write(first)
            if body is None:
                out.append(await call.read())
                return Answer(out)
            if mode == "buffered":
                r = await call.read()
                out.append(r)
                if r.HasField("immediate_response"):
                    return Answer(out)
                await call.write(pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)))
            else:
                step = max(1, -(-len(body) // chunks))
                parts = [body[i:i + step] for i in range(0, len(body), step)] or [b""]
                for i, part in enumerate(parts):
                    await call.write(pb.ProcessingRequest(request_body=pb.HttpBody(
                        body=part, end_of_stream=i == len(parts) - 1)))
            if cancel_after_s is not None:
                await asyncio.sleep(cancel_after_s)
                return Answer(out)
            while True:
                r = await call.read()
                if r is grpc.aio.EOF:
                    raise ClusterError(f"the picker ended the stream after {len(out)} answer(s)")
                out.append(r)
                if r.HasField("immediate_response") or r.HasField("request_body"):
                    return Answer(out)
        finally:
            call.cancel()
