"""The balance ablation's table and plot, from ``conductor simulate --balance both --json`` lines.

``python -m conductor.harness.sim.ablation RESULTS.jsonl OUT_DIR`` writes ``OUT_DIR/ablation.md``
(one row per policy, speed and balance setting) and ``OUT_DIR/balance_vs_speed.png``.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def _base(policy: str) -> str:
    return policy.removesuffix("+balance")


def _change(off: dict[str, Any], on: dict[str, Any], k: str, nd: int = 2) -> str:
    """``off → on`` of ``k``, with the relative change."""
    x, y = off[k], on[k]
    rel = f" ({100 * (y - x) / x:+.1f} %)" if x else ""
    return f"{x:.{nd}f} → {y:.{nd}f}{rel}"


def table(rows: Sequence[dict[str, Any]]) -> str:
    """Markdown: balance off and on side by side, with the relative change of TTFT."""
    by = {(_base(r["policy"]), r["speed"], bool(r.get("balance"))): r for r in rows}
    out = [
        (
            "| policy | speed | TTFT p50 off → on (s) | TTFT p90 off → on (s) | TTFT mean off → on (s) | "
            "SLO off → on | reuse off → on | commands | GB moved |"
        ),
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for (pol, speed, on), r in sorted(by.items()):
        if on or (pol, speed, True) not in by:
            continue
        b = by[(pol, speed, True)]
        out.append(
            f"| {pol} | {speed:g}x | {_change(r, b, 'ttft_p50_s')} | {_change(r, b, 'ttft_p90_s')} | "
            f"{_change(r, b, 'ttft_mean_s')} | "
            f"{r['slo_attainment']:.3f} → {b['slo_attainment']:.3f} | {r['reuse_ratio']:.3f} → {b['reuse_ratio']:.3f} | "
            f"{b.get('balance_commands', 0)} | {b.get('balance_bytes_moved', 0) / 1e9:.0f} |"
        )
    return "\n".join(out)


def plot(rows: Sequence[dict[str, Any]], path: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for pol in sorted({_base(r["policy"]) for r in rows}):
        for on, style in ((False, "--"), (True, "-")):
            pts = sorted((r["speed"], r) for r in rows if _base(r["policy"]) == pol and bool(r.get("balance")) == on)
            if not pts:
                continue
            xs = [p[0] for p in pts]
            label = f"{pol} {'+balance' if on else ''}".strip()
            axes[0].plot(xs, [p[1]["ttft_p90_s"] for p in pts], style, marker="o", label=label)
            axes[1].plot(xs, [p[1]["slo_attainment"] for p in pts], style, marker="o", label=label)
    axes[0].set(xlabel="arrival speed (x trace)", ylabel="TTFT p90 (s)", title="TTFT p90")
    axes[1].set(xlabel="arrival speed (x trace)", ylabel="SLO attainment", title="SLO attainment (both SLOs)")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str]) -> None:
    src, out = Path(argv[0]), Path(argv[1])
    rows = [json.loads(line) for line in src.read_text().splitlines() if line.strip()]
    out.mkdir(parents=True, exist_ok=True)
    (out / "ablation.md").write_text(table(rows) + "\n")
    plot(rows, out / "balance_vs_speed.png")


if __name__ == "__main__":
    main(sys.argv[1:])
