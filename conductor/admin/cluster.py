"""The cluster as the view shows it: one row per node (shared by `view show` and the admin API)."""

from __future__ import annotations

from typing import Any

from state.view import ViewSnapshot


def view_summary(snap: ViewSnapshot, ttl_s: float, status: Any = None) -> dict[str, Any]:
    """Nodes (role, liveness, epoch, load, blocks per tier, heartbeat age) and totals.
    ``status(node_id)`` adds the control status (active / cordoned / draining) when given."""
    nodes: list[dict[str, Any]] = []
    totals: dict[str, int] = {}
    for n in snap.nodes:
        live = n.is_live(snap.now_ms, ttl_s)
        row: dict[str, Any] = {
            "node_id": n.node_id, "role": n.role, "live": live,
            "heartbeat_age_s": round((snap.now_ms - n.last_heartbeat_ms) / 1000, 3) if n.last_heartbeat_ms else None,
            "queue_depth": n.queue_depth, "queued_prefill_tokens": n.queued_prefill_tokens,
            "running_requests": n.running_requests, "batch_size": n.batch_size,
            "decode_context_tokens": n.decode_context_tokens,
            "free_kv_blocks": n.free_kv_blocks, "total_kv_blocks": n.total_kv_blocks,
            "kv_use": round(1 - n.free_kv_blocks / n.total_kv_blocks, 4) if n.total_kv_blocks else None,
            "rack": n.rack, "epoch": n.epoch, "last_seq": n.last_seq, "seq_gaps": n.seq_gaps,
            "blocks": dict(n.blocks), "kv_events": n.kv_events,
        }
        if status is not None:
            row["status"] = status(n.node_id)
        nodes.append(row)
        for tier, c in n.blocks.items():
            totals[tier] = totals.get(tier, 0) + c
    live_ages = [r["heartbeat_age_s"] for r in nodes if r["live"] and r["heartbeat_age_s"] is not None]
    return {
        "now_ms": snap.now_ms,
        "nodes": nodes,
        "totals": {"nodes": len(nodes), "live_nodes": sum(1 for n in nodes if n["live"]), "blocks": totals},
        "watermark": dict(sorted(snap.watermark.items())),
        "newest_heartbeat_age_s": min(live_ages) if live_ages else None,
    }


__all__ = ["view_summary"]
