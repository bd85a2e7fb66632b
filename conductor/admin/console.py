"""The live web console: one server-rendered page and a small script that polls the JSON API.

No build step, no external assets. The page carries no data itself; the script reads
``/api/cluster``, ``/api/stats`` and ``/api/policy`` every second (with the session
cookie ``/login`` sets when tokens are configured).
"""

from __future__ import annotations

_STYLE = """
body{font-family:system-ui,sans-serif;margin:1.2rem;color:#111;background:#fafafa}
h1{font-size:1.3rem;margin:0 0 .6rem}
.tiles{display:flex;gap:.6rem;flex-wrap:wrap;margin-bottom:1rem}
.tile{background:#fff;border:1px solid #ddd;border-radius:6px;padding:.5rem .8rem;min-width:9rem}
.tile b{display:block;font-size:1.3rem}
.tile span{color:#555;font-size:.8rem}
table{border-collapse:collapse;background:#fff;margin-bottom:1rem}
th,td{border:1px solid #ddd;padding:.25rem .55rem;text-align:right;font-variant-numeric:tabular-nums}
th{background:#eee}td.l,th.l{text-align:left}
.dead{color:#b00}.cordoned,.draining{color:#a60}
#err{color:#b00;min-height:1.2em}
pre{background:#fff;border:1px solid #ddd;padding:.5rem;max-height:22rem;overflow:auto}
#ttft-chart{background:#fff;border:1px solid #ddd;border-radius:6px;margin-bottom:1rem}
.legend{font-size:.8rem;color:#555;margin:-.6rem 0 1rem}.pred{color:#2563eb}.obs{color:#ea580c}
"""

CONSOLE_HTML = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Conductor console</title>
<meta name="viewport" content="width=device-width,initial-scale=1">
<style>""" + _STYLE + """</style></head>
<body>
<h1>Conductor console <small id="policy"></small></h1>
<div id="err" role="alert"></div>
<div class="tiles">
 <div class="tile"><b id="dps">-</b><span>decisions / s (10 s)</span></div>
 <div class="tile"><b id="reuse">-</b><span>reuse ratio: prompt tokens planned from cache / engines' reported (10 s)</span></div>
 <div class="tile"><b id="ttft">-</b><span>TTFT p50 predicted / observed (s, 10 s; observed at the gateways, routing excluded)</span></div>
 <div class="tile"><b id="rejected">-</b><span>rejections by reason (10 s)</span></div>
 <div class="tile"><b id="stale">-</b><span>view staleness: newest heartbeat (s)</span></div>
 <div class="tile"><b id="live">-</b><span>live instances</span></div>
 <div class="tile"><b id="plan">-</b><span>capacity plan (conductor planner): prefill + decode advised, predicted SLO attainment; today's</span></div>
</div>
<table id="nodes" aria-label="instances">
 <thead><tr><th class="l">instance</th><th class="l">role</th><th class="l">live</th><th class="l">status</th>
 <th>queue</th><th>running</th><th>KV use</th><th>HBM blocks</th><th>DRAM blocks</th><th>SSD blocks</th>
 <th title="prompt tokens its decisions reuse over their prompt tokens">reuse (tokens)</th>
 <th title="share of its decisions that reuse any prefix, however short">requests with a hit</th>
 <th>heartbeat age (s)</th></tr></thead>
 <tbody></tbody>
</table>
<svg id="ttft-chart" width="640" height="160" role="img" aria-label="TTFT p50 over time, predicted and observed"></svg>
<div class="legend">TTFT p50 per 10 s, last 5 minutes: <span class="pred">predicted</span> /
 <span class="obs">observed</span> (the same requests' outcomes)</div>
<form id="explain-form"><label>Explain request id <input id="rid" name="rid" size="32" required></label>
 <button type="submit">Explain</button></form>
<pre id="explain-out" hidden></pre>
<script>
"use strict";
const $ = (id) => document.getElementById(id);
const pct = (v, d) => v === null || v === undefined ? "-" : (100 * v).toFixed(d) + "%";
const fmt = (v, d) => v === null || v === undefined ? "-" : (typeof v === "number" ? v.toFixed(d) : String(v));
async function get(path) {
  const r = await fetch(path, {credentials: "same-origin", headers: {"Accept": "application/json"}});
  if (r.status === 401) { location.reload(); throw new Error("not signed in"); }
  if (!r.ok) {
    let detail = await r.text();
    try { detail = JSON.parse(detail).detail || detail; } catch (e) { /* not JSON */ }
    throw new Error(r.status + ": " + detail);
  }
  return r.json();
}
function cell(tr, text, cls) { const td = tr.insertCell(); td.textContent = text; if (cls) td.className = cls; }
function renderNodes(c) {
  const body = $("nodes").tBodies[0];
  body.replaceChildren();
  for (const n of c.nodes) {
    const tr = body.insertRow();
    tr.className = "node"; tr.dataset.node = n.node_id; tr.dataset.blocks = n.blocks.hbm || 0;
    cell(tr, n.node_id, "l"); cell(tr, n.role, "l");
    cell(tr, n.live ? "yes" : "no", n.live ? "l" : "l dead");
    cell(tr, n.status || "active", "l " + (n.status || ""));
    cell(tr, n.queue_depth); cell(tr, n.running_requests);
    cell(tr, n.kv_use === null ? "-" : (100 * n.kv_use).toFixed(1) + "%");
    cell(tr, n.blocks.hbm || 0); cell(tr, n.blocks.dram || 0); cell(tr, n.blocks.ssd || 0);
    cell(tr, pct(n.reuse_ratio, 1));
    cell(tr, pct(n.hit_rate, 0));
    cell(tr, fmt(n.heartbeat_age_s, 1));
  }
  $("live").textContent = c.totals.live_nodes + " / " + c.totals.nodes;
  $("stale").textContent = fmt(c.newest_heartbeat_age_s, 2);
}
function renderStats(s) {
  $("dps").textContent = fmt(s.decisions_per_s, 1);
  $("reuse").textContent = pct(s.reuse_ratio, 1) + " / " + pct(s.engine_cache_hit_ratio, 1);
  $("ttft").textContent = fmt(s.predicted_ttft_p50_s, 2) + " / " + fmt(s.observed_ttft_p50_s, 2);
  renderSeries(s.ttft_series || []);
  const r = Object.entries(s.rejections_by_reason);
  $("rejected").textContent = r.length ? r.map(([k, v]) => k + " " + v).join(", ") : "0";
}
function renderSeries(points) {
  const svg = $("ttft-chart"), W = 640, H = 160, pad = 28, ns = "http://www.w3.org/2000/svg";
  svg.replaceChildren();
  const vals = points.flatMap(p => [p.predicted_ttft_p50_s, p.observed_ttft_p50_s]).filter(v => v !== null);
  if (!points.length || !vals.length) {
    const t = document.createElementNS(ns, "text"); t.setAttribute("x", pad); t.setAttribute("y", H / 2);
    t.textContent = "no served request yet"; svg.appendChild(t); return;
  }
  const top = Math.max(...vals) * 1.1 || 1, t0 = points[0].t_ms, t1 = Math.max(points[points.length - 1].t_ms, t0 + 1);
  const x = (t) => pad + (W - 2 * pad) * (t - t0) / (t1 - t0), y = (v) => H - pad - (H - 2 * pad) * v / top;
  for (const [key, color] of [["predicted_ttft_p50_s", "#2563eb"], ["observed_ttft_p50_s", "#ea580c"]]) {
    const line = document.createElementNS(ns, "polyline");
    line.setAttribute("points", points.filter(p => p[key] !== null).map(p => x(p.t_ms) + "," + y(p[key])).join(" "));
    line.setAttribute("fill", "none"); line.setAttribute("stroke", color); line.setAttribute("stroke-width", "2");
    line.dataset.series = key; svg.appendChild(line);
  }
  const label = document.createElementNS(ns, "text"); label.setAttribute("x", 2); label.setAttribute("y", 12);
  label.setAttribute("font-size", "11"); label.textContent = fmt(top, 2) + " s"; svg.appendChild(label);
}
async function poll() {
  try {
    const [c, s, p] = await Promise.all([get("/api/cluster"), get("/api/stats"), get("/api/policy")]);
    renderNodes(c); renderStats(s);
    $("policy").textContent = "— policy " + p.policy + (p.control.offset >= 0 ? " (control offset " + p.control.offset + ")" : "");
    $("err").textContent = "";
    document.body.dataset.polled = String(Date.now());
  } catch (e) { $("err").textContent = String(e.message || e); }
}
$("explain-form").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  const out = $("explain-out"); out.hidden = false; out.textContent = "re-deriving from the log ...";
  try {
    const x = await get("/api/explain/" + encodeURIComponent($("rid").value.trim()));
    const verdict = x.matches ? "matches" : "DIFFERS: " + x.differences.join("; ");
    out.textContent = "request " + x.request_id + ": policy " + x.policy + ", control offset " + x.control_offset +
      ", re-derived decision " + verdict + "\\nrecorded: " + JSON.stringify(x.recorded, null, 1) +
      "\\nprefill instances as costed:\\n" + x.prefill.map(r => "  " + r.instance + "  TTFT " + fmt(r.ttft_s, 3) +
      " s, reuse " + (r.reuse_blocks ?? "-") + " blocks").join("\\n");
  } catch (e) { out.textContent = String(e.message || e); }
});
async function pollPlan() {
  try {
    const x = (await get("/api/plan")).plan;
    $("plan").textContent = x === null ? "no plan yet" : x.prefill + "P" + x.decode + "D " +
      pct(x.predicted_slo_attainment, 1) + " (today " + x.cluster_prefill + "P" + x.cluster_decode + "D " +
      pct(x.cluster_slo_attainment, 1) + ")";
  } catch (e) { $("plan").textContent = "-"; }
}
poll(); setInterval(poll, 1000); pollPlan(); setInterval(pollPlan, 30000);
</script>
</body></html>
"""

LOGIN_HTML = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Conductor console: sign in</title>
<style>""" + _STYLE + """</style></head>
<body><h1>Conductor console</h1>
<form id="login"><label>Token <input id="token" type="password" autocomplete="current-password" required></label>
<button type="submit">Sign in</button></form><div id="err" role="alert"></div>
<script>
"use strict";
document.getElementById("login").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  const r = await fetch("/login", {method: "POST", credentials: "same-origin",
    headers: {"Content-Type": "application/json"},
    body: JSON.stringify({token: document.getElementById("token").value})});
  if (r.ok) location.reload(); else document.getElementById("err").textContent = "unknown token";
});
</script></body></html>
"""

__all__ = ["CONSOLE_HTML", "LOGIN_HTML"]
