"use strict";
// The job page's System panels (sys/ series sampled by the agent, worker/agent/sysmetrics.py, charted
// by wall clock) and its log search and download (GET /api/jobs/{id}/logs, /logs.txt).
(() => {
  const jobId = Number(document.getElementById("job").dataset.jobId);
  const $ = (id) => document.getElementById(id);
  const COLORS = ["#2563eb", "#f97316", "#16a34a", "#9333ea", "#dc2626", "#0891b2", "#ca8a04", "#be185d"];
  const gpuKey = (what) => (k) => new RegExp(`^sys/gpu(\\d+)_${what}$`).exec(k);
  const PANELS = [
    { id: "sys-cpu", title: "CPU (%)", keys: { "sys/cpu_pct": "job (% of one core)", "sys/host_cpu_pct": "machine (% of all cores)" } },
    { id: "sys-mem", title: "Memory (MB)", keys: { "sys/rss_mb": "job RSS", "sys/gpu_mem_mb": "job GPU memory" } },
    { id: "sys-disk", title: "Disk, job (MB/s)", keys: { "sys/disk_read_mbps": "read", "sys/disk_write_mbps": "write" } },
    { id: "sys-net", title: "Network, machine (MB/s)", keys: { "sys/net_recv_mbps": "received", "sys/net_sent_mbps": "sent" } },
    { id: "sys-gpu-util", title: "GPU utilisation (%)", gpu: gpuKey("util_pct") },
    { id: "sys-gpu-mem", title: "GPU memory (MB)", gpu: gpuKey("mem_mb") },
    { id: "sys-gpu-power", title: "GPU power (W)", gpu: gpuKey("power_w") },
    { id: "sys-gpu-temp", title: "GPU temperature (°C)", gpu: gpuKey("temp_c") },
  ];
  const series = {}; // sys/... -> {t: [], value: []}
  const charts = {};
  let lastStep = -1, active = true;

  function labelsFor(p) {
    const names = Object.keys(series).sort();
    if (p.keys) return names.filter((k) => k in p.keys).map((k) => [k, p.keys[k]]);
    return names.map((k) => [k, p.gpu(k)]).filter(([, m]) => m).map(([k, m]) => [k, `GPU ${m[1]}`]);
  }
  function data(keys) { // one x (time) column: the samples of one moment share their time
    const ts = [...new Set(keys.flatMap((k) => series[k].t))].sort((a, b) => a - b);
    const at = new Map(ts.map((t, i) => [t, i]));
    return [ts, ...keys.map((k) => { const col = ts.map(() => null); series[k].t.forEach((t, i) => { col[at.get(t)] = series[k].value[i]; }); return col; })];
  }
  const SIZE = 180; // each chart's height
  // Not hovering, a legend entry says its series' latest reading (as the job's charts do), not "–"
  // (which reads as missing data); hovering, the reading under the cursor.
  const orLatest = (fmt) => (u, v, si, idx) => {
    if (idx == null && v == null) { const col = u.data[si]; for (let i = col.length - 1; i >= 0 && v == null; i--) v = col[i]; }
    return v == null ? "–" : fmt(v);
  };
  function draw() {
    const box = $("system-charts");
    $("system").hidden = !Object.keys(series).length; // shown first: a chart takes its box's width as laid out
    for (const p of PANELS) {
      const ks = labelsFor(p);
      if (!ks.length) continue;
      let el = $(p.id);
      if (!el) {
        box.append(TP.el("div", { class: "chart-box" }, TP.el("div", { class: "chart-head" }, TP.el("h2", { id: `${p.id}-title`, text: p.title })),
          el = TP.el("div", { id: p.id, class: "chart system-chart", "data-points": "0", role: "group", "aria-labelledby": `${p.id}-title` })));
      }
      const keys = ks.map(([k]) => k), d = data(keys);
      el.dataset.points = d[0].length;
      el.dataset.series = ks.map(([, l]) => l).join(",");
      const c = charts[p.id];
      if (c && c.keys === keys.join(",")) { c.setData(d); continue; }
      if (c) c.destroy();
      el.replaceChildren();
      const opts = { width: Math.max(280, el.clientWidth || 500), height: SIZE,
        series: [{ label: "time", value: orLatest((v) => new Date(v * 1000).toLocaleTimeString("en-GB")) },
          ...ks.map(([, l], i) => ({ label: l, stroke: COLORS[i % COLORS.length], width: 1.5, spanGaps: true, value: orLatest((v) => TP.sig(v, 3)) }))],
        // the time axis' two lines (the time, and the date under the first tick) as the job's wall-clock axis has them
        scales: { x: { time: true } }, axes: [{ size: 50 }, { size: 56, values: (u, v) => TP.ticks(v) }], legend: { live: true } };
      charts[p.id] = new uPlot(opts, d, el);
      charts[p.id].keys = keys.join(",");
    }
    for (const [id, c] of Object.entries(charts)) fit(c, $(id)); // a card added beside another narrows it
  }
  function fit(c, el) { // the card's width, after a resize or a layout change (a scrollbar came)
    const w = Math.max(280, el.clientWidth);
    if (Math.abs(c.width - w) > 1) c.setSize({ width: w, height: SIZE });
  }
  let resizeTimer = null;
  window.addEventListener("resize", () => {
    clearTimeout(resizeTimer);
    resizeTimer = setTimeout(() => { for (const [id, c] of Object.entries(charts)) fit(c, $(id)); }, 100);
  });
  async function load() {
    const m = await TP.api(`/api/jobs/${jobId}/metrics?prefix=sys/&max_points=2000${lastStep >= 0 ? `&after_step=${lastStep}` : ""}`);
    for (const [k, s] of Object.entries(m.series)) {
      const into = series[k] || (series[k] = { t: [], value: [] });
      s.step.forEach((step, i) => { if (step > lastStep || !into.t.length) { into.t.push(s.t[i]); into.value.push(s.value[i]); } });
    }
    for (const s of Object.values(m.series)) if (s.step.length) lastStep = Math.max(lastStep, s.step[s.step.length - 1]);
    draw();
  }
  async function poll() {
    try {
      const j = await TP.api(`/api/jobs/${jobId}`);
      await load();
      active = TP.ACTIVE.includes(j.state) || j.state === "queued";
    } catch (e) { /* the next poll tries again */ }
    if (active) setTimeout(poll, 5000);
  }
  poll();

  // ---- log search and download ----------------------------------------------------------------
  const q = () => {
    const p = new URLSearchParams();
    if ($("log-grep").value) p.set("grep", $("log-grep").value);
    if ($("log-regex").checked) p.set("regex", "true");
    return p;
  };
  function refreshDownload() { $("log-download").href = `/api/jobs/${jobId}/logs.txt?${q()}`; }
  async function search(ev) {
    if (ev) ev.preventDefault();
    refreshDownload();
    const out = $("log-results"), note = $("log-search-note");
    if (!$("log-grep").value) { out.hidden = true; note.textContent = ""; $("log").hidden = false; return; }
    const p = q(); p.set("limit", "2000");
    try {
      const r = await TP.api(`/api/jobs/${jobId}/logs?${p}`);
      out.replaceChildren(...r.lines.map((l) => TP.el("span", { class: `line ${l.stream}`, title: TP.abs(l.t), text: `${l.line}\n` })));
      note.textContent = `${TP.num(r.matched)} of ${TP.num(r.scanned)} lines match${r.matched > r.lines.length ? ` (the last ${TP.num(r.lines.length)} shown)` : ""}.`;
      out.hidden = false; $("log").hidden = true;
    } catch (e) { note.textContent = e.message || String(e); }
  }
  $("log-search").addEventListener("submit", search);
  $("log-clear").addEventListener("click", () => { $("log-grep").value = ""; search(); });
  refreshDownload();
})();
