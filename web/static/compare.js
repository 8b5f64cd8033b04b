"use strict";
(() => {
  const pick = document.getElementById("compare-pick");
  const chosen = new Set(new URLSearchParams(location.search).getAll("job").map(Number));
  const COLORS = ["#2563eb", "#f97316", "#16a34a", "#9333ea", "#dc2626", "#0891b2"];
  let charts = {};

  async function init() {
    const data = await TP.api("/api/jobs?limit=100");
    pick.replaceChildren(...data.jobs.map((j) => TP.el("label", { class: "check" },
      TP.el("input", { type: "checkbox", value: j.id, ...(chosen.has(j.id) ? { checked: "" } : {}),
        onchange: (e) => { e.target.checked ? chosen.add(j.id) : chosen.delete(j.id); draw(); } }),
      ` ${j.name} (#${j.id}, ${j.state})`)));
    draw();
  }

  async function draw() {
    const ids = [...chosen];
    const [metrics, details] = await Promise.all([
      Promise.all(ids.map((id) => TP.api(`/api/jobs/${id}/metrics?keys=loss&keys=tokens_per_s&max_points=1000`))),
      Promise.all(ids.map((id) => TP.api(`/api/jobs/${id}`)))]);
    for (const [id, key] of [["chart-cmp-loss", "loss"], ["chart-cmp-tps", "tokens_per_s"]]) {
      const steps = new Set();
      metrics.forEach((m) => (m.series[key] ? m.series[key].step : []).forEach((s) => steps.add(s)));
      const xs = [...steps].sort((a, b) => a - b);
      const cols = [xs, ...metrics.map((m) => { const s = m.series[key]; const mp = new Map(); if (s) s.step.forEach((st, i) => mp.set(st, s.value[i])); return xs.map((x) => mp.get(x) ?? null); })];
      const box = document.getElementById(id);
      if (charts[id]) charts[id].destroy();
      charts[id] = new uPlot({ width: box.clientWidth || 600, height: 240, scales: { x: { time: false } },
        series: [{ label: "step" }, ...details.map((d, i) => ({ label: `#${d.id} ${d.name}`, stroke: COLORS[i % COLORS.length], spanGaps: true }))] }, cols, box);
    }
    const keys = new Set(); details.forEach((d) => Object.keys(d.spec).forEach((k) => keys.add(k)));
    const differ = [...keys].filter((k) => new Set(details.map((d) => JSON.stringify(d.spec[k]))).size > 1);
    const table = document.getElementById("compare-diff");
    table.replaceChildren(TP.el("tr", {}, TP.el("th", { text: "setting" }), ...details.map((d) => TP.el("th", { text: `#${d.id}` }))),
      ...differ.map((k) => TP.el("tr", {}, TP.el("td", { text: k }), ...details.map((d) => TP.el("td", { text: JSON.stringify(d.spec[k]) })))));
  }
  init();
})();
