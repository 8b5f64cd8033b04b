"use strict";
// A sweep's page: trials, best so far, the objective over trials, parallel coordinates of settings
// against the objective, parameter importance (GET /api/sweeps/{id}, /importance); pause/cancel.
(() => {
  const $ = (id) => document.getElementById(id);
  const id = Number($("sweep").dataset.sweepId);
  const NS = "http://www.w3.org/2000/svg";
  const svg = (tag, attrs = {}, ...kids) => { const e = document.createElementNS(NS, tag); for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v); e.append(...kids); return e; };
  const fmt = (v) => typeof v === "number" ? TP.sig(v) : String(v);

  function render(s) {
    $("sweep-name").textContent = s.name;
    $("sweep-state").textContent = s.state; $("sweep-state").className = `badge ${s.state}`;
    $("sweep-what").textContent = `${s.method} · ${s.objective.metric} (${s.objective.goal}) · pruner ${s.pruner} · project ${s.project}`;
    $("sweep-jobs").href = `/?q=&project=${encodeURIComponent(s.project)}&tag=${encodeURIComponent(`sweep:${s.id}`)}`;
    const ranked = s.trials.filter((t) => t.value !== null).sort((a, b) => (s.objective.goal === "min" ? a.value - b.value : b.value - a.value));
    $("sweep-compare").href = `/compare?${ranked.slice(0, 5).map((t) => `job=${t.job_id}`).join("&")}`;
    $("sweep-pause").hidden = s.state !== "running"; $("sweep-resume").hidden = s.state !== "paused";
    $("sweep-cancel").hidden = !["running", "paused"].includes(s.state);
    $("best").textContent = s.best ? `${fmt(s.best.value)} · trial #${s.best.number} (${Object.entries(s.best.params).map(([k, v]) => `${k}=${fmt(v)}`).join(", ")})` : "–";
    if (s.best) $("best").replaceChildren(TP.el("a", { href: `/jobs/${s.best.job_id}`, text: $("best").textContent }));
    $("counts").textContent = `${s.trials.length} of ${s.budget_trials} · ` + Object.entries(s.counts).filter(([, n]) => n).map(([k, n]) => `${n} ${k}`).join(", ");
    $("saved").textContent = s.saved_hours ? TP.dur(s.saved_hours * 3600) : "–";
    const lost = Object.entries(s.lost_hours || {}).filter(([, h]) => h > 0).sort((a, b) => b[1] - a[1]);
    $("lost").textContent = lost.length ? lost.map(([k, h]) => `${k} ${TP.dur(h * 3600)}`).join(" · ") : "–";
    $("sweep-fixes").hidden = !(s.fixes || []).length || !["running", "paused"].includes(s.state);
    $("sweep-fix-list").replaceChildren(...(s.fixes || []).map((f) => TP.el("div", { class: "fix" },
      TP.el("span", { text: `${f.title || f.kind} (from trial job #${f.job_id}): ${Object.entries(f.changes).map(([k, v]) => `${k} ${v[0]} → ${v[1]}`).join(", ")} ` }),
      TP.el("button", { type: "button", class: "small", text: "Apply to the remaining trials", onclick: async (e) => {
        e.target.disabled = true;
        try { const r = await TP.api(`/api/sweeps/${id}/fix`, { method: "POST", body: { alert_id: f.alert_id, n: f.n } }); e.target.replaceWith(`applied: ${JSON.stringify(r.applied)}`); }
        catch (err) { $("sweep-error").textContent = err.message; e.target.disabled = false; } } }))));
    $("sweep-reason").hidden = !s.reason; $("sweep-reason").textContent = s.reason || "";
    table(s); overTrials(s); parallel(s);
  }

  function table(s) {
    $("trials-head").replaceChildren(...["#", "Job", ...s.parameters, "State", s.objective.metric, "Pruned at", "Alerts", "Why"].map((h) => TP.el("th", { text: h })));
    const bestN = s.best ? s.best.number : -1;
    $("trials").replaceChildren(...s.trials.map((t) => TP.el("tr", { class: `trial-${t.state}${t.number === bestN ? " trial-best" : ""}`, "data-trial": t.number },
      TP.el("td", { text: String(t.number) }), TP.el("td", {}, TP.el("a", { href: `/jobs/${t.job_id}`, text: `#${t.job_id}` }), TP.el("span", { class: "muted", text: ` ${t.job_state || ""}` })),
      ...s.parameters.map((p) => TP.el("td", { class: "r", text: t.params[p] === undefined ? "–" : fmt(t.params[p]) })),
      TP.el("td", {}, TP.el("span", { class: `badge ${t.state}`, text: t.state })),
      TP.el("td", { class: "r", text: t.value === null ? "–" : fmt(t.value) }),
      TP.el("td", { class: "r", text: t.pruned_step === null ? "" : String(t.pruned_step) }),
      TP.el("td", {}, t.alerts.length ? TP.el("a", { class: "alert-badge", href: `/jobs/${t.job_id}#alerts`, text: `⚠ ${t.alerts.join(", ")}` }) : ""),
      TP.el("td", { class: "muted", text: t.reason || "" }))));
  }

  // An axis from [lo, hi] to pixels, on a log scale where every value is above zero and it spans 2 decades.
  function scale(values, a, b) {
    let lo = Math.min(...values), hi = Math.max(...values);
    const log = lo > 0 && hi / lo >= 100, f = log ? Math.log10 : (x) => x;
    if (lo === hi) { lo -= 1; hi += 1; }
    return (v) => a + (f(v) - f(lo)) / ((f(hi) - f(lo)) || 1) * (b - a);
  }
  const size = (el) => [el.clientWidth || 400, el.clientHeight || 260];

  function overTrials(s) {
    const el = $("over-trials"), [w, h] = size(el), done = s.trials.filter((t) => t.value !== null);
    el.replaceChildren();
    if (!done.length) { el.append(svg("text", { x: 10, y: 20, fill: "#6b7280" }, "No trial has finished yet.")); return; }
    const x = scale([0, Math.max(1, s.trials.length - 1)], 40, w - 10), y = scale(done.map((t) => t.value), h - 25, 10);
    let best = null; const path = [];
    for (const t of done) {
      best = best === null ? t.value : (s.objective.goal === "min" ? Math.min(best, t.value) : Math.max(best, t.value));
      path.push(`${x(t.number)},${y(best)}`);
      el.append(svg("circle", { cx: x(t.number), cy: y(t.value), r: 4, fill: "#2563eb" }, svg("title", {}, `#${t.number}: ${fmt(t.value)}`)));
    }
    for (const t of s.trials.filter((t) => t.state === "pruned")) el.append(svg("text", { x: x(t.number) - 3, y: h - 8, fill: "#9ca3af", "font-size": 10 }, "✂"));
    el.append(svg("polyline", { points: path.join(" "), fill: "none", stroke: "#16a34a", "stroke-width": 2 }),
      svg("text", { x: 40, y: h - 2, "font-size": 11, fill: "#6b7280" }, "trial →"), svg("text", { x: 2, y: 12, "font-size": 11, fill: "#6b7280" }, s.objective.metric));
  }

  function parallel(s) {
    const el = $("parallel"), [w, h] = size(el), done = s.trials.filter((t) => t.value !== null);
    el.replaceChildren();
    if (!done.length) return;
    const axes = [...s.parameters, s.objective.metric], step = (w - 60) / Math.max(1, axes.length - 1);
    const value = (t, a) => (a === s.objective.metric && !(a in t.params) ? t.value : t.params[a]);
    const ys = axes.map((a) => {
      const vals = done.map((t) => value(t, a));
      if (vals.every((v) => typeof v === "number")) return scale(vals, h - 25, 15);
      const cats = [...new Set(vals.map(String))];
      return (v) => (h - 25) - cats.indexOf(String(v)) / Math.max(1, cats.length - 1) * (h - 40);
    });
    const colour = scale(done.map((t) => t.value), 0, 1);
    for (const t of done) {
      const c = colour(t.value), good = s.objective.goal === "min" ? 1 - c : c;
      el.append(svg("polyline", { points: axes.map((a, i) => `${30 + i * step},${ys[i](value(t, a))}`).join(" "), fill: "none",
        stroke: `hsl(${Math.round(good * 120)}, 70%, 45%)`, "stroke-width": 1.5, opacity: 0.8 }, svg("title", {}, `#${t.number}: ${fmt(t.value)}`)));
    }
    axes.forEach((a, i) => el.append(svg("line", { x1: 30 + i * step, x2: 30 + i * step, y1: 10, y2: h - 20, stroke: "#9ca3af" }),
      svg("text", { x: Math.max(2, 30 + i * step - 30), y: h - 5, "font-size": 11, fill: "#374151" }, a)));
  }

  async function importance() {
    const r = await TP.api(`/api/sweeps/${id}/importance`);
    const items = Object.entries(r.importance);
    if (!items.length) return;
    $("importance").classList.remove("muted");
    $("importance").replaceChildren(...items.map(([k, v]) => TP.el("div", {}, TP.el("span", { class: "bar", style: `width:${Math.round(v * 200)}px` }), `${k} ${Math.round(v * 100)} %`)));
  }

  async function act(action) {
    $("sweep-error").textContent = "";
    try { await TP.api(`/api/sweeps/${id}/${action}`, { method: "POST" }); await refresh(); }
    catch (e) { $("sweep-error").textContent = e.message; }
  }
  $("sweep-pause").onclick = () => act("pause");
  $("sweep-resume").onclick = () => act("resume");
  $("sweep-cancel").onclick = () => { if (confirm("Cancel every queued or running trial of this sweep?")) act("cancel"); };

  let done = -1;
  async function refresh() {
    const s = await TP.api(`/api/sweeps/${id}`);
    render(s);
    const complete = s.counts.complete || 0;
    if (complete !== done) { done = complete; importance().catch(() => {}); }
    return s;
  }
  // for tests and bench/sweep.py: how many trials the first render drew, and when (ms since navigation)
  refresh().then((s) => { document.body.dataset.renderedMs = String(Math.round(performance.now())); document.body.dataset.rendered = String(s.trials.length); });
  setInterval(() => refresh().catch(() => {}), 3000);
})();
