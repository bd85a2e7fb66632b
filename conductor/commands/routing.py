"""``conductor router``, ``conductor policies``, ``conductor bench route``, ``conductor profile ...``."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import random
import signal
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import typer


def _stop_on_signals(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)


# --- the benchmark's synthetic cluster ------------------------------------------------------


class PrefixWorkload:
    """Prompts with realistic prefix sharing: tenant system prompt → shared document → own question.

    Tenants and documents are drawn Zipf-like, so a few prefixes are hot and most are
    cold. Block keys are random 64-bit integers (unique with overwhelming probability).
    """

    def __init__(self, rng: random.Random, *, tenants: int = 40, docs_per_tenant: int = 60,
                 chain_blocks: int = 128, zipf_s: float = 1.1) -> None:
        self.rng = rng
        self.chain_blocks = chain_blocks
        r = rng.getrandbits
        self.system = [[r(64) for _ in range(rng.randint(4, 24))] for _ in range(tenants)]
        self.docs = [[[r(64) for _ in range(rng.randint(16, 64))] for _ in range(docs_per_tenant)]
                     for _ in range(tenants)]
        self._tw = _zipf_cum(tenants, zipf_s)
        self._dw = _zipf_cum(docs_per_tenant, zipf_s)

    def request(self) -> tuple[int, list[int], int]:
        """(tenant, chain, shared prefix length in blocks) of one new prompt."""
        rng = self.rng
        t = rng.choices(range(len(self.system)), cum_weights=self._tw)[0]
        d = rng.choices(range(len(self.docs[t])), cum_weights=self._dw)[0]
        prefix = self.system[t] + self.docs[t][d]
        prefix = prefix[: self.chain_blocks - 8]
        suffix = [rng.getrandbits(64) for _ in range(self.chain_blocks - len(prefix))]
        return t, prefix + suffix, len(prefix)


def _zipf_cum(n: int, s: float) -> list[float]:
    acc, out = 0.0, []
    for i in range(n):
        acc += 1.0 / (i + 1) ** s
        out.append(acc)
    return out


def cluster_nodes(prefill: int, decode: int, store: int, racks: int) -> list[tuple[str, str, str]]:
    """(node id, role, rack) of a synthetic cluster, spread round-robin over racks."""
    nodes = [(f"prefill-{i:02d}", "prefill") for i in range(prefill)]
    nodes += [(f"decode-{i:02d}", "decode") for i in range(decode)]
    nodes += [(f"store-{i:02d}", "store") for i in range(store)]
    return [(n, role, f"rack-{k % racks}") for k, (n, role) in enumerate(nodes)]


async def load_synthetic_view(store: Any, work: PrefixWorkload, nodes: list[tuple[str, str, str]],
                              target_blocks: int, rng: random.Random) -> int:
    """Fill ``store`` with served-request history until ~``target_blocks`` distinct keys; return the count."""
    from state.fold import AddBlocks

    prefills = [n for n, role, _ in nodes if role == "prefill"]
    stores = [n for n, role, _ in nodes if role == "store"]
    held: dict[str, list[set[int]]] = {n: [set(), set(), set()] for n, _, _ in nodes}
    distinct: set[int] = set()
    served = 0
    while len(distinct) < target_blocks:
        t, chain, _ = work.request()
        # Affinity: a tenant mostly lands on "its" two prefill nodes, sometimes anywhere.
        node = prefills[(t * 2 + rng.randrange(2)) % len(prefills)] if rng.random() < 0.7 else rng.choice(prefills)
        tier = 0 if served % 3 else 1  # a third of the history has been offloaded to DRAM
        held[node][tier].update(chain)
        distinct.update(chain)
        served += 1
    for i, s in enumerate(stores):  # the shared pool keeps documents of every other tenant
        for t in range(i % 2, len(work.system), 2):
            held[s][1].update(work.system[t])
            for doc in work.docs[t]:
                held[s][2].update(work.system[t] + doc)
    for node, tiers in held.items():
        for tier, keys in enumerate(tiers):
            if keys:
                await store.apply_ops([(None, [AddBlocks(node, tier, tuple(keys))])])
        distinct.update(*tiers)
    return len(distinct)


async def publish_heartbeats(store: Any, nodes: list[tuple[str, str, str]], rng: random.Random, seq: int,
                             now_ms: int) -> None:
    """One heartbeat per node with a plausible load (producer seq ``seq``)."""
    from schemas import Heartbeat, envelope

    recs = []
    for node, role, rack in nodes:
        if role == "prefill":
            depth = rng.randint(0, 6)
            hb = Heartbeat(role=role, queue_depth=depth, queued_prefill_tokens=depth * rng.randint(500, 4000),
                           running_requests=min(depth, 1), rack=rack)
        elif role == "decode":
            batch = rng.randint(8, 64)
            hb = Heartbeat(role=role, batch_size=batch, running_requests=batch,
                           decode_context_tokens=batch * rng.randint(1000, 6000), free_kv_blocks=rng.randint(20_000, 60_000),
                           total_kv_blocks=80_000, rack=rack)
        else:
            hb = Heartbeat(role=role, rack=rack)
        recs.append((envelope(hb, producer_id=node, producer_seq=seq, ts_ms=now_ms), None))
    await store.apply(recs)


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, int(round(q * (len(xs) - 1)))))]


async def run_route_bench(settings: Any, *, decisions: int, target_blocks: int, seed: int,
                          heartbeat_every_s: float = 0.5, concurrency: int = 1,
                          progress: Any = None) -> dict[str, Any]:
    """Build a 32-instance view in Redis, then time ``decisions`` full routing decisions."""
    from schemas import RoutingDecision, RoutingRequest

    from ..router import Router, redis_stores

    rng = random.Random(seed)
    nodes = cluster_nodes(16, 12, 4, racks=4)
    view, resv = redis_stores(settings)
    await view.clear()
    await resv.clear()
    work = PrefixWorkload(rng)
    t0 = time.perf_counter()
    blocks = await load_synthetic_view(view, work, nodes, target_blocks, rng)
    hb_seq = 1
    await publish_heartbeats(view, nodes, rng, hb_seq, int(time.time() * 1000))
    load_s = time.perf_counter() - t0
    if progress:
        progress(f"view loaded: {len(nodes)} instances, {blocks} blocks in {load_s:.1f}s")

    router = Router(settings, view, resv)
    await router.start()
    gc.collect()
    gc.freeze()  # the synthetic workload's millions of keys are not garbage: keep GC off them
    policy_ms: list[float] = []
    inner = router.policy

    class Timed:  # times the pure part apart from the reads
        name, params = inner.name, inner.params

        def decide(self, req: Any, snap: Any, r: random.Random) -> Any:
            t = time.perf_counter()
            out = inner.decide(req, snap, r)
            policy_ms.append((time.perf_counter() - t) * 1000.0)
            return out

    router.policy = Timed()  # type: ignore[assignment]
    bs = settings.block_size

    def make(i: int) -> RoutingRequest:
        _, chain, _ = work.request()
        return RoutingRequest(request_id=f"bench-{i}", block_keys=chain, prompt_tokens=len(chain) * bs,
                              expected_output_tokens=rng.randint(64, 512))

    for i in range(min(200, decisions)):  # warm-up: connections, script loads, caches
        await router.route(make(-i - 1))
    policy_ms.clear()
    reqs = [make(i) for i in range(decisions)]
    lat: list[float] = []
    reuse: list[float] = []
    outcomes: Counter[str] = Counter()
    queue = list(reversed(reqs))
    hb = {"seq": hb_seq, "next": time.perf_counter() + heartbeat_every_s, "paused": 0.0}

    async def lane() -> None:
        while queue:
            now = time.perf_counter()
            if now >= hb["next"]:  # engines report: reservations of the past interval are released
                hb["next"] = now + heartbeat_every_s
                hb["seq"] += 1
                await publish_heartbeats(view, nodes, rng, hb["seq"], int(time.time() * 1000))
                hb["paused"] += time.perf_counter() - now
            req = queue.pop()
            t = time.perf_counter()
            out = await router.route(req)
            lat.append((time.perf_counter() - t) * 1000.0)
            if isinstance(out, RoutingDecision):
                outcomes["placed"] += 1
                reuse.append(out.reused_tokens / req.prompt_tokens)
            else:
                outcomes[out.reason] += 1

    t_run = time.perf_counter()
    await asyncio.gather(*(lane() for _ in range(concurrency)))
    busy = time.perf_counter() - t_run - hb["paused"]
    await router.close()
    gc.unfreeze()
    await view.clear()
    await resv.clear()
    await view.close()
    return {
        "bench": "route",
        "policy": inner.name,
        "instances": len(nodes),
        "blocks": blocks,
        "chain_blocks": work.chain_blocks,
        "decisions": decisions,
        "concurrency": concurrency,
        "decision_ms_p50": round(_pct(lat, 0.50), 4),
        "decision_ms_p99": round(_pct(lat, 0.99), 4),
        "decision_ms_max": round(max(lat), 4),
        "policy_ms_p50": round(_pct(policy_ms, 0.50), 4),
        "policy_ms_p99": round(_pct(policy_ms, 0.99), 4),
        "decisions_per_s": round(decisions / busy, 1),
        "reused_prefix_ratio_mean": round(statistics.fmean(reuse), 4) if reuse else 0.0,
        "outcomes": dict(outcomes),
        "view_load_s": round(load_s, 2),
        "note": "decision = view read + reservation read + policy + reservation record; one process; "
                "decisions_per_s = decisions / wall time with CONCURRENCY requests in flight",
    }


def register(groups: dict[str, typer.Typer]) -> None:
    app, bench = groups["app"], groups["bench"]
    from ..cli import err, print_json, print_result, settings_or_exit

    @app.command("router")
    def router_cmd(
        router_id: str = typer.Option(None, help="producer id of this replica on `dispatch` [default: router-<host>-<pid>]"),
    ) -> None:
        """Run one routing worker: `requests` → policy → `dispatch`.

        Joins the routers' consumer group on `requests`; start several for throughput and availability.

        Each request's snapshot is read from the Redis view in one round trip; the decision (prefill + decode instance, reused prefix, predictions, seed, view watermark) goes to `dispatch` keyed by the prefill instance, a rejection (with its reason) keyed by the request id.

        Decisions not yet visible in heartbeats are shared between replicas as reservations (a Redis stream), released by the node's next heartbeat or after CONDUCTOR_RESERVATION_TTL_S.

        If Redis is unreachable, decisions come from the last snapshot, marked degraded, until it is CONDUCTOR_MAX_SNAPSHOT_AGE_S old; then requests are rejected with view_unavailable.

        Policy: CONDUCTOR_POLICY and CONDUCTOR_POLICY_PARAMS (JSON), checked at start-up (see `conductor policies`); costs: CONDUCTOR_MODEL_PROFILE; metrics: CONDUCTOR_METRICS_PORT.
        """
        from ..errors import ConductorError
        from ..metrics import setup_metrics
        from ..router import Router, RouterWorker, redis_stores

        s = settings_or_exit()
        if not s.kafka_url or not s.redis_url:
            err.print("[red]error:[/red] CONDUCTOR_KAFKA_URL and CONDUCTOR_REDIS_URL must be set: start the "
                      "embedded stack with `conductor dev up` (it prints both) or name your servers")
            raise typer.Exit(2)
        from ..router import default_router_id

        router_id = router_id or default_router_id()
        try:
            view, resv = redis_stores(s, producer_id=router_id)
            router = Router(s, view, resv)
        except ConductorError as e:
            err.print(f"[red]error:[/red] {e}")
            raise typer.Exit(2) from None
        setup_metrics("conductor-router", s.bind_host, s.metrics_port)
        worker = RouterWorker(s, router, router_id=router_id)
        err.print(f"router {worker.router_id}: policy {router.policy.name} {router.params}")

        async def main() -> None:
            stop = asyncio.Event()
            _stop_on_signals(stop)
            try:
                await worker.run(stop)
            finally:
                await view.close()

        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(main())
        err.print(f"router {worker.router_id}: routed {worker.routed} request(s)")

    @app.command("policies")
    def policies_cmd(json_out: bool = typer.Option(False, "--json", help="one JSON line")) -> None:
        """List the routing policies and their parameters (name, type, default, meaning)."""
        from ..policy import list_policies

        items = list_policies()
        if json_out:
            print_json(items)
            return
        for p in items:
            typer.echo(f"{p['name']}: {p['summary']}")
            for k, v in p["params"].items():
                typer.echo(f"    {k} ({v['type']}, default {v['default']!r}): {v['description']}")

    @bench.command("route")
    def bench_route(
        json_out: bool = typer.Option(False, "--json", help="print one JSON line"),
        decisions: int = typer.Option(5000, min=1, help="timed decisions"),
        blocks: int = typer.Option(1_000_000, min=1000, help="distinct blocks to load into the view"),
        seed: int = typer.Option(1, help="seed of the synthetic cluster and prompts"),
        concurrency: int = typer.Option(
            None, min=1, max=64,
            help="requests in flight at once in the process [default: CONDUCTOR_ROUTER_CONCURRENCY, as the router]",
        ),
        policy: str = typer.Option(None, help="policy to time [default: CONDUCTOR_POLICY]"),
    ) -> None:
        """Time the routing decision against a Redis view of 32 instances and ~1M blocks.

        Builds 16 prefill, 12 decode and 4 store instances in 4 racks and fills the view with served-request history (tenant system prompts → shared documents → own questions, Zipf-popular).

        Then times DECISIONS decisions of 128-block prompts in one process: view read + reservations + policy + reservation record. Heartbeats refresh every 0.5 s as engines would.

        Uses CONDUCTOR_REDIS_URL, else starts the embedded servers for the run. Prints decision_ms_p50, decision_ms_p99 and decisions_per_s (and the policy's own share).
        """
        from ..devstack import EmbeddedStack

        s = settings_or_exit()
        stack = None
        tmp = None
        if not s.redis_url:
            tmp = tempfile.TemporaryDirectory(prefix="conductor-bench-")
            stack = EmbeddedStack(Path(tmp.name), host=s.bind_host)
            st = stack.up(die_with_parent=True)
            s = s.model_copy(update={"redis_url": st.redis_url})
        # A bench namespace of its own; nodes stay live for the whole run.
        s = s.model_copy(update={"view_namespace": f"bench{seed}", "heartbeat_ttl_s": 3600.0,
                                 "policy": policy or s.policy})
        try:
            out = asyncio.run(run_route_bench(
                s, decisions=decisions, target_blocks=blocks, seed=seed,
                concurrency=concurrency or s.router_concurrency,
                progress=None if json_out else (lambda m: err.print(m)),
            ))
        finally:
            if stack is not None:
                stack.down()
                tmp.cleanup()  # type: ignore[union-attr]
        print_result(out, json_out)

    profile_app = typer.Typer(help="Model + hardware cost profiles (prefill, decode, KV transfer).",
                              no_args_is_help=True)
    app.add_typer(profile_app, name="profile")

    @profile_app.command("list")
    def profile_list(json_out: bool = typer.Option(False, "--json")) -> None:
        """List the shipped model profiles."""
        from ..profiles import list_profiles, load_profile

        items = [load_profile(n) for n in list_profiles()]
        if json_out:
            print_json([p.model_dump() for p in items])
        else:
            for p in items:
                typer.echo(f"{p.name}: {p.description}")

    @profile_app.command("show")
    def profile_show(name: str = typer.Argument(..., help="a profile name or a .json file")) -> None:
        """Print one profile and what it predicts for a few prompt lengths."""
        from ..errors import ConductorError
        from ..profiles import load_profile

        try:
            p = load_profile(name)
        except ConductorError as e:
            err.print(f"[red]error:[/red] {e}")
            raise typer.Exit(2) from None
        out = p.model_dump()
        out["predicted"] = {
            f"prefill_s@{n}": round(p.prefill_seconds(n), 4) for n in (1024, 8192, 32768, 131072)
        } | {"decode_step_ms@b32x4k": round(1000 * p.decode_step_seconds(32, 32 * 4096), 2),
             "rack_transfer_s@8k": round(p.transfer_seconds(8192, "hbm", True), 4)}
        print_json(out)

    @profile_app.command("fit")
    def profile_fit(
        csv_path: Path = typer.Option(..., "--csv", exists=True, dir_okay=False,
                                      help="measured prefills: columns tokens,cached,seconds (header optional)"),
        base: str = typer.Option(None, help="profile whose l, d and FLOP/s are kept [default: CONDUCTOR_MODEL_PROFILE]"),
        out: Path = typer.Option(None, "--out", help="write the fitted profile JSON here"),
    ) -> None:
        """Fit the prefill coefficients a, b and a fixed overhead to measured timings (least squares).

        The model is seconds = overhead + (flops(tokens) - flops(cached)) / effective FLOP/s with flops(n) = l*(a*n^2*d + b*n*d^2); l, d and the FLOP/s stay those of --base.

        Prints the fit and its error as one JSON line; use the result with CONDUCTOR_MODEL_PROFILE=<the --out file>.
        """
        from ..errors import ConductorError
        from ..profiles import fit_profile, load_profile, read_timings_csv

        s = settings_or_exit()
        try:
            fit = fit_profile(read_timings_csv(csv_path), base=load_profile(base or s.model_profile))
        except ConductorError as e:
            err.print(f"[red]error:[/red] {e}")
            raise typer.Exit(2) from None
        prof = fit.profile.model_dump()
        if out:
            out.write_text(json.dumps(prof, indent=2) + "\n")
        print_json({"rows": fit.rows, "rmse_s": fit.rmse_s, "max_rel_error": fit.max_rel_error,
                    "a": prof["a"], "b": prof["b"], "prefill_overhead_s": prof["prefill_overhead_s"],
                    "profile": prof})
