"""The endpoint picker's pure parts: Envoy's ext_proc messages in and out, no I/O.

What the Gateway API Inference Extension's endpoint-picker protocol asks of an answer
(``docs/proposals/004-endpoint-picker-protocol``): the picked ``ip:port`` in the request header
``x-gateway-destination-endpoint`` and, with the same value, in the response's dynamic metadata
under the ``envoy.lb`` namespace; the route cache cleared so the proxy routes on it; an
``ImmediateResponse`` with 503 when nothing can serve and 429 when the request should be
dropped. For prefill/decode disaggregation the prefill worker goes in ``x-prefiller-host-port``
(llm-d's routing sidecar on the decode pod runs the prefill there first).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from conductor.frontdoor.protocol import error_body, rejection_response
from schemas import RoutingDecision

DESTINATION_HEADER = "x-gateway-destination-endpoint"
"""The picked endpoint, ``ip:port`` (the Inference Extension's protocol)."""
METADATA_NAMESPACE = "envoy.lb"
"""The dynamic-metadata namespace the picked endpoint is also written under."""
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
"""A proxy may restrict the pick to these ``ip:port`` endpoints (filter metadata of the request)."""
PREFILL_HEADER = "x-prefiller-host-port"
"""llm-d's P/D header: the prefill worker the decode pod's routing sidecar runs the prefill on."""
DP_RANK_HEADER = "x-data-parallel-rank"
"""vLLM routes a request carrying it to that data-parallel rank of the engine behind the endpoint."""
REQUEST_ID_HEADER = "x-conductor-request-id"
PREFILL_INSTANCE_HEADER = "x-conductor-prefill-instance"
DECODE_INSTANCE_HEADER = "x-conductor-decode-instance"
ROUTING_MS_HEADER = "x-conductor-routing-ms"
"""The picker's own time for the request, from the body's end to its answer (ms), as the gateway's header."""
PICKER_HEADERS = (DESTINATION_HEADER, PREFILL_HEADER, "x-prefiller-url", DP_RANK_HEADER, REQUEST_ID_HEADER,
                  PREFILL_INSTANCE_HEADER, DECODE_INSTANCE_HEADER, ROUTING_MS_HEADER)
"""Headers that steer an engine or its sidecar (the destination, llm-d's prefill worker in its current and
older name, vLLM's data-parallel rank) or say what Conductor decided: only the picker sets them. Those a
client sent that the picker does not set for this request are removed, so a client cannot pick its own
prefill worker or DP rank behind the decision's back."""

FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
BUFFERED = processing_mode_pb2.ProcessingMode.BUFFERED
BODY_MODES = {"full-duplex": FULL_DUPLEX, "buffered": BUFFERED}
"""The request body modes the picker serves: it decides on the whole body, so the proxy either
buffers it (one answer to the body, its headers mutated then) or streams it full duplex (the
headers' answer held until the body's end, then the body streamed back unchanged)."""


class BadEndpoint(ValueError):
    """An engine URL that names no ``host:port``."""


def host_port(url: str) -> str:
    """``http://10.0.0.5:8000/`` → ``10.0.0.5:8000`` (the port the scheme implies when none is written);
    an IPv6 host in brackets, as ``ip:port`` forms write it."""
    u = urlsplit(url if "://" in url else f"http://{url}")
    if not u.hostname:
        raise BadEndpoint(f"{url!r} names no host")
    try:
        port = u.port or (443 if u.scheme == "https" else 80)
    except ValueError:
        raise BadEndpoint(f"{url!r} has a bad port") from None
    host = f"[{u.hostname}]" if ":" in u.hostname else u.hostname
    return f"{host}:{port}"


def header_map(headers: pb.HttpHeaders) -> dict[str, str]:
    """The HTTP headers of an ext_proc message, names lowercased (``raw_value`` or ``value``; the
    later of a repeated header wins)."""
    out: dict[str, str] = {}
    for h in headers.headers.headers:
        out[h.key.lower()] = h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value
    return out


def subset_hint(req: pb.ProcessingRequest) -> list[str] | None:
    """The endpoints the proxy allows for this request (``envoy.lb.subset_hint``), or None: any."""
    ns = req.metadata_context.filter_metadata.get(SUBSET_NAMESPACE)
    if ns is None or SUBSET_KEY not in ns.fields:
        return None
    v = ns.fields[SUBSET_KEY]
    if v.HasField("list_value"):
        return [x.string_value for x in v.list_value.values if x.string_value]
    return [s.strip() for s in v.string_value.split(",") if s.strip()]


def is_chat(path: str) -> bool | None:
    """Whether ``:path`` is OpenAI's chat route (True), its completions route (False), or neither (None)."""
    p = path.split("?", 1)[0].rstrip("/")
    if p.endswith("/chat/completions"):
        return True
    if p.endswith("/completions"):
        return False
    return None


@dataclass(frozen=True)
class Pick:
    """Where a decided request goes, as the proxy is told."""

    destination: str
    """``ip:port`` of the decode (or aggregated) instance."""
    prefill: str | None
    """``ip:port`` of the prefill instance when the decision is disaggregated."""
    headers: Mapping[str, str]
    """Every request header set, the destination and prefill ones included."""


def pick_of(decision: RoutingDecision, urls: Mapping[str, str]) -> Pick:
    """The answer to the proxy for ``decision``; ``urls``: node → base URL of each instance it names
    (``--engine`` overrides, else what the heartbeats announce). A CPP group is sent as its head:
    the sidecar runs one prefill, which computes the whole prompt (correct, not pipelined)."""
    dest = host_port(urls[decision.decode_instance])
    hdrs = {DESTINATION_HEADER: dest, REQUEST_ID_HEADER: decision.request_id,
            PREFILL_INSTANCE_HEADER: decision.prefill_instance, DECODE_INSTANCE_HEADER: decision.decode_instance}
    prefill = None
    if not decision.aggregated:
        prefill = host_port(urls[decision.prefill_instance])
        hdrs[PREFILL_HEADER] = prefill
    ep = decision.endpoints.get(decision.decode_instance)
    if ep is not None and ep.dp_rank is not None:
        hdrs[DP_RANK_HEADER] = str(ep.dp_rank)
    return Pick(dest, prefill, hdrs)


_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


def _set_headers(headers: Mapping[str, str], *, strip: bool = False) -> pb.HeaderMutation:
    """Set ``headers``; ``strip``: also remove every :data:`PICKER_HEADERS` one they do not set."""
    return pb.HeaderMutation(
        set_headers=[base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=k, raw_value=v.encode()),
                                                append_action=_OVERWRITE) for k, v in headers.items()],
        remove_headers=[h for h in PICKER_HEADERS if h not in headers] if strip else ())


def _metadata(destination: str) -> struct_pb2.Struct:
    md = struct_pb2.Struct()
    md.update({METADATA_NAMESPACE: {DESTINATION_HEADER: destination}})
    return md


def routed(pick: Pick, body: bytes, mode: int) -> list[pb.ProcessingResponse]:
    """The answers that send the request to ``pick``: in full-duplex mode the held headers' answer
    (headers set, route cache cleared, the endpoint in the dynamic metadata) and then the body
    streamed back unchanged; buffered, one answer to the body carrying all of that."""
    hdrs = dict(pick.headers)
    if mode == FULL_DUPLEX:
        hdrs["content-length"] = str(len(body))
        head = pb.ProcessingResponse(
            request_headers=pb.HeadersResponse(response=pb.CommonResponse(
                header_mutation=_set_headers(hdrs, strip=True), clear_route_cache=True)),
            dynamic_metadata=_metadata(pick.destination))
        rest = pb.ProcessingResponse(request_body=pb.BodyResponse(response=pb.CommonResponse(
            body_mutation=pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(body=body, end_of_stream=True)))))
        return [head, rest]
    return [pb.ProcessingResponse(
        request_body=pb.BodyResponse(response=pb.CommonResponse(header_mutation=_set_headers(hdrs, strip=True),
                                                                clear_route_cache=True)),
        dynamic_metadata=_metadata(pick.destination))]


def headers_only(pick: Pick) -> pb.ProcessingResponse:
    """A request with no body (``GET /v1/models``): its headers' answer sends it to ``pick``."""
    return pb.ProcessingResponse(
        request_headers=pb.HeadersResponse(response=pb.CommonResponse(
            header_mutation=_set_headers(pick.headers, strip=True), clear_route_cache=True)),
        dynamic_metadata=_metadata(pick.destination))


def immediate(status: int, body: Mapping[str, Any], headers: Mapping[str, str] | None = None,
              details: str = "") -> pb.ProcessingResponse:
    """The proxy answers the client itself: ``status``, the JSON ``body``, ``headers``; nothing goes upstream."""
    hdrs = {"content-type": "application/json", **(headers or {})}
    return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=status),  # any HTTP code: a proto3 enum is open
        headers=_set_headers({k.lower(): v for k, v in hdrs.items()}),
        body=json.dumps(body).encode(), details=details[:200]))


def rejected(reason: str, message: str) -> pb.ProcessingResponse:
    """A rejection by Conductor: 429 (the SLOs cannot be met, overloaded) or 503 (nothing can
    serve), 400 for an invalid request, the reason as the OpenAI error's ``code``, ``Retry-After``
    as the gateway sends them (:data:`conductor.frontdoor.protocol.REJECTION_STATUS`)."""
    status, body, hdrs = rejection_response(reason, message)
    return immediate(status, body, hdrs, details=f"conductor_{reason}")


def bad_request(message: str, code: str, param: str | None = None) -> pb.ProcessingResponse:
    return immediate(400, error_body(message, code, param=param), details=f"conductor_{code}")


def unavailable(message: str, code: str, retry_after: int = 5) -> pb.ProcessingResponse:
    return immediate(503, error_body(message, code, kind="service_unavailable"), {"retry-after": str(retry_after)},
                     details=f"conductor_{code}")


def passthrough(req: pb.ProcessingRequest, mode: int) -> pb.ProcessingResponse | None:
    """What answers a message the picker does not act on (response headers, bodies and trailers,
    request trailers) when the proxy sends it: go on unchanged. None: nothing to answer."""
    which = req.WhichOneof("request")
    if which == "response_headers":
        return pb.ProcessingResponse(response_headers=pb.HeadersResponse())
    if which == "response_body":
        if mode == FULL_DUPLEX:
            rb = req.response_body
            return pb.ProcessingResponse(response_body=pb.BodyResponse(response=pb.CommonResponse(
                body_mutation=pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(
                    body=rb.body, end_of_stream=rb.end_of_stream)))))
        return pb.ProcessingResponse(response_body=pb.BodyResponse())
    if which == "request_trailers":
        return pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
    if which == "response_trailers":
        return pb.ProcessingResponse(response_trailers=pb.TrailersResponse())
    return None

