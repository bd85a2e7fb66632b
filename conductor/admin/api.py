"""The admin API (FastAPI): the cluster, recent decisions, explain, the dead-letter queue,
the policy, and the live console — for operators.

Reads come from the Redis view and from a :class:`~conductor.admin.feed.LogFeed` that
follows the log. Every change goes through the ``control`` topic (never Redis
directly), so routers apply it in log order. JSON field names are stable: clients
and the console rely on them. Auth: see :mod:`conductor.admin.auth`.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import Depends, FastAPI, HTTPException, Query, Request, Response
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse
from pydantic import BaseModel, Field

from conductor.admin.auth import SESSION_TTL_S, LoginAttempts, Scope, Tokens, granted, tokens_for
from conductor.admin.cluster import view_summary
from conductor.admin.console import CONSOLE_HTML, LOGIN_HTML
from conductor.admin.feed import LogFeed
from conductor.admin.plans import add_plan_routes
from conductor.errors import ConductorError
from conductor.routing.control_log import publish_control
from conductor.routing.explain import ReadLimitExceeded, explain
from conductor.routing.policies import list_policies
from conductor.settings import Settings
from schemas import ControlCommand, DecodeError, decode
from state.redis_view import RedisViewStore
from streams.kafka import producer
from streams.topics import topics

log = logging.getLogger(__name__)

COOKIE = "conductor_token"


class PolicyChange(BaseModel):
    policy: str = Field(min_length=1, max_length=256)
    params: dict[str, bool | int | float | str | None] = {}
    reason: str = Field(default="", max_length=4096)


class ParamsChange(BaseModel):
    params: dict[str, bool | int | float | str | None]
    reason: str = Field(default="", max_length=4096)


class NodeChange(BaseModel):
    reason: str = Field(default="", max_length=4096)


class Login(BaseModel):
    token: str = Field(min_length=1, max_length=4096)


def create_app(settings: Settings, *, insecure: bool = False, feed: LogFeed | None = None,
               view: Any = None) -> FastAPI:
    """The admin app. ``feed`` and ``view`` default to the real log follower and Redis view,
    started and stopped with the app. With no token configured it is refused (ConfigError)
    unless ``insecure``."""
    tokens = tokens_for(settings, insecure=insecure)
    own_feed = feed is None
    feed = feed or LogFeed(settings)
    view = view or RedisViewStore.connect(settings.redis(), settings.view_namespace)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if own_feed:
            await feed.start()
        try:
            yield
        finally:
            if own_feed:
                await feed.stop()
            await view.close()

    app = FastAPI(
        title="Conductor admin API",
        version="1",
        description="The cluster, recent decisions, explain, dead letters and the routing policy. "
        "Changes are records on the control topic. Bearer token (read or admin scope), or the console's "
        "signed session cookie, on every endpoint except /health (open only when started --insecure).",
        lifespan=lifespan,
        # Served below, behind the read scope: the API's map is not for whoever reaches the port.
        docs_url=None, redoc_url=None, openapi_url=None,
    )
    read, admin = _needs(tokens, "read"), _needs(tokens, "admin")
    # Registered in this order (the OpenAPI document lists the paths so).
    _health_and_console(app, tokens, feed, LoginAttempts(settings.admin_login_max_failures,
                                                         settings.admin_login_window_s))
    _openapi(app, read)
    _cluster_and_decisions(app, settings, feed, view, read)
    _dead_letter_queue(app, settings, feed, read, admin)
    _policy(app, settings, feed, read, admin)
    add_plan_routes(app, settings, read)
    return app


def _scope_of(tokens: Tokens, request: Request) -> Scope | None:
    """The bearer token's scope, else the session cookie's (which holds no token)."""
    header = request.headers.get("authorization")
    if header:
        return tokens.scope_of(header)
    return tokens.session_scope(request.cookies.get(COOKIE), time.time())


def _needs(tokens: Tokens, scope: Scope) -> Any:
    """A FastAPI dependency: 401 without a token or session, 403 without ``scope``; else the scope held."""
    def check(request: Request) -> str:
        has = _scope_of(tokens, request)
        ok = granted(has, scope)
        if ok is None:
            raise HTTPException(401, "a bearer token is required", headers={"WWW-Authenticate": "Bearer"})
        if not ok:
            raise HTTPException(403, f"this token has no {scope} scope")
        return has or ""

    return Depends(check)


def _openapi(app: FastAPI, read: Any) -> None:
    @app.get("/openapi.json", include_in_schema=False, dependencies=[read])
    async def openapi() -> JSONResponse:
        return JSONResponse(app.openapi())

    @app.get("/docs", include_in_schema=False, dependencies=[read])
    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url="/openapi.json", title=f"{app.title} - docs")


def _health_and_console(app: FastAPI, tokens: Tokens, feed: LogFeed, attempts: LoginAttempts) -> None:
    @app.get("/health", tags=["health"])
    async def health() -> dict[str, Any]:
        return {"ok": True, "feed_ready": feed.ready.is_set(), "feed_error": feed.error or None}

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def console(request: Request) -> HTMLResponse:
        if granted(_scope_of(tokens, request), "read") is None:
            return HTMLResponse(LOGIN_HTML, status_code=401)
        return HTMLResponse(CONSOLE_HTML)

    @app.post("/login", tags=["health"])
    async def login(body: Login, request: Request, response: Response) -> dict[str, Any]:
        """Trade a token for an HttpOnly session cookie (what the console uses): signed, holding
        no token, ending after SESSION_TTL_S; Secure when served over HTTPS. 429 to an address after
        admin_login_max_failures failures within admin_login_window_s."""
        client = request.client.host if request.client else "?"
        now = time.monotonic()
        wait = attempts.retry_after(client, now)
        if wait is not None:
            raise HTTPException(429, "too many failed sign-ins from this address",
                                headers={"Retry-After": str(max(1, int(wait + 0.999)))})
        scope = tokens.scope_of(f"Bearer {body.token}")
        if scope is None:
            if attempts.failed(client, now):  # said once per lock-out, not once per attempt
                log.warning("admin sign-in: %d failures from %s within %g s; refused until the window passes",
                            attempts.max_failures, client, attempts.window_s)
            raise HTTPException(401, "unknown token")
        attempts.succeeded(client)
        response.set_cookie(COOKIE, tokens.session(scope, time.time()), max_age=SESSION_TTL_S, path="/",
                            httponly=True, samesite="strict", secure=request.url.scheme == "https")
        return {"scope": scope}


def _cluster_and_decisions(app: FastAPI, settings: Settings, feed: LogFeed, view: Any, read: Any) -> None:
    @app.get("/api/cluster", tags=["cluster"], dependencies=[read])
    async def cluster() -> dict[str, Any]:
        """Nodes: role, liveness, epoch, load, KV use, blocks per tier, heartbeat age, control status."""
        try:
            snap = await view.snapshot([])
        except (ConductorError, OSError) as e:
            raise HTTPException(503, f"the view is unreachable: {e}") from None
        out = view_summary(snap, settings.heartbeat_ttl_s, feed.control.node_status)
        stats = feed.stats()
        hits, reuse = stats["hit_rate_by_instance"], stats["reuse_ratio_by_instance"]
        for n in out["nodes"]:
            n["hit_rate"] = hits.get(n["node_id"])  # share of its decisions that reused any prefix
            n["reuse_ratio"] = reuse.get(n["node_id"])  # prompt tokens reused, token-weighted
        return out

    @app.get("/api/decisions", tags=["decisions"], dependencies=[read])
    async def decisions(
        limit: int = Query(100, ge=1, le=2000),
        kind: Literal["all", "placed", "rejected"] = "all",
    ) -> dict[str, Any]:
        """The most recent decisions and rejections, newest first."""
        rows = [d for d in reversed(feed.decisions)
                if kind == "all" or (kind == "rejected") == d.rejected]
        return {"decisions": [d.as_dict() for d in rows[:limit]]}

    @app.get("/api/stats", tags=["decisions"], dependencies=[read])
    async def stats(window_s: float = Query(10.0, gt=0, le=3600)) -> dict[str, Any]:
        """Decisions per second, reuse ratio (tokens) and the engines' reported cache hits, predicted
        against observed TTFT (p50/p90 over the window, and ``ttft_series``: p50 per window over the
        last 30 windows), rejections by reason, per-instance reuse (``hit_rate_by_instance``: share of
        decisions reusing any prefix; ``reuse_ratio_by_instance``: tokens)."""
        return feed.stats(window_s)

    explaining = asyncio.Lock()  # one at a time: each holds the view it rebuilt

    @app.get("/api/explain/{request_id}", tags=["decisions"], dependencies=[read])
    async def explain_request(request_id: str) -> dict[str, Any]:
        """Re-derive one decision from the log (as `conductor explain`), reading at most
        ``admin_explain_max_records`` records (413 beyond), one explain at a time."""
        async with explaining:
            try:
                return (await explain(settings, request_id, max_records=settings.admin_explain_max_records,
                                      limit_name="admin_explain_max_records (CONDUCTOR_ADMIN_EXPLAIN_MAX_RECORDS)",
                                      )).as_dict()
            except ReadLimitExceeded as e:
                raise HTTPException(413, str(e)) from None
            except ConductorError as e:
                raise HTTPException(404, str(e)) from None


def _dead_letter_queue(app: FastAPI, settings: Settings, feed: LogFeed, read: Any, admin: Any) -> None:
    @app.get("/api/dead-letters", tags=["dead letters"], dependencies=[read])
    async def dead_letters(limit: int = Query(100, ge=1, le=2000)) -> dict[str, Any]:
        rows = list(reversed(feed.dead_letters))[:limit]
        return {"dead_letters": [r.summary() for r in rows], "total_seen": len(feed.dead_letters)}

    @app.get("/api/dead-letters/{partition}/{offset}", tags=["dead letters"], dependencies=[read])
    async def dead_letter(partition: int, offset: int) -> dict[str, Any]:
        row = feed.dead_letter(partition, offset)
        if row is None:
            raise HTTPException(404, f"no dead letter at {partition}/{offset} in the last {feed.keep}")
        return row.summary() | {"original_base64": base64.b64encode(row.letter.original).decode()}

    @app.post("/api/dead-letters/{partition}/{offset}/resend", tags=["dead letters"], dependencies=[admin])
    async def resend(partition: int, offset: int) -> dict[str, Any]:
        """Send the original bytes back to their source topic (after the cause was fixed)."""
        row = feed.dead_letter(partition, offset)
        if row is None:
            raise HTTPException(404, f"no dead letter at {partition}/{offset}")
        letter = row.letter
        try:
            target = topics(settings.topic_config()).by_name(letter.source_topic)
        except KeyError:
            raise HTTPException(409, f"{letter.source_topic!r} is not one of this cluster's topics") from None
        if not letter.complete:
            raise HTTPException(409, f"the dead letter holds {len(letter.original)} of the record's {letter.original_size} "
                                     f"bytes: re-send the record at {letter.source_topic}[{letter.partition}]@{letter.offset}")
        key = letter.key if letter.key is not None else _key_of(letter.original)
        prod = producer(settings.kafka())
        await prod.start()
        try:
            md = await prod.send_and_wait(target.name, letter.original, key=key)
        finally:
            await prod.stop()
        return {"topic": target.name, "partition": md.partition, "offset": md.offset,
                "key": key.decode("utf-8", "backslashreplace") if key else None}


def _policy(app: FastAPI, settings: Settings, feed: LogFeed, read: Any, admin: Any) -> None:
    """The policy and the nodes' rotation: read from the feed's control state, changed through the control topic."""
    @app.get("/api/policies", tags=["policy"], dependencies=[read])
    async def policies() -> list[dict[str, Any]]:
        return list_policies()

    @app.get("/api/policy", tags=["policy"], dependencies=[read])
    async def policy() -> dict[str, Any]:
        """The control state the routers hold: effective policy and params, cordoned/draining nodes."""
        st = feed.control
        return {
            "policy": st.policy or settings.policy,
            "params": dict(st.params) if st.params is not None else dict(settings.policy_params),
            "configured": st.policy is None and st.params is None,
            "control": st.as_dict(),
        }

    async def publish(cmd_fields: dict[str, Any], scope: str) -> JSONResponse:
        try:
            cmd = ControlCommand(**cmd_fields, operator=f"admin-api:{scope}")
            off = await publish_control(settings, cmd, producer_id="conductor-admin")
        except (ConductorError, ValueError) as e:
            raise HTTPException(422, str(e)) from None
        return JSONResponse({"control_offset": off, "action": cmd.action, "published_at_ms": int(time.time() * 1000)},
                            status_code=202)

    @app.put("/api/policy", tags=["policy"], status_code=202)
    async def set_policy(body: PolicyChange, scope: str = admin) -> JSONResponse:
        """Switch the routers' policy (a set_policy record on the control topic)."""
        return await publish({"action": "set_policy", "policy": body.policy, "params": body.params,
                              "reason": body.reason}, scope)

    @app.put("/api/policy/params", tags=["policy"], status_code=202)
    async def set_params(body: ParamsChange, scope: str = admin) -> JSONResponse:
        """Replace the current policy's parameters (a set_params record)."""
        return await publish({"action": "set_params", "params": body.params, "reason": body.reason}, scope)

    @app.post("/api/nodes/{node_id}/{action}", tags=["policy"], status_code=202)
    async def node_action(node_id: str, action: Literal["cordon", "drain", "uncordon"],
                          body: NodeChange | None = None, scope: str = admin) -> JSONResponse:
        """Take a node out of rotation (cordon, drain: running requests finish) or back (uncordon)."""
        return await publish({"action": action, "node_id": node_id, "reason": body.reason if body else ""}, scope)


def _key_of(original: bytes) -> bytes | None:
    """The record key the source topic expects (node or request id), when the bytes decode."""
    try:
        env = decode(original)
    except DecodeError:
        return None
    rid = getattr(env.body, "request_id", None)
    return (rid or env.producer_id).encode()


__all__ = ["create_app"]
