"use strict";
(() => {
  const $ = (id) => document.getElementById(id);
  const pick = $("compare-pick");
  // A run: "12" (job 12's current attempt) or "12.1" (its attempt 1: each attempt keeps its own points).
  const chosen = new Set(new URLSearchParams(location.search).getAll("job").filter((k) => /^[1-9]\d*(\.\d+)?$/.test(k)));
  const jobOf = (key) => Number(key.split(".")[0]);
  const attemptOf = (key) => (key.includes(".") ? Number(key.split(".")[1]) : null);
  const runLabel = (key, name) => `#${jobOf(key)}${attemptOf(key) !== null ? ` attempt ${attemptOf(key)}` : ""} ${name}`;
  const charts = {};
  // The metrics to overlay: any the chosen runs log, kept per browser; loss and eval loss at first.
  let metrics = TP.pref.get("tp-compare-metrics", ["loss", "eval/loss", "tokens_per_s"]);
  let knownKeys = [];
  const cache = new Map(); // id -> {detail, metrics}
  let jobs = [];

  function ema(vals, a) {
    const out = new Array(vals.length); let m = 0, w = 0;
    for (let i = 0; i < vals.length; i++) {
      const v = vals[i]; if (v === null || !isFinite(v)) { out[i] = null; continue; }
      m = a * m + (1 - a) * v; w = a * w + (1 - a); out[i] = a ? m / w : v;
    }
    return out;
  }

  async function init() {
    const [data, sel] = await Promise.all([TP.api("/api/jobs?limit=200"),
      Promise.all([...new Set([...chosen].map(jobOf))].map((id) => TP.api(`/api/jobs/${id}`).catch(() => null)))]);
    jobs = data.jobs;
    for (const j of sel) if (j && !jobs.some((x) => x.id === j.id)) jobs.push(j);
    renderPicker(); draw();
  }

  function renderPicker() {
    const q = $("pick-search").value.trim();
    const byId = /^#\s*\d+$/.test(q); // "#4" is job 4 only; "4" also matches names with a 4
    const hit = (j) => (byId ? String(j.id) === q.slice(1).trim()
      : j.name.includes(q) || String(j.id) === q || j.project === q || (j.tags || []).includes(q)); // a project or a tag picks its jobs
    const box = (key, ...label) => TP.el("input", { type: "checkbox", value: key, checked: chosen.has(key), "aria-label": label.join(""),
      onchange: (e) => { e.target.checked ? chosen.add(key) : chosen.delete(key); syncUrl(); renderPicker(); draw(); } });
    const swatch = (key) => TP.el("span", { class: "swatch", style: chosen.has(key) ? `background:${TP.jobColor(key)}` : "" });
    const picked = (j) => [...chosen].some((k) => jobOf(k) === j.id);
    pick.replaceChildren(...jobs.filter((j) => !q || hit(j) || picked(j)).sort((a, b) => b.id - a.id).flatMap((j) => {
      const key = String(j.id);
      const rows = [TP.el("label", { class: "check pick" }, box(key, `#${j.id} ${j.name}`), swatch(key),
        TP.el("span", { class: "pick-name", title: `${j.name} #${j.id} · ${j.project || "default"}${(j.tags || []).length ? " · " + j.tags.join(", ") : ""}` }, j.name, TP.el("span", { class: "muted", text: ` #${j.id}` })),
        TP.el("span", { class: `badge ${j.state}`, text: j.state }))];
      // a job run more than once (a retry, a fix's relaunch): each attempt can be compared on its own
      for (let a = 1; a <= (j.attempt || 0) && j.attempt > 1; a++) {
        const k = `${j.id}.${a}`;
        rows.push(TP.el("label", { class: "check pick pick-attempt" }, box(k, `#${j.id} attempt ${a}`), swatch(k),
          TP.el("span", { class: "pick-name", text: `#${j.id} attempt ${a}` })));
      }
      return rows;
    }));
  }
  function syncUrl() { history.replaceState(null, "", `/compare${chosen.size ? "?" + [...chosen].map((k) => `job=${k}`).join("&") : ""}`); }

  async function load(key) {
    if (!cache.has(key)) {
      const id = jobOf(key), a = attemptOf(key);
      const [detail, metrics, changes] = await Promise.all([TP.api(`/api/jobs/${id}`),
        TP.api(`/api/jobs/${id}/metrics?max_points=1500${a !== null ? `&attempt=${a}` : ""}`),
        TP.api(`/api/jobs/${id}/changes`).catch(() => [])]);
      // an earlier attempt does not change; a job's current one does until the job is over
      const done = TP.FINAL.includes(detail.state) || (a !== null && a < detail.attempt);
      const g = { key, detail, metrics, changes: changes.filter((c) => c.state === "applied") };
      if (done) cache.set(key, g); else return g;
    }
    return cache.get(key);
  }

  async function draw() {
    const ids = [...chosen];
    $("compare-empty").hidden = ids.length > 0;
    // One id that does not exist (a typo, a deleted job) must not blank the page: draw the runs that
    // exist and name the missing ones.
    const all = await Promise.all(ids.map((id, i) => load(id).then((g) => ({ ...g, i }), (e) => ({ id: jobOf(id), key: id, error: e }))));
    const got = all.filter((g) => !g.error);
    showMissing(all.filter((g) => g.error));
    const a = Number($("smooth").value), byTime = $("xaxis").value === "time";
    renderMetricPicker(got);
    const wanted = metrics.filter((k) => knownKeys.includes(k));
    layoutCharts(wanted);
    for (const key of wanted) {
      const id = chartIdOf(key), fmt = TP.metricFormat(key), smoothable = !key.startsWith("sys/") && key !== "lr";
      const xsOf = (g) => { const s = g.metrics.series[key]; if (!s) return []; return byTime ? s.t.map((t) => Math.round((t - s.t[0]) * 10) / 10) : s.step; };
      const all = new Set(); got.forEach((g) => xsOf(g).forEach((x) => all.add(x)));
      const xs = [...all].sort((p, q) => p - q);
      const cols = [xs], ser = [{ label: byTime ? "s" : "step" }];
      got.forEach((g, i) => {
        const s = g.metrics.series[key]; const mp = new Map();
        if (s) xsOf(g).forEach((x, k) => mp.set(x, s.value[k]));
        const raw = xs.map((x) => (mp.has(x) ? mp.get(x) : null));
        const color = TP.jobColor(g.key), label = runLabel(g.key, g.detail.name);
        const sparse = s && s.step.length < 60; // eval points: few, drawn as dots on a line
        if (smoothable && !sparse && a > 0) {
          cols.push(raw); ser.push({ label: `${label} (raw)`, stroke: TP.jobColorA(g.key, 0.25), width: 1, spanGaps: true, value: (u, v) => fmt.value(v) });
          // smooth over the job's own points only, then spread onto the shared x axis
          const own = s ? ema(s.value, a) : []; const sm = new Map(); if (s) xsOf(g).forEach((x, k) => sm.set(x, own[k]));
          cols.push(xs.map((x) => (sm.has(x) ? sm.get(x) : null)));
          ser.push({ label, stroke: color, width: 2, spanGaps: true, value: (u, v) => fmt.value(v) });
        } else {
          cols.push(raw); ser.push({ label, stroke: color, width: 2, spanGaps: true, points: { show: sparse }, value: (u, v) => fmt.value(v) });
        }
      });
      const box = $(id);
      if (charts[id]) charts[id].destroy();
      box.replaceChildren();
      if (!got.length) { charts[id] = null; continue; }
      charts[id] = new uPlot({ width: Math.max(280, box.clientWidth || 600), height: 260, scales: { x: { time: false } }, series: ser,
        axes: [{ label: byTime ? "seconds since start" : "step", labelSize: 18, ...(byTime ? {} : { incrs: TP.STEP_INCRS }), values: (u, v) => TP.ticks(v) }, { size: 56, label: fmt.unit ? `${key} (${fmt.unit})` : key, labelSize: 18, values: (u, v) => TP.ticks(v, fmt.axis) }],
        cursor: { sync: { key: "cmp" }, drag: { x: true, y: false } } }, cols, box);
      // one legend entry per run: its faint raw curve is drawn, not listed beside its smoothed one
      box.querySelectorAll(".u-legend .u-series").forEach((row, i) => { if (ser[i] && / \(raw\)$/.test(ser[i].label)) row.hidden = true; });
      // a run with no point of this metric is named, not silently missing
      const none = got.filter((g) => !(g.metrics.series[key] && g.metrics.series[key].step.length));
      if (none.length) box.append(TP.el("p", { class: "muted no-data", text: `No ${key} points: ${none.map((g) => runLabel(g.key, g.detail.name)).join(", ")}.` }));
    }
    diffTable(got);
  }

  const chartIdOf = (k) => `chart-cmp-${k.replace(/[^A-Za-z0-9_-]/g, "_")}`;
  // One chart per chosen metric, in the order chosen; charts of metrics no longer chosen go.
  function layoutCharts(keys) {
    const box = $("compare-charts"), want = new Set(keys.map(chartIdOf));
    for (const [id, c] of Object.entries(charts)) if (!want.has(id)) { if (c) c.destroy(); delete charts[id]; }
    for (const el of [...box.children]) if (!want.has(el.dataset.chart)) el.remove();
    for (const k of keys) {
      const id = chartIdOf(k);
      if (!$(id)) box.append(TP.el("div", { class: "chart-box", "data-chart": id },
        TP.el("h2", { text: k === "loss" ? "loss (smoothed; raw curves faint)" : k }), TP.el("div", { id, class: "chart", "data-metric": k })));
    }
  }
  // Every metric any chosen run logs, as a checkbox: ticking one adds its chart.
  function renderMetricPicker(got) {
    const keys = new Set(); got.forEach((g) => Object.keys(g.metrics.series).forEach((k) => keys.add(k)));
    const order = (k) => (k === "loss" ? 0 : k.startsWith("eval") ? 1 : k.startsWith("sys/") ? 3 : 2);
    knownKeys = [...keys].sort((p, q) => order(p) - order(q) || p.localeCompare(q));
    const box = $("compare-metrics");
    box.replaceChildren(...knownKeys.map((k) => TP.el("label", { class: "check metric-pick" },
      TP.el("input", { type: "checkbox", value: k, checked: metrics.includes(k), onchange: (e) => {
        metrics = e.target.checked ? [...metrics.filter((m) => m !== k), k] : metrics.filter((m) => m !== k);
        TP.pref.set("tp-compare-metrics", metrics); draw();
      } }), ` ${k}`)));
    box.hidden = !knownKeys.length;
  }

  function showMissing(bad) {
    const box = $("compare-missing");
    box.hidden = !bad.length;
    box.replaceChildren(...(bad.length ? [
      `Not shown: ${bad.map((g) => (g.error.status === 404 ? `job #${g.id} does not exist` : `job #${g.id} (${g.error.message})`)).join("; ")}. `,
      TP.el("button", { type: "button", class: "small ghost", text: "Remove from the comparison", onclick: () => {
        for (const g of bad) chosen.delete(g.key);
        syncUrl(); renderPicker(); draw();
      } })] : []));
  }

  function flat(spec, prefix = "") {
    const out = {};
    for (const [k, v] of Object.entries(spec || {})) {
      if (v && typeof v === "object" && !Array.isArray(v)) Object.assign(out, flat(v, `${prefix}${k}.`));
      else out[prefix + k] = v;
    }
    return out;
  }

  // A run's settings as it ran them: an attempt before a fix ran the values the fix changed; the
  // job's current settings say what a fix changed ("asked": the value it was submitted with).
  function settingsOf(g) {
    const spec = flat(g.detail.spec), asked = {}, a = attemptOf(g.key);
    for (const c of [...g.changes].reverse()) { // newest first: an attempt ends at the oldest fix's old value
      for (const [k, pair] of Object.entries(c.changes || {})) {
        if (!Array.isArray(pair)) continue;
        if (a !== null && c.to_attempt > a) spec[k] = pair[0];
        else if (a === null || c.to_attempt <= a) asked[k] = { value: pair[0], fix: c.id };
      }
    }
    return { spec, asked };
  }
  function diffTable(got) {
    // a run of one attempt: that attempt's own figures (its outcome, its last logged values)
    const details = got.map((g) => {
      const a = attemptOf(g.key), d = g.detail;
      if (a === null) return { ...d, key: g.key };
      const row = (d.attempts || []).find((x) => x.attempt === a) || {};
      const last = {}; let step = null;
      for (const [k, s] of Object.entries(g.metrics.series)) if (s.value.length) { last[k] = s.value[s.value.length - 1]; step = Math.max(step || 0, s.step[s.step.length - 1]); }
      return { ...d, key: g.key, state: row.outcome || (row.ended_at ? "ended" : d.state), step, last,
        started_at: row.started_at, finished_at: row.ended_at || (a === d.attempt ? d.finished_at : null) };
    });
    const table = $("compare-diff");
    if (!details.length) { table.replaceChildren(); $("compare-same").textContent = ""; return; }
    const settings = got.map(settingsOf), specs = settings.map((x) => x.spec);
    const infos = details.map((d) => d.info || {});
    const keys = new Set(); specs.forEach((s) => Object.keys(s).forEach((k) => keys.add(k)));
    // runs of different kinds (a training job, a command job) share few settings: only those compare
    const kinds = new Set(details.map((d) => d.kind || "train"));
    const shared = [...keys].filter((k) => kinds.size < 2 || specs.every((s) => s[k] !== undefined));
    const oneKind = keys.size - shared.length;
    const differ = shared.filter((k) => k !== "name" && new Set(specs.map((s) => JSON.stringify(s[k] ?? null))).size > 1).sort();
    const chosenKeys = ["device", "precision", "padding", "max_seq_length", "batch_size", "grad_accum", "tokens_per_batch"];
    const infoDiff = chosenKeys.filter((k) => new Set(infos.map((i) => JSON.stringify(i[k] ?? null))).size > 1);
    const fmt = (v) => (v === undefined || v === null ? "–" : typeof v === "object" ? JSON.stringify(v) : String(v));
    const head = TP.el("tr", {}, TP.el("th", { text: "" }), ...details.map((d, i) => TP.el("th", {},
      TP.el("span", { class: "swatch", style: `background:${TP.jobColor(d.key)}` }), TP.el("a", { href: `/jobs/${d.id}`, text: runLabel(d.key, d.name) }))));
    const row = (label, vals, cls = "") => TP.el("tr", { class: cls }, TP.el("th", { scope: "row", text: label }), ...vals.map((v) => TP.el("td", { text: v })));
    const rows = [
      row("state", details.map((d) => d.state)),
      row("project · tags", details.map((d) => [d.project || "default", ...(d.tags || [])].join(" · "))),
      row("steps", details.map((d) => `${TP.num(d.step)}${d.total_steps ? " / " + TP.num(d.total_steps) : ""}`)),
      row("last loss", details.map((d) => TP.sig((d.last || {}).loss))),
      row("real tokens/s (last)", details.map((d) => TP.compact((d.last || {}).tokens_per_s, "tok/s"))),
      // the final (latest) evaluation on held-out data, for jobs that evaluate
      ...(details.some((d) => (d.last || {})["eval/loss"] !== undefined) ? [
        row("eval loss (last)", details.map((d) => TP.sig((d.last || {})["eval/loss"]))),
        row("eval perplexity (last)", details.map((d) => TP.sig((d.last || {})["eval/ppl"])))] : []),
      row("duration", details.map((d) => (d.started_at ? TP.dur((d.finished_at || Date.now() / 1000) - d.started_at) : "–"))),
      ...differ.map((k) => row(k, specs.map((s, i) => fmt(s[k]) + (settings[i].asked[k] ? ` (asked ${fmt(settings[i].asked[k].value)}; fix #${settings[i].asked[k].fix})` : "")), "diff")),
      ...infoDiff.map((k) => row(`${k} (chosen)`, infos.map((i) => fmt(i[k])), "diff")),
    ];
    table.replaceChildren(TP.el("thead", {}, head), TP.el("tbody", {}, ...rows));
    const kindNote = oneKind ? ` (${oneKind} setting${oneKind > 1 ? "s" : ""} of one kind of job only, ${[...kinds].join(" and ")}, not compared)` : "";
    $("compare-same").textContent = details.length > 1 ? (differ.length ? `${differ.length} setting${differ.length > 1 ? "s" : ""} differ; all other shared settings are the same${kindNote}.` : `All shared settings are the same${kindNote}.`) : "Pick another job to see what differs.";
  }

  let rt = null;
  window.addEventListener("resize", () => { clearTimeout(rt); rt = setTimeout(() => { for (const [id, c] of Object.entries(charts)) if (c) c.setSize({ width: Math.max(280, $(id).clientWidth), height: 260 }); }, 100); });
  // The list holds the 200 newest jobs; a search also asks the server, so any job can be found.
  let searchSeq = 0, searchTimer = null;
  $("pick-search").addEventListener("input", () => {
    renderPicker();
    clearTimeout(searchTimer);
    const q = $("pick-search").value.trim();
    if (!q) return;
    searchTimer = setTimeout(async () => {
      const my = ++searchSeq;
      const d = await TP.api(`/api/jobs?${new URLSearchParams({ q, limit: 100 })}`);
      if (my !== searchSeq) return;
      for (const j of d.jobs) if (!jobs.some((x) => x.id === j.id)) jobs.push(j);
      renderPicker();
    }, 200);
  });
  $("smooth").addEventListener("input", () => { $("smooth-val").value = Number($("smooth").value).toFixed(2); draw(); });
  $("xaxis").addEventListener("change", draw);
  TP.live(["jobs"], (f) => {
    if (f.type === "job") {
      const i = jobs.findIndex((j) => j.id === f.job.id);
      if (i >= 0) jobs[i] = { ...jobs[i], ...f.job }; else jobs.unshift(f.job);
      if (chosen.has(String(f.job.id)) && TP.FINAL.includes(f.job.state)) { cache.delete(String(f.job.id)); draw(); }
      renderPicker();
    }
  }, null);
  window.TPCMP = { charts }; // for the browser tests
  init();
  setInterval(() => { if ([...chosen].some((id) => !cache.has(id))) draw(); }, 5000); // running jobs grow
})();
