"""``conductor explain REQUEST_ID``: re-derive a past decision from the log and show why."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from conductor.cli.common import err, print_json, require_servers, settings_or_exit, table_console
from conductor.routing.explain import Explanation, explain

RequestId = Annotated[str, typer.Argument(help="the request whose decision to explain")]
JsonObject = Annotated[bool, typer.Option("--json", help="print one JSON object")]


def explain_cmd(request_id: RequestId, json_out: JsonObject = False) -> None:
    """Re-derive one past decision from the topics alone and explain it.

    Replays kv-events and heartbeats up to the view watermark the decision records,
    rebuilds the in-flight reservations from earlier decisions on dispatch, runs the
    recorded policy with the recorded seed, and says whether the outcome matches. Then
    lists every instance as the policy costed it (queue wait, reusable prefix and
    where it would be read from, predicted TTFT; decode batch and predicted TBT).
    Exit status 0 when the re-derived decision matches, 1 when it differs.
    """
    s = settings_or_exit()
    require_servers(s, kafka=True)
    ex = asyncio.run(explain(s, request_id))
    if json_out:
        print_json(ex.as_dict())
    else:
        _print_explanation(table_console(), ex)
        if not ex.matches:
            err.print("the log does not carry the read's exact instant nor lost decisions' reservations; "
                      "see the differences above")
    raise typer.Exit(0 if ex.matches else 1)


def _print_explanation(out: Console, ex: Explanation) -> None:
    verdict = "[green]matches[/green]" if ex.matches else "[red]DIFFERS[/red]"
    out.print(f"request {ex.request_id}: policy {ex.policy}, seed {ex.seed}, decided at {ex.decided_at_ms} ms, "
              f"{ex.reservations} reservation(s) in flight; re-derived decision {verdict}")
    for d in ex.differences:
        out.print(f"  - {d}")
    out.print(f"recorded:   {ex.recorded}")
    options = ex.recorded.get("options") or []
    if options:
        tm = Table(title=f"modes costed (chosen: {ex.recorded.get('mode')})")
        for col in ("mode", "prefill", "decode", "TTFT (s)", "TBT (ms)", "meets the SLOs"):
            tm.add_column(col)
        for o in options:
            tm.add_row(o["mode"], o["prefill_instance"], o["decode_instance"], f"{o['predicted_ttft_s']:.3f}",
                       f"{o['predicted_tbt_ms']:.1f}", "yes" if o.get("fits", True) else "no")
        out.print(tm)
    tp = Table(title="prefill instances, as costed (lowest predicted TTFT first)")
    for col in ("instance", "queue wait (s)", "reuse blocks", "from", "tier", "load+compute (s)", "TTFT (s)"):
        tp.add_column(col)
    for r in ex.prefill:
        tp.add_row(r["instance"], _num(r.get("queue_wait_s"), ".3f"), str(r.get("reuse_blocks", "-")),
                   str(r.get("reuse_source") or "-"), str(r.get("reuse_tier") or "-"),
                   _num(r.get("load_and_compute_s"), ".3f"), _num(r.get("ttft_s"), ".3f"))
    out.print(tp)
    td = Table(title="decode instances (lowest predicted TBT first)")
    for col in ("instance", "batch", "context tokens", "free KV blocks", "fits", "TBT (ms)"):
        td.add_column(col)
    for r in ex.decode:
        td.add_row(r["instance"], str(r["batch_size"]), str(r["context_tokens"]), str(r["free_kv_blocks"]),
                   str(r.get("fits", "-")), _num(r.get("tbt_ms"), ".1f"))
    out.print(td)
    if ex.stage_ms:
        out.print("stages of the re-derivation (ms): " + ", ".join(f"{k} {v:.3f}" for k, v in ex.stage_ms.items()))


def _num(v: Any, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def register(groups: dict[str, typer.Typer]) -> None:
    groups["app"].command("explain")(explain_cmd)
