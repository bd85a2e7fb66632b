"""The benchmark report: a Markdown page with a table and PNG plots (matplotlib, Agg backend)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from conductor.harness.sim.engine import SimResult

PEER_STYLE = ("sglang-style", "dynamo-style", "llm-d-style")
PAPER_TTFT_S = (  # FAST'25, conversation trace, 16 prefill instances: average TTFT (s)
    # (the paper's scheduler, its TTFT, the policy here that does the same thing)
    ("random", 19.65, "random"),
    ("load-balancing", 5.27, "least-loaded"),
    # The paper's cache-aware schedulers both predict TTFT from queue + prefix + compute;
    # "local" uses only the chosen instance's own cache, "global" also copies a prefix held
    # elsewhere. Here those are `global-cache-aware` (global view, own cache) and
    # `kvcache-centric`; `local-cache-aware` here is longest-prefix-first, listed apart.
    ("local cache-aware", 3.58, "global-cache-aware"),
    ("global cache-aware", 3.07, "kvcache-centric"),
    ("(longest prefix first)", None, "local-cache-aware"),
)


@dataclass
class PolicyRun:
    """What the report needs of one policy: its summary at the report speed and its curves."""

    summary: dict[str, Any]
    ttft_by_request: list[float]
    """TTFT of each request in trace order (NaN when rejected)."""
    tbt_ms: list[float]
    predicted_ttft: list[float]
    prefill_busy: dict[str, float]
    makespan_s: float
    probes: list[tuple[float, float]] = field(default_factory=list)

    @classmethod
    def from_result(cls, summary: dict[str, Any], result: SimResult) -> PolicyRun:
        outs = sorted(result.outcomes, key=lambda o: o.index)
        return cls(
            summary=summary,
            ttft_by_request=[o.ttft_s if o.rejected is None else math.nan for o in outs],
            tbt_ms=[o.tbt_ms for o in outs if o.rejected is None],
            predicted_ttft=[o.predicted_ttft_s if o.rejected is None else math.nan for o in outs],
            prefill_busy={k: v["busy_s"] for k, v in result.prefill_load.items()},
            makespan_s=result.makespan_s,
        )


def _fmt(v: Any, nd: int = 2) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        if math.isnan(v):
            return "–"
        return f"{v:.{nd}f}"
    return str(v)


def common_ttft_means(runs: list[PolicyRun]) -> dict[str, float]:
    """Mean TTFT of each policy over the requests *every* policy served, so a policy that
    rejects the hardest requests is not flattered by their absence."""
    if not runs:
        return {}
    n = len(runs[0].ttft_by_request)
    common = [i for i in range(n) if all(not math.isnan(r.ttft_by_request[i]) for r in runs)]
    out = {}
    for r in runs:
        vals = [r.ttft_by_request[i] for i in common]
        out[r.summary["policy"]] = sum(vals) / len(vals) if vals else math.nan
    return out


def _plots(runs: list[PolicyRun], out: Path) -> list[tuple[str, str]]:
    """Draw each plot that has data into ``out``; (caption, file name) of each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made: list[tuple[str, str]] = []
    for name, caption, draw in _PLOTS:
        fig = draw(plt, runs)
        if fig is None:
            continue
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        made.append((caption, name))
    return made


def _ttft_cdf(plt: Any, runs: list[PolicyRun]) -> Any:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in runs:
        xs = sorted(v for v in r.ttft_by_request if not math.isnan(v))
        if xs:
            ys = [(i + 1) / len(r.ttft_by_request) for i in range(len(xs))]
            ax.plot(xs, ys, label=r.summary["policy"])
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s, log scale)")
    ax.set_ylabel("fraction of all requests (rejected never reach 1)")
    slo = runs[0].summary["ttft_slo_s"]
    ax.axvline(slo, color="grey", ls="--", lw=1)
    ax.set_title("TTFT CDF per policy")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return fig


def _slo_vs_speed(plt: Any, runs: list[PolicyRun]) -> Any:
    if not any(len(r.probes) > 1 for r in runs):
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in runs:
        pts = sorted(set(r.probes))
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=r.summary["policy"])
    ax.axhline(0.9, color="grey", ls="--", lw=1)
    ax.set_xlabel("arrival speed-up (x the trace's rate)")
    ax.set_ylabel("requests meeting both SLOs")
    ax.set_title("SLO attainment vs speed")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return fig


def _reuse(plt: Any, runs: list[PolicyRun]) -> Any:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    names = [r.summary["policy"] for r in runs]
    ax.bar(names, [r.summary["reuse_ratio"] for r in runs], color="tab:blue")
    ub = runs[0].summary["reuse_upper_bound"]
    ax.axhline(ub, color="tab:red", ls="--", lw=1, label=f"infinite shared cache ({ub:.3f})")
    ax.set_ylabel("reused tokens / input tokens")
    ax.set_title("Prefix reuse per policy")
    ax.tick_params(axis="x", rotation=35)
    ax.legend(fontsize=8)
    return fig


def _load_per_instance(plt: Any, runs: list[PolicyRun]) -> Any:
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / max(len(runs), 1)
    for k, r in enumerate(runs):
        nodes = sorted(r.prefill_busy, key=lambda s: int(s.rsplit("-", 1)[1]))
        util = [r.prefill_busy[n] / r.makespan_s for n in nodes]
        ax.bar([i + k * width for i in range(len(nodes))], util, width=width, label=r.summary["policy"])
    ax.set_xlabel("prefill instance")
    ax.set_ylabel("busy fraction of the run")
    ax.set_title("Load per prefill instance")
    ax.legend(fontsize=7, ncol=3)
    return fig


def _prediction_error(plt: Any, runs: list[PolicyRun]) -> Any:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in runs:
        pairs = [(p, a) for p, a in zip(r.predicted_ttft, r.ttft_by_request) if not math.isnan(a)]
        if pairs:
            errs = sorted(a - p for p, a in pairs)
            ax.plot(errs, [(i + 1) / len(errs) for i in range(len(errs))], label=r.summary["policy"])
    ax.set_xlabel("actual − predicted TTFT (s)")
    ax.set_ylabel("fraction of served requests")
    ax.set_xlim(-10, 10)
    ax.set_title("How well each policy predicted the TTFT it caused")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return fig


_PLOTS: tuple[tuple[str, str, Callable[[Any, list[PolicyRun]], Any]], ...] = (
    ("ttft_cdf.png", "TTFT CDF per policy", _ttft_cdf),
    ("slo_vs_speed.png", "SLO attainment vs arrival speed (every probe of the capacity search)", _slo_vs_speed),
    ("reuse.png", "Prefix reuse ratio against the infinite-cache upper bound", _reuse),
    ("load_per_instance.png", "Load per prefill instance (busy time / run length)", _load_per_instance),
    ("ttft_prediction_error.png", "TTFT prediction error per policy", _prediction_error),
)
"""(file, caption, draw) of each plot, in the report's order; a draw without data returns None."""

_COLUMNS: tuple[tuple[str, str | None, int], ...] = (
    ("policy", "policy", 0),
    ("TTFT mean (s)", "ttft_mean_s", 2),
    ("TTFT mean, common set (s)", None, 2),
    ("TTFT p90 (s)", "ttft_p90_s", 2),
    ("TTFT p99 (s)", "ttft_p99_s", 2),
    ("TBT p90 (ms)", "tbt_p90_ms", 1),
    ("SLO both", "slo_attainment", 3),
    ("TTFT SLO", "ttft_slo_attainment", 3),
    ("TBT SLO", "tbt_slo_attainment", 3),
    ("goodput (req/s)", "goodput_rps", 3),
    ("reuse", "reuse_ratio", 3),
    ("remote reuses", "remote_reuse_requests", 0),
    ("rejected", "rejected", 0),
    ("prefill max/mean busy", "prefill_imbalance", 2),
    ("capacity (x speed)", "capacity_speed", 3),
    ("capacity (req/s)", "capacity_rps", 3),
    ("wall (s)", "sim_wall_s", 1),
)
"""(heading, summary key, decimals) of the results table; key None: the common-set TTFT mean."""


def write_report(
    runs: list[PolicyRun], out_dir: str | Path, *, title: str, context: dict[str, Any], command: str,
    paper: bool = True,
) -> Path:
    """Write ``README.md`` and the PNGs into ``out_dir``; returns the Markdown path. ``paper``:
    compare with FAST'25's conversation-trace numbers (off for traffic other than that trace)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plots = _plots(runs, out) if runs else []
    common = common_ttft_means(runs)
    lines = [f"# {title}", ""]
    lines += [f"- {k}: {v}" for k, v in context.items()]
    lines += ["", "Regenerate with:", "", "```", command, "```", ""]
    lines += _results_table(runs, common)
    byname = {r.summary["policy"]: r for r in runs}
    if paper and any(p in byname for _, _, p in PAPER_TTFT_S):
        lines += _against_paper(byname, common)
    if "kvcache-centric" in byname and any(p in byname for p in PEER_STYLE):
        lines += _against_peers(byname, common)
    for caption, fname in plots:
        lines += [f"### {caption}", "", f"![{caption}]({fname})", ""]
    md = out / "README.md"
    md.write_text("\n".join(lines), encoding="utf-8")
    return md


def _results_table(runs: list[PolicyRun], common: dict[str, float]) -> list[str]:
    lines = ["| " + " | ".join(c[0] for c in _COLUMNS) + " |", "|" + "---|" * len(_COLUMNS)]
    for r in runs:
        s = r.summary
        cells = [_fmt(common.get(s["policy"]) if key is None else s.get(key), nd) for _, key, nd in _COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return lines + [
        "",
        (
            "TTFT/TBT statistics cover served requests; *common set* is the mean TTFT over the requests "
            "every policy in the table served (early rejection removes the hardest requests from a "
            "policy's own mean). SLO attainment and goodput count every request; a rejected request "
            "meets no SLO."
        ),
        "",
    ]


def _against_paper(byname: dict[str, PolicyRun], common: dict[str, float]) -> list[str]:
    lines = ["## Against the paper (FAST'25, conversation trace, 16 prefill instances)", ""]
    lines += [
        (
            "| paper's scheduler | paper TTFT (s) | paper / load-balancing | policy here | TTFT here (s) "
            "| common set (s) | here / least-loaded |"
        ),
        "|---|---|---|---|---|---|---|",
    ]
    lb = byname["least-loaded"].summary["ttft_mean_s"] if "least-loaded" in byname else None
    for paper_name, v, p in PAPER_TTFT_S:
        here = byname[p].summary["ttft_mean_s"] if p in byname else None
        c = common.get(p, math.nan)
        lines.append(
            f"| {paper_name} | {_fmt(v)} | {_fmt(v / 5.27 if v else None)} | `{p}` | {_fmt(here)} | {_fmt(c)} "
            f"| {_fmt(here / lb if here is not None and lb else None)} |"
        )
    lines.append("")
    return lines


def _against_peers(byname: dict[str, PolicyRun], common: dict[str, float]) -> list[str]:
    kc = byname["kvcache-centric"].summary
    peers = [byname[p].summary for p in PEER_STYLE if p in byname]
    best_t = min(peers, key=lambda s: common.get(s["policy"], math.inf))
    lines = ["## kvcache-centric against the best peer-style policy", ""]
    kt, pt = common.get("kvcache-centric", math.nan), common.get(best_t["policy"], math.nan)
    lines.append(
        f"- mean TTFT (common set): kvcache-centric {_fmt(kt)} s vs {best_t['policy']} {_fmt(pt)} s "
        f"→ {_fmt(100 * (1 - kt / pt) if pt else math.nan, 1)} % lower (goal ≥ 20 %)"
    )
    lines.append(
        f"- goodput: kvcache-centric {_fmt(kc['goodput_rps'], 3)} req/s vs best peer "
        f"{_fmt(max(p['goodput_rps'] for p in peers), 3)} req/s"
    )
    caps = [p for p in peers if p.get("capacity_speed")]
    if kc.get("capacity_speed") is not None and caps:
        best_c = max(caps, key=lambda s: s["capacity_speed"])
        ratio = kc["capacity_speed"] / best_c["capacity_speed"] if best_c["capacity_speed"] else math.nan
        lines.append(
            f"- effective request capacity: kvcache-centric {_fmt(kc['capacity_speed'], 3)}x vs "
            f"{best_c['policy']} {_fmt(best_c['capacity_speed'], 3)}x → {_fmt(ratio)}x (goal ≥ 1.3x)"
        )
    lines.append("")
    return lines
