"use strict";
// The job page's Step anatomy panel: per rank, what a step is made of, from the metrics
// anatomy/r<rank>/data_s|comm_s|compute_s|step_s (seconds per step) that a command job's startup hook
// sends every few seconds (tokenpulse/instrument/patch_torch.py). One stacked bar per rank for the
// latest window (waiting for data / computing / in collectives) and, per rank, a stacked chart of the
// same over the steps. job.js leaves these metrics out of its automatic charts. The CLI's summary
// (tokenpulse/anatomy_view.py) reads the same metrics.
(() => {
  const jobId = Number(document.getElementById("job").dataset.jobId);
  const $ = (id) => document.getElementById(id);
  const box = $("anatomy");
  if (!box) return;
  const KEY = /^anatomy\/r(\d+)\/(data_s|comm_s|compute_s|step_s)$/;
  // drawn bottom to top: waiting for data, then collectives, then compute
  const PARTS = [["data_s", "waiting for data", "#f97316"], ["comm_s", "in collectives", "#9333ea"], ["compute_s", "computing", "#2563eb"]];
  const ranks = {}; // rank -> {step: [], data_s: [], comm_s: [], compute_s: [], step_s: []}
  const charts = {};
  let lastStep = -1, active = true;
  const pct = (x) => `${Math.round(x * 100)}%`;

  function merge(series) {
    const got = {};
    for (const [k, s] of Object.entries(series)) {
      const m = KEY.exec(k);
      if (!m) continue;
      const r = (got[m[1]] = got[m[1]] || {});
      s.step.forEach((step, i) => { (r[step] = r[step] || {})[m[2]] = s.value[i]; });
    }
    for (const [r, bySteps] of Object.entries(got)) {
      const into = ranks[r] || (ranks[r] = { step: [], data_s: [], comm_s: [], compute_s: [], step_s: [] });
      for (const step of Object.keys(bySteps).map(Number).sort((a, b) => a - b)) {
        const w = bySteps[step];
        if (w.step_s === undefined || (into.step.length && step <= into.step[into.step.length - 1])) continue;
        into.step.push(step);
        for (const p of ["data_s", "comm_s", "compute_s", "step_s"]) into[p].push(w[p] || 0);
      }
    }
  }

  function bar(r) {
    const s = ranks[r], i = s.step.length - 1, step = s.step_s[i] || 0;
    const share = (p) => (step > 0 ? Math.min(1, s[p][i] / step) : 0);
    const words = PARTS.map(([p, label]) => `${label} ${pct(share(p))}`).join(", ");
    return TP.el("div", { class: "anatomy-row", "data-rank": r, "data-data": share("data_s").toFixed(3), "data-comm": share("comm_s").toFixed(3), "data-compute": share("compute_s").toFixed(3) },
      TP.el("span", { class: "anatomy-rank", text: `rank ${r}` }),
      TP.el("div", { class: "anatomy-bar", role: "img", "aria-label": `rank ${r}: ${words}` },
        ...PARTS.map(([p, label, color]) => TP.el("span", { class: `anatomy-seg seg-${p}`, title: `${label}: ${TP.sig(s[p][i], 3)} s per step (${pct(share(p))})`, style: `width:${(share(p) * 100).toFixed(1)}%;background:${color}` }))),
      TP.el("span", { class: "anatomy-text", text: `${TP.sig(step, 3)} s a step: ${words}` }));
  }

  function chartBox(r) {
    const id = `anatomy-chart-r${r}`;
    let el = $(id);
    if (!el) {
      $("anatomy-charts").append(TP.el("div", { class: "chart-box" },
        TP.el("div", { class: "chart-head" }, TP.el("h2", { id: `${id}-title`, text: `Rank ${r}: seconds per step` })),
        el = TP.el("div", { id, class: "chart anatomy-chart", "data-points": "0", role: "group", "aria-labelledby": `${id}-title` })));
    }
    return el;
  }

  function chart(r) {
    const s = ranks[r], el = $(`anatomy-chart-r${r}`);
    // stacked: each line is its part plus the parts below it, filled down to the one below
    const data = s.step.map((_, i) => s.data_s[i]), comm = s.step.map((_, i) => data[i] + s.comm_s[i]);
    const top = s.step.map((_, i) => comm[i] + s.compute_s[i]);
    const cols = [s.step, top, comm, data]; // the top first: later fills paint over the earlier ones
    el.dataset.points = String(s.step.length);
    const width = Math.max(280, el.clientWidth || 500);
    if (charts[r]) { // a box laid out anew (another rank's box joined the grid) resizes its chart
      if (Math.abs(charts[r].width - width) > 2) charts[r].setSize({ width, height: 180 });
      charts[r].setData(cols);
      return;
    }
    const own = (p) => (u, v, si, i) => (i === null || i === undefined || s[p][i] === undefined ? "–" : `${TP.sig(s[p][i], 3)} s`);
    const opts = { width, height: 180,
      series: [{ label: "step" },
        ...[PARTS[2], PARTS[1], PARTS[0]].map(([p, label, color]) => ({ label, stroke: color, fill: color, width: 1, value: own(p) }))],
      scales: { x: { time: false }, y: { range: (u, lo, hi) => [0, hi > 0 ? hi * 1.05 : 1] } },
      axes: [{ size: 40 }, { size: 56, values: (u, v) => TP.ticks(v) }], legend: { live: true } };
    charts[r] = new uPlot(opts, cols, el);
  }

  function draw() {
    const rs = Object.keys(ranks).filter((r) => ranks[r].step.length).sort((a, b) => a - b);
    box.hidden = !rs.length;
    if (!rs.length) return;
    $("anatomy-bars").replaceChildren(...rs.map(bar));
    rs.forEach(chartBox); // every box first, so each chart is sized to its box in the final grid
    rs.forEach(chart);
  }

  async function load() {
    const m = await TP.api(`/api/jobs/${jobId}/metrics?prefix=anatomy/&max_points=2000${lastStep >= 0 ? `&after_step=${lastStep}` : ""}`);
    merge(m.series);
    // the next fetch starts after the rank that is furthest behind: every rank's windows arrive
    const lasts = Object.values(ranks).filter((s) => s.step.length).map((s) => s.step[s.step.length - 1]);
    if (lasts.length) lastStep = Math.min(...lasts);
    draw();
  }
  async function poll() {
    try {
      const j = await TP.api(`/api/jobs/${jobId}`);
      await load();
      active = TP.ACTIVE.includes(j.state) || j.state === "queued";
    } catch (e) { /* the next poll tries again */ }
    if (active) setTimeout(poll, 3000);
  }
  poll();
})();
