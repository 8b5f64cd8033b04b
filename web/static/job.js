"use strict";
(() => {
  const jobId = Number(document.getElementById("job").dataset.jobId);
  const $ = (id) => document.getElementById(id);
  const MAX_POINTS = 2000;
  let job = null, lastStep = -1, lastLogSeq = -1, firstChartMarked = false;
  const series = {}; // name -> {step: [], value: [], t: []}: the overview (downsampled by the server) + live points
  // Each attempt (a retry, a relaunch after a fix) has its own points: `series` holds the current
  // attempt's (shownAttempt); earlier attempts' overviews are drawn faded behind it (toggle).
  let shownAttempt = null;
  const earlier = {}; // attempt -> {name -> {step, value, t}}, fetched once (an ended attempt does not change)
  const showEarlier = () => $("earlier").checked;
  let detail = null; // {min, max, series} while zoomed into a downsampled range
  let downsampledInfo = {}; // name -> total points on the server
  const charts = {};
  const infoEvents = [];
  let agents = new Map(), lastAgent = null;
  const checkpoints = [];

  const fmtTps = (u, v) => TP.ticks(v);
  const fmtMem = (u, v) => TP.ticks(v);
  const small = TP.small;
  const fmtLr = (u, v) => TP.ticks(v);
  const CHARTS = {
    // Eval loss beside train loss: tokenpulse's own jobs log eval/loss, a Trainer script eval_loss.
    "chart-loss": { keys: ["loss", "eval/loss", "eval_loss"], labels: ["train loss", "eval loss", "eval loss"], colors: ["#2563eb", "#dc2626", "#dc2626"], points: [false, true, true], smooth: true, value: (v) => TP.sig(v) },
    "chart-tps": { keys: ["padded_tokens_per_s", "tokens_per_s"], labels: ["padded", "real"], colors: ["#f97316", "#2563eb"], dash: [[5, 4], null], unit: "tok/s", axis: fmtTps, value: (v) => TP.compact(v, "tok/s") },
    "chart-step": { keys: ["step_time_s"], labels: ["step time"], unit: "s", smooth: true, value: (v) => (v === null || v === undefined ? "–" : `${TP.sig(v, 3)} s`) },
    "chart-lr": { keys: ["lr"], labels: ["lr"], axis: fmtLr, value: (v) => small(v, 3) },
    "chart-grad": { keys: ["grad_norm"], labels: ["grad norm"], smooth: true, value: (v) => TP.sig(v) },
    "chart-mem": { keys: ["rss_mb", "cuda_peak_mb"], labels: ["process RSS", "CUDA peak"], unit: "MiB", axis: fmtMem, value: (v) => TP.bytesMB(v) },
  };
  const COLORS = ["#2563eb", "#f97316", "#16a34a", "#9333ea"];
  // "Your panel": any logged metrics a person picks, overlaid; the choice is kept per browser for
  // every job that logs the same set of metrics (the same script, the same kind of run).
  const PANEL_COLORS = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#f97316", "#0891b2", "#ca8a04", "#db2777"];
  CHARTS["chart-custom"] = { keys: [], labels: [], colors: [], value: (v) => TP.sig(v), axis: (u, v) => TP.ticks(v) };
  let panelPrefKey = null, panelKeys = "";
  function setPanel(keys) {
    Object.assign(CHARTS["chart-custom"], { keys, labels: keys.slice(), colors: keys.map((k, i) => PANEL_COLORS[i % PANEL_COLORS.length]) });
    $("panel-picked").replaceChildren(...keys.map((k) => TP.el("span", { class: "chip", "data-key": k }, k,
      TP.el("button", { type: "button", class: "small ghost", "aria-label": `Remove ${k} from your panel`, text: "×",
        onclick: () => { const next = keys.filter((x) => x !== k); setPanel(next); TP.pref.set(panelPrefKey, next); updatePanelPicker(); scheduleDraw(); } }))));
    $("panel-box").classList.toggle("empty-panel", !keys.length);
  }
  function updatePanelPicker() {
    const logged = Object.keys(series).filter((k) => !k.startsWith("sys/") && series[k].step.length).sort();
    if (!logged.length) return;
    const set = logged.join(",");
    if (panelPrefKey === null) { // the first full look at what this job logs: its remembered panel
      panelPrefKey = `tp-job-panel:${set}`;
      setPanel(TP.pref.get(panelPrefKey, []).filter((k) => logged.includes(k)));
    }
    const picked = CHARTS["chart-custom"].keys;
    if (set + "|" + picked.join(",") === panelKeys) return;
    panelKeys = set + "|" + picked.join(",");
    $("panel-add").replaceChildren(TP.el("option", { value: "", text: "Add a metric…" }),
      ...logged.filter((k) => !picked.includes(k)).map((k) => TP.el("option", { value: k, text: k })));
  }
  const xMode = () => $("xaxis").value; // "step" | "time" (wall clock)
  const logY = () => $("logy").checked;
  const clipY = () => $("clip").checked;

  // A chart shows only the series that exist for this job (no "CUDA peak" on a CPU run).
  function activeSpec(spec, withEarlier = true) {
    const idx = spec.keys.map((k, i) => i).filter((i) => series[spec.keys[i]] && series[spec.keys[i]].step.length);
    const pick = (a) => (a ? idx.map((i) => a[i]) : a);
    const labels = pick(spec.labels), colors = spec.colors ? pick(spec.colors) : idx.map((i) => COLORS[i]);
    // earlier attempts' points of the same metrics, faded (on the step axis: their steps repeat)
    const ghosts = [];
    if (withEarlier && showEarlier() && xMode() !== "time") {
      for (const a of Object.keys(earlier).map(Number).sort((x, y) => x - y)) {
        pick(spec.keys).forEach((k, i) => { const g = earlier[a][k]; if (g && g.step.length) ghosts.push({ attempt: a, key: k, label: `attempt ${a}: ${labels[i]}`, color: colors[i] }); });
      }
    }
    return { ...spec, keys: pick(spec.keys), labels, colors, dash: pick(spec.dash), points: pick(spec.points), ghosts,
      smooth: spec.smooth && idx[0] === 0 }; // the smoothed line belongs to the first series only
  }

  // Every other metric the job logs (a Trainer script's, the explicit API's, eval/*) gets a chart of
  // its own, grouped by its prefix ("train/...", "eval/...", or "eval_..." as Trainer names them).
  const SHOWN_ELSEWHERE = new Set(["eta_s", "mfu", "epoch"]); // figures in the status panel
  const chartId = (k) => `chart-x-${k.replace(/[^A-Za-z0-9_-]/g, "_")}`;
  const groupOf = (k) => (k.includes("/") ? k.split("/")[0] : k.startsWith("eval_") ? "eval" : "other");
  function addExtraCharts() {
    updatePanelPicker();
    const known = new Set(Object.entries(CHARTS).filter(([id]) => id !== "chart-custom").flatMap(([, c]) => c.keys));
    for (const k of Object.keys(series).sort()) {
      if (known.has(k) || SHOWN_ELSEWHERE.has(k) || !series[k].step.length) continue;
      if (k.startsWith("anatomy/")) continue; // the Step anatomy panel's (anatomy.js), not a chart each
      const id = chartId(k), group = groupOf(k);
      let sec = $(`charts-${group}`);
      if (!sec) {
        sec = TP.el("section", { id: `charts-${group}`, class: "charts extra-charts", "aria-label": `${group} metrics` },
          TP.el("h2", { class: "group-title", text: group === "other" ? "Other metrics" : `${group}/` }));
        const groups = [...document.querySelectorAll(".extra-charts")].filter((g) => g.id > sec.id);
        (groups[0] ? groups[0].before(sec) : $("extra-charts").append(sec));
      }
      sec.append(TP.el("div", { class: "chart-box" },
        TP.el("div", { class: "chart-head" }, TP.el("h2", { id: `${id}-title`, text: TP.metricFormat(k).unit ? `${k} (${TP.metricFormat(k).unit})` : k })),
        TP.el("div", { id, class: "chart", "data-points": "0", tabindex: "0", role: "group", "aria-labelledby": `${id}-title`, "aria-describedby": `${id}-summary chart-keys` }),
        TP.el("p", { id: `${id}-summary`, class: "sr-only chart-summary", "aria-live": "off" })));
      const f = TP.metricFormat(k); // its unit from its name: padding_frac in %, eval/runtime in s
      CHARTS[id] = { keys: [k], labels: [k], unit: f.unit, value: f.value, axis: (u, v) => TP.ticks(v, f.axis), smooth: true, extra: true };
      $(id).addEventListener("keydown", keyZoom);
      addExport(id);
    }
  }

  // Exponential moving average, debiased at the start (as TensorBoard does) so the first points
  // do not lean towards zero.
  function ema(vals, a) {
    if (!a) return vals.slice();
    const out = new Array(vals.length); let m = 0, w = 0;
    for (let i = 0; i < vals.length; i++) {
      const v = vals[i];
      if (v === null || !isFinite(v)) { out[i] = null; continue; }
      m = a * m + (1 - a) * v; w = a * w + (1 - a); out[i] = m / w;
    }
    return out;
  }

  function sourceFor(k) {
    const base = series[k];
    if (!detail || !detail.series[k]) return base;
    // Zoomed: the overview outside the range, full detail inside it.
    const d = detail.series[k], step = [], value = [], t = [];
    const take = (s, i) => { step.push(s.step[i]); value.push(s.value[i]); t.push(s.t ? s.t[i] : null); };
    if (base) for (let i = 0; i < base.step.length && base.step[i] < detail.min; i++) take(base, i);
    for (let i = 0; i < d.step.length; i++) take(d, i);
    if (base) for (let i = 0; i < base.step.length; i++) if (base.step[i] > detail.max) take(base, i);
    return { step, value, t };
  }

  function chartData(spec) {
    const cols = stepData(spec);
    const pos = logY() ? (v) => (v !== null && v > 0 ? v : null) : null; // a log axis cannot show 0 or less
    if (pos) for (let c = 1; c < cols.length; c++) cols[c] = cols[c].map(pos);
    if (xMode() !== "time") return cols;
    // Wall clock: the time each step was logged, in time order (a resumed run re-logs steps later).
    const when = new Map();
    for (const k of spec.keys) { const s = sourceFor(k); if (s && s.t) s.step.forEach((x, i) => { if (s.t[i]) when.set(x, s.t[i]); }); }
    const order = cols[0].map((x, i) => i).filter((i) => when.has(cols[0][i])).sort((a, b) => when.get(cols[0][a]) - when.get(cols[0][b]));
    return [order.map((i) => when.get(cols[0][i])), ...cols.slice(1).map((c) => order.map((i) => c[i]))];
  }
  function stepData(spec) {
    const ghosts = spec.ghosts || [];
    const srcs = [...spec.keys.map(spec.sourceOf || sourceFor), ...ghosts.map((g) => earlier[g.attempt][g.key])];
    let xs;
    if (srcs.length === 1 || srcs.slice(1).every((s) => !s)) xs = srcs[0] ? srcs[0].step.slice() : [];
    else {
      const steps = new Set();
      for (const s of srcs) if (s) for (const x of s.step) steps.add(x);
      xs = [...steps].sort((a, b) => a - b);
    }
    const cols = [xs];
    for (const s of srcs) {
      if (!s) { cols.push(xs.map(() => null)); continue; }
      if (s.step.length === xs.length) { cols.push(s.value.slice()); continue; }
      const m = new Map(); s.step.forEach((x, i) => m.set(x, s.value[i]));
      cols.push(xs.map((x) => (m.has(x) ? m.get(x) : null)));
    }
    if (spec.smooth) cols.push(ema(cols[1], Number($("smooth").value))); // last: robust() leaves it out
    return cols;
  }

  // Every chart shows the same x range: the whole run, or the user's zoom. uPlot reports scale
  // changes after the draw (not while we set them), so a change is the user's zoom only when it is
  // not the range we last set ourselves (expectX).
  let syncing = false, expectX = null;
  const sameRange = (a, b) => a && b && Math.abs(a.min - b.min) < 1e-9 * (1 + Math.abs(a.min)) && Math.abs(a.max - b.max) < 1e-9 * (1 + Math.abs(a.max));
  function makeChart(id, spec, data) {
    const box = $(id);
    const time = xMode() === "time";
    const s = [{ label: time ? "time" : "step", value: (u, v) => (v === null || v === undefined ? "–" : time ? new Date(v * 1000).toLocaleTimeString("en-GB") : TP.num(v)) }];
    spec.labels.forEach((l, i) => s.push({ label: l, stroke: (spec.colors || COLORS)[i], width: spec.smooth && i === 0 ? 1 : 1.5, spanGaps: true,
      ...(spec.dash && spec.dash[i] ? { dash: spec.dash[i] } : {}),
      ...(spec.points && spec.points[i] ? { points: { show: true, size: 6 } } : {}),
      ...(spec.smooth && i === 0 ? { stroke: "rgba(37,99,235,0.3)" } : {}), value: (u, v) => spec.value(v) }));
    for (const g of spec.ghosts || []) s.push({ label: g.label, stroke: fade(g.color), width: 1, spanGaps: true, class: "earlier-attempt", value: (u, v) => spec.value(v) });
    if (spec.smooth) s.push({ label: "smoothed", stroke: COLORS[0], width: 2, spanGaps: true, value: (u, v) => spec.value(v) });
    // Not hovering: each legend entry says its latest value (not "–", which reads as missing data).
    for (const x of s) { const f = x.value; x.value = (u, v, si, idx) => f(u, idx == null && (v === null || v === undefined) ? latestOf(u, si) : v, si, idx); }
    const opts = {
      width: Math.max(280, box.clientWidth || 500), height: 220, series: s,
      scales: { x: { time }, y: { distr: logY() ? 3 : 1, range: (u, lo, hi) => yRange(u, lo, hi) } },
      axes: [time ? { label: "wall clock", labelSize: 18, size: 50 } : { label: "step", labelSize: 18, size: 36, incrs: TP.STEP_INCRS, values: (u, v) => TP.ticks(v) },
        { label: spec.unit || "", labelSize: spec.unit ? 18 : 0, size: 64, values: spec.axis }],
      cursor: { drag: { x: true, y: false, setScale: true }, sync: { key: `job${jobId}`, setSeries: false } },
      legend: { live: true },
      hooks: {
        setScale: [(u, key) => {
          if (key !== "x" || syncing || resetting) return;
          const { min, max } = u.scales.x;
          if (min === null || max === null || sameRange({ min, max }, expectX)) return;
          expectX = { min, max };
          syncing = true;
          for (const c of Object.values(charts)) if (c !== u) c.setScale("x", { min, max });
          syncing = false;
          onZoom(min, max, u);
        }],
      },
    };
    const u = new uPlot(opts, data, box);
    u.minSpan = spec.unit === "MiB" ? 0.02 : 0; // memory: the y axis spans at least 2% of the value
    u.keys = chartKeys(spec); u.mode = `${xMode()}|${logY()}`; u.smoothCol = !!spec.smooth;
    u.over.setAttribute("aria-hidden", "true"); // the summary below the chart is its text alternative
    return u;
  }

  function latestOf(u, si) { // the x legend: the step of the current attempt's latest point (column 1)
    const col = u.data && u.data[si === 0 ? 1 : si];
    if (!col) return null;
    for (let i = col.length - 1; i >= 0; i--) if (col[i] !== null && col[i] !== undefined) return si === 0 ? u.data[0][i] : col[i];
    return null;
  }
  function ownSteps(spec) {
    const steps = new Set();
    for (const k of spec.keys) { const src = sourceFor(k); if (src) for (const x of src.step) steps.add(x); }
    return steps.size;
  }
  const chartKeys = (spec) => [...spec.keys, ...(spec.ghosts || []).map((g) => g.label)].join(",");
  const fade = (hex) => `rgba(${parseInt(hex.slice(1, 3), 16)},${parseInt(hex.slice(3, 5), 16)},${parseInt(hex.slice(5, 7), 16)},0.3)`;

  // The y range: uPlot's own, or with "Clip outliers" the 1st..99th percentile of the points
  // (plus a margin), so one spike does not flatten a long curve. The points beyond stay in the data
  // (hover, CSV) and the summary says how many are off the chart.
  function yRange(u, lo, hi) {
    const log = logY();
    if (clipY() && lo !== null && hi !== null) {
      const r = robust(u);
      if (r) { lo = Math.max(lo, r[0]); hi = Math.min(hi, r[1]); }
    }
    if (lo === null || hi === null) return [lo, hi];
    if (u.minSpan && !log && hi - lo < u.minSpan * Math.abs(hi)) { // a 0.03 MiB wobble is not a climb
      const mid = (hi + lo) / 2, half = (u.minSpan * Math.abs(hi)) / 2;
      lo = mid - half; hi = mid + half;
    }
    return log ? uPlot.rangeLog(lo, hi, 10, true) : uPlot.rangeNum(lo, hi, 0.1, true);
  }
  function robust(u) {
    const vals = [];
    const n = u.data.length - (u.smoothCol ? 1 : 0); // the smoothed line carries a spike's tail: raw points only
    for (let c = 1; c < n; c++) for (const v of u.data[c]) if (v !== null && isFinite(v)) vals.push(v);
    if (vals.length < 20) return null;
    vals.sort((a, b) => a - b);
    const q = (p) => vals[Math.min(vals.length - 1, Math.max(0, Math.round(p * (vals.length - 1))))];
    const a = q(0.01), b = q(0.99);
    if (logY()) return [a / 1.5, b * 1.5];
    const pad = (b - a) * 0.25 || Math.abs(b) * 0.05 || 1;
    return [a - pad, b + pad];
  }

  // A text alternative for each chart: what it holds, its range, the latest value, and how much of it
  // is clipped or zoomed away.
  // Where a chart's metrics came from, when the instrumentation read them from the script's own
  // logging calls or printed lines (the job's info metric_sources, worker/agent/printed_metrics.py).
  const SOURCE_WORDS = { api: "tokenpulse.log / Trainer", logger: "its logging call", backward: ".backward()", printed: "printed lines" };
  function sourceNote(id, spec) {
    const info = (job && job.info) || {}, kinds = info.metric_sources || {}, via = info.metric_via || {};
    const from = (k) => via[k] || SOURCE_WORDS[kinds[k]] || kinds[k];
    const text = spec.keys.filter((k) => kinds[k]).map((k) => (spec.keys.length > 1 ? `${k} from ${from(k)}` : `from ${from(k)}`)).join(" · ");
    const head = $(id).closest(".chart-box").querySelector(".chart-head");
    let note = head.querySelector(".source-note");
    if (!text) { if (note) note.remove(); return; }
    if (!note) head.append(note = TP.el("span", { class: "source-note muted small" }));
    if (note.textContent !== text) note.textContent = text;
  }
  function summarize(id, spec, u) {
    const el = $(`${id}-summary`);
    if (!el) return;
    const title = $(`${id}-title`).textContent;
    if (!u) { el.textContent = `${title}: no points yet.`; return; }
    const xs = u.data[0], n = xs.length;
    if (!n) { el.textContent = `${title}: no points yet.`; return; }
    const time = xMode() === "time";
    const fx = (x) => (time ? new Date(x * 1000).toLocaleTimeString("en-GB") : `step ${TP.num(x)}`);
    const parts = [`${title}: ${TP.num(n)} points from ${fx(xs[0])} to ${fx(xs[n - 1])}.`];
    spec.labels.forEach((l, i) => {
      const ys = u.data[i + 1]; let mi = null, ma = null, last = null;
      for (let j = 0; j < ys.length; j++) { const v = ys[j]; if (v === null || !isFinite(v)) continue; last = j; if (mi === null || v < ys[mi]) mi = j; if (ma === null || v > ys[ma]) ma = j; }
      if (last === null) return;
      parts.push(`${l}: latest ${spec.value(ys[last])} (${fx(xs[last])}), lowest ${spec.value(ys[mi])} (${fx(xs[mi])}), highest ${spec.value(ys[ma])} (${fx(xs[ma])}).`);
    });
    const r = clipY() ? robust(u) : null; // (u.scales are updated a moment later, after the draw)
    if (r) {
      let off = 0;
      for (let c = 1; c < u.data.length - (u.smoothCol ? 1 : 0); c++) for (const v of u.data[c]) if (v !== null && (v > r[1] || v < r[0])) off++;
      if (off) parts.push(`${off} point${off === 1 ? " is" : "s are"} outside the clipped y range.`);
    }
    if (zoomed) parts.push(`Zoomed to ${fx(zoomed.min)} – ${fx(zoomed.max)}.`);
    el.textContent = parts.join(" ");
    $(id).dataset.clipped = (parts.find((p) => p.includes("outside the clipped")) || "").split(" ")[0] || "0";
  }

  // A double-click zooms out: uPlot resets every synced chart to its own data range; we then redraw
  // them all from the overview. Caught in the capture phase, before uPlot's own handlers.
  let resetting = false;
  document.addEventListener("dblclick", (e) => {
    if (!e.target.closest || !e.target.closest(".charts .u-over")) return;
    resetting = true;
    setTimeout(() => { resetting = false; resetZoom(); }, 0);
  }, true);
  let zoomed = null; // {min, max} while zoomed
  let zoomTimer = null;
  function onZoom(min, max) {
    const full = fullRange();
    if (!full || (min <= full[0] && max >= full[1])) { zoomed = null; return; }
    zoomed = { min, max };
    if (!Object.keys(downsampledInfo).length) return; // everything is already here at full resolution
    clearTimeout(zoomTimer);
    const steps = stepsIn(min, max);
    if (!steps) return;
    zoomTimer = setTimeout(async () => {
      const lo = Math.floor(steps[0]) - 1, hi = Math.ceil(steps[1]);
      const m = await TP.api(`/api/jobs/${jobId}/metrics?max_points=${MAX_POINTS}&after_step=${lo}&before_step=${hi}`);
      if (!zoomed || zoomed.min !== min || zoomed.max !== max) return;
      detail = { min: lo + 1, max: hi, series: m.series };
      drawCharts(true);
      noteDownsampled(m.series, true);
    }, 120);
  }
  function fullRange() { // in the x axis' units (steps, or seconds on the wall-clock axis)
    const key = xMode() === "time" ? "t" : "step";
    let lo = Infinity, hi = -Infinity;
    const all = [...Object.values(series), ...(key === "step" && showEarlier() ? Object.values(earlier).flatMap(Object.values) : [])];
    for (const s of all) for (const x of s[key] || []) if (x !== null && x !== undefined) { if (x < lo) lo = x; if (x > hi) hi = x; }
    return lo <= hi ? [lo, hi] : null;
  }
  function stepsIn(min, max) { // an x range as a step range (for fetching detail)
    if (xMode() !== "time") return [min, max];
    const s = series.loss || Object.values(series)[0];
    if (!s) return null;
    let lo = Infinity, hi = -Infinity;
    s.t.forEach((t, i) => { if (t >= min && t <= max) { lo = Math.min(lo, s.step[i]); hi = Math.max(hi, s.step[i]); } });
    return lo <= hi ? [lo, hi] : null;
  }
  // Keyboard zoom on a focused chart: + / - zoom around the middle, arrows pan, 0 / Escape / Home reset.
  function keyZoom(e) {
    const id = e.currentTarget.id, u = charts[id];
    if (!u) return;
    const full = fullRange();
    if (!full) return;
    const cur = zoomed || { min: full[0], max: full[1] };
    const w = cur.max - cur.min, mid = (cur.min + cur.max) / 2;
    let min, max;
    if (e.key === "+" || e.key === "=") { min = mid - w / 4; max = mid + w / 4; }
    else if (e.key === "-" || e.key === "_") { min = mid - w; max = mid + w; }
    else if (e.key === "ArrowLeft") { min = cur.min - w / 4; max = cur.max - w / 4; }
    else if (e.key === "ArrowRight") { min = cur.min + w / 4; max = cur.max + w / 4; }
    else if (e.key === "0" || e.key === "Escape" || e.key === "Home") { e.preventDefault(); if (zoomed) resetZoom(); return; }
    else return;
    e.preventDefault();
    if (xMode() === "step" && max - min < 2) { min = mid - 1; max = mid + 1; } // at least a few steps
    if (min < full[0]) { max += full[0] - min; min = full[0]; }
    if (max > full[1]) { min -= max - full[1]; max = full[1]; }
    min = Math.max(min, full[0]);
    if (min <= full[0] && max >= full[1]) { if (zoomed) resetZoom(); return; }
    u.setScale("x", { min, max }); // the setScale hook moves the other charts and fetches detail
  }
  for (const id of Object.keys(CHARTS)) $(id).addEventListener("keydown", keyZoom);
  function resetZoom() {
    zoomed = null; detail = null;
    drawCharts(false);
    noteDownsampled(null);
  }

  // NaN/inf points: null in a series' values (never drawn), named by step in its `nonfinite` map
  // (server/series.py). Said above the charts, so a gap in a line is never a silent one.
  const nonfinite = {}; // metric -> {step: "nan" | "inf" | "-inf"}
  function noteNonfinite(k, words) {
    if (!words) return;
    Object.assign(nonfinite[k] || (nonfinite[k] = {}), words);
    const word = (w) => (w === "nan" ? "NaN" : w);
    const said = Object.entries(nonfinite).map(([name, m]) => {
      const steps = Object.keys(m).map(Number).sort((a, b) => a - b);
      const first = steps.slice(0, 5).map((st) => `${word(m[st])} at step ${st}`).join(", ");
      return `${name} was ${first}${steps.length > 5 ? ` (and ${steps.length - 5} more steps)` : ""}`;
    });
    const note = $("nonfinite-note");
    note.textContent = `Not finite, not drawn: ${said.join("; ")}.`;
    note.hidden = false;
  }
  function noteDownsampled(zoomSeries) {
    const note = $("points-note");
    const src = zoomSeries || downsampledInfo;
    const l = series.loss ? series.loss.step.length : 0;
    const total = downsampledInfo.loss || l;
    if (zoomSeries) { const z = zoomSeries.loss; note.textContent = z ? `Zoomed: ${TP.num(z.step.length)} points${z.downsampled ? ` of ${TP.num(z.total_points)}` : " (full detail)"} in view.` : ""; return; }
    note.textContent = src.loss ? `Loss: showing ${TP.num(l)} of ${TP.num(total)} stored points.` : (l ? `Loss: all ${TP.num(l)} points.` : "");
  }

  let drawPending = false;
  function scheduleDraw() {
    if (drawPending) return; drawPending = true;
    requestAnimationFrame(() => { drawPending = false; drawCharts(true); if (!zoomed) noteDownsampled(null); });
  }
  function drawCharts(keepScale) {
    const full = fullRange();
    const tx = zoomed && keepScale ? zoomed : full && full[1] > full[0] ? { min: full[0], max: full[1] } : null;
    expectX = tx;
    addExtraCharts();
    for (const [id, full] of Object.entries(CHARTS)) {
      const spec = activeSpec(full);
      const box = $(id);
      // A new series (or a new axis mode) rebuilds the chart: uPlot's series and scales are fixed at creation.
      if (charts[id] && (charts[id].keys !== chartKeys(spec) || charts[id].mode !== `${xMode()}|${logY()}`)) { charts[id].destroy(); delete charts[id]; }
      // A chart with nothing to show: "No points yet" while they may still come; hidden while a job
      // waits, for a command job (it logs what it logs) and once a job is over, except Loss and
      // Throughput of a job that ran, which say why they are empty.
      const queued = job && job.state === "queued";
      const idle = job && (queued || job.kind !== "train" || TP.FINAL.includes(job.state)) && !(EMPTY_WHY[id] && !queued);
      // "Your panel" keeps its picker while there is any metric to pick
      box.closest(".chart-box").hidden = id === "chart-custom" ? !$("panel-add").options.length || $("panel-add").options.length + spec.keys.length < 2 : !spec.keys.length && !!idle;
      sourceNote(id, spec);
      if (!spec.keys.length) { box.dataset.points = 0; emptyNote(box, id); summarize(id, spec, null); continue; }
      const data = chartData(spec);
      box.dataset.points = spec.ghosts.length ? ownSteps(spec) : data[0].length; // the current attempt's
      box.dataset.series = spec.labels.join(",");
      if (!charts[id]) { box.replaceChildren(); syncing = true; try { charts[id] = makeChart(id, spec, data); if (tx) charts[id].setScale("x", tx); } finally { syncing = false; } summarize(id, spec, charts[id]); continue; }
      // Data updates never count as a user's zoom: only a drag (or a double-click, or a key) does.
      syncing = true;
      try {
        if (zoomed && keepScale) { charts[id].setData(data, false); charts[id].setScale("x", zoomed); }
        else { charts[id].setData(data, true); if (tx) charts[id].setScale("x", tx); }
      } finally { syncing = false; }
      summarize(id, spec, charts[id]);
    }
    const anyChart = [...document.querySelectorAll(".chart-box")].some((b) => !b.hidden);
    for (const el of document.querySelectorAll(".chart-tools, .chart-hint")) el.hidden = !anyChart;
    if (!firstChartMarked && charts["chart-loss"] && series.loss && series.loss.step.length) {
      firstChartMarked = true;
      performance.mark("tp:first-chart");
      document.body.dataset.firstChart = "1";
    }
  }
  function emptyNote(box, id) {
    const text = EMPTY_WHY[id] ? EMPTY_WHY[id]() : "No points yet.";
    const p = box.querySelector("p.empty");
    if (p && box.childElementCount === 1) { if (p.textContent !== text) p.textContent = text; return; }
    box.replaceChildren(TP.el("p", { class: "muted empty", text }));
  }
  // Why the Loss or Throughput card is empty: not reported yet (a command job's metrics
  // come from its own logging: where tokenpulse looks), or never reported by a job that is over.
  const LOSS_FROM = "tokenpulse reads it from tokenpulse.log or a Trainer, the script's wandb, TensorBoard, MLflow or Lightning logging, the loss it calls .backward() on, or printed lines such as “loss 2.31”.";
  const TPS_FROM = "tokenpulse counts tokens per second from the token batches (input_ids) the model is called with, or takes the tokens_per_s the script logs.";
  function emptyWhy(what, from, warmup) {
    const st = job ? job.state : null, own = !job || job.kind === "train";
    if (st && TP.FINAL.includes(st)) return `This job reported no ${what}.${own ? "" : ` ${from}`}`;
    if (st === "paused") return `No ${what} before the pause: it comes after the job resumes.${own ? "" : ` ${from}`}`;
    return own ? `No ${what} yet: ${warmup}` : `No ${what} reported yet. ${from}`;
  }
  const EMPTY_WHY = {
    "chart-loss": () => emptyWhy("loss", LOSS_FROM, "the first point comes with the first logged step."),
    "chart-tps": () => emptyWhy("throughput", TPS_FROM, "it is measured once the first warm-up steps are done."),
  };

  // Points arrive from two sources (websocket frames, REST refills) in any order: keep each series
  // sorted by step with every step once. The common case (newer than all) is a plain push.
  function mergePoints(k, steps, values, ts) {
    const s = series[k] || (series[k] = { step: [], value: [], t: [] });
    const n = s.step.length;
    if (!steps.length) return;
    const tt = (i) => (ts ? ts[i] : null);
    if (!n || steps[0] > s.step[n - 1]) { for (let i = 0; i < steps.length; i++) { s.step.push(steps[i]); s.value.push(values[i]); s.t.push(tt(i)); } }
    else {
      const st = [], va = [], ti = []; let i = 0, j = 0;
      while (i < n || j < steps.length) {
        if (j >= steps.length || (i < n && s.step[i] < steps[j])) { st.push(s.step[i]); va.push(s.value[i]); ti.push(s.t[i]); i++; }
        else if (i >= n || steps[j] < s.step[i]) { st.push(steps[j]); va.push(values[j]); ti.push(tt(j)); j++; }
        else { st.push(s.step[i]); va.push(s.value[i]); ti.push(s.t[i]); i++; j++; } // same step: keep one
      }
      s.step = st; s.value = va; s.t = ti;
    }
    lastStep = Math.max(lastStep, s.step[s.step.length - 1]);
  }
  function addPoint(step, values, t) {
    for (const [k, v] of Object.entries(values)) {
      if (typeof v === "string") { noteNonfinite(k, { [step]: v }); mergePoints(k, [step], [null], [t]); } // NaN/inf: its word
      else mergePoints(k, [step], [v], [t]);
    }
  }

  // ---- summary ----------------------------------------------------------------------------------
  // Who is looking: everyone reads every job, but only its owner (or an admin) changes its course,
  // and starting a command job's command again needs the commands right. Controls that the server
  // would refuse are not shown (hidden until we know).
  let me = null;
  TP.api("/api/tokens/me").then((m) => { me = m; document.body.dataset.viewer = m.role; if (job) showSummary({}); }).catch(() => {});
  const mayControl = () => !!me && (me.role === "admin" || (job.owner != null && job.owner === me.principal));
  const mayRerun = () => mayControl() && (job.kind !== "command" || me.may_run_commands);

  function showSummary(j) {
    const before = job && job.state;
    job = { ...(job || {}), ...j, last: { ...((job || {}).last || {}), ...(j.last || {}) } }; // a frame carries the listed metrics only
    if (before !== job.state) scheduleDraw(); // empty charts fold away or say why by the job's state
    if (job.state === "queued" && !queueTimer) explainQueue(); else if (job.state !== "queued") { clearTimeout(queueTimer); queueTimer = null; queueText = null; }
    $("job-name").textContent = job.name || `Job ${jobId}`;
    document.title = `${job.name || "Job " + jobId} (${job.state}) · tokenpulse`;
    const st = $("job-state"); st.textContent = job.state; st.className = `badge ${job.state}`;
    const active = TP.ACTIVE.includes(job.state);
    const final = TP.FINAL.includes(job.state);
    const req = job.requested_action;
    const cancelling = req === "cancel";
    const mine = mayControl();
    $("cancel").hidden = !(active || ["queued", "paused"].includes(job.state)) || cancelling || !mine;
    if ($("cancel").hidden) $("cancel-confirm-box").hidden = true;
    // A stack dump is a look, not a change of course: it never hides Pause. A command job pauses
    // only when its instrumentation said it can (a Trainer script).
    $("pause").hidden = !mine || !active || req === "pause" || req === "cancel" ||
      (job.kind === "command" && !(job.info && job.info.pausable));
    $("resume").hidden = job.state !== "paused" || !mayRerun();
    $("stack").hidden = !active || !mine;
    $("stack").disabled = !!job.stack_requested;
    if (job.stack_requested && active) watchStack();
    $("retry").hidden = !final || !mayRerun();
    $("retry").textContent = job.state === "completed" ? "Run again" : "Retry";
    if (job.parent_id) $("parent").replaceChildren("cloned from ", TP.el("a", { href: `/jobs/${job.parent_id}`, text: `#${job.parent_id}` }));
    showPhase(job.phase);
    showNumbers(job.last || {});
    const r = $("reason");
    const why = !active ? job.reason
      : req ? `${req} requested; waiting for the worker…`
        : job.stack_requested ? "stack dump requested; it appears in the log below when the worker has taken it…"
          : job.reason;
    r.hidden = !why;
    // The root cause first, in words; what kind of failure and the exit code after it; a traceback
    // or the last output once, in monospace (the Attempts table links here).
    const { head, rest } = TP.reasonParts(why);
    const facts = [job.failure ? `failure: ${job.failure}` : "", job.exit_code !== null && job.exit_code !== undefined ? `exit code ${job.exit_code}` : ""].filter(Boolean);
    r.replaceChildren(...(why ? [TP.el("strong", { class: "reason-head", text: head }),
      facts.length ? TP.el("span", { class: "muted", text: ` (${facts.join(", ")})` }) : "",
      rest ? TP.el("pre", { id: "traceback", class: "traceback", text: rest }) : ""] : []));
    r.className = `reason ${job.state}`;
    const aid = job.agent_id || lastAgent;
    const ag = agents.get(aid);
    $("worker").replaceChildren(aid ? TP.el("a", { href: "/workers", text: ag ? `${ag.name} (${ag.host})` : `agent ${aid}`, title: ag ? ag.device : "" }) : "–");
    showHeartbeat();
    showOutput();
  }

  // Live speed figures are smoothed: an exponential moving average over the recent logged points
  // (debiased), so one slow or fast step does not swing tokens/s or the ETA.
  const SMOOTH_N = 30, SMOOTH_A = 0.85;
  function smoothed(k, fallback) {
    const s = series[k];
    if (!s || !s.value.length) return fallback;
    let m = 0, w = 0;
    for (let i = Math.max(0, s.value.length - SMOOTH_N); i < s.value.length; i++) {
      const v = s.value[i];
      if (v === null || !isFinite(v)) continue;
      m = SMOOTH_A * m + (1 - SMOOTH_A) * v; w = SMOOTH_A * w + (1 - SMOOTH_A);
    }
    return w ? m / w : fallback;
  }
  // the furthest step anyone reported: a checkpoint may be a step past the last metric, and the
  // training phase's count runs ahead of metrics logged every few steps (one count on the page)
  function stepNow(last) {
    const done = job.phase && job.phase.name === "training" ? job.phase.done : undefined;
    const known = [last.step, job.step, done].filter((x) => x !== null && x !== undefined && isFinite(x));
    return known.length ? Math.max(...known) : undefined;
  }
  function showNumbers(last) {
    const step = stepNow(last);
    const active = job && TP.ACTIVE.includes(job.state);
    $("step").textContent = step !== null && step !== undefined ? `${TP.num(step)}${job.total_steps ? " / " + TP.num(job.total_steps) : ""}` : "–";
    $("loss").textContent = TP.sig(last.loss);
    const ev = last["eval/loss"]; // the latest (at the end: the final) evaluation
    $("eval-box").hidden = ev === undefined;
    if (ev !== undefined) $("eval-loss").textContent = `${TP.sig(ev)}${last["eval/ppl"] !== undefined ? ` (ppl ${TP.sig(last["eval/ppl"], 3)})` : ""}`;
    $("lr").textContent = last.lr !== undefined ? small(last.lr) : "–";
    $("lr").title = last.lr !== undefined ? String(last.lr) : "";
    const tps = smoothed("tokens_per_s", last.tokens_per_s);
    const raw = [];
    if (last.tokens_per_s !== undefined) raw.push(`latest: ${TP.compact(last.tokens_per_s, "tok/s")}`);
    if (last.padded_tokens_per_s !== undefined) raw.push(`padded: ${TP.compact(smoothed("padded_tokens_per_s", last.padded_tokens_per_s), "tok/s")}`);
    const stale = active ? staleness() : null;
    setFigure("tps", tps !== undefined ? TP.compact(tps, "tok/s") : "–", `smoothed over the recent steps; ${raw.join(", ")}`, stale);
    let eta;
    const st = smoothed("step_time_s");
    if (active && job.total_steps && st !== undefined && step !== null && step !== undefined) eta = Math.max(0, job.total_steps - step) * st;
    else if (active) eta = smoothed("eta_s", last.eta_s);
    setFigure("eta", active && eta !== undefined ? TP.dur(eta) : "–",
      active && last.eta_s !== undefined ? `remaining steps × smoothed step time; latest raw estimate: ${TP.dur(last.eta_s)}` : "", stale);
    showMfu(last, stale);
  }
  // A figure with its tooltip; while progress has stopped it is marked stale (greyed, a "stale" tag
  // saying why), since it still shows the last healthy value.
  function setFigure(id, text, title, stale) {
    const el = $(id);
    const tag = stale && text !== "–" ? TP.el("span", { class: "stale-tag", text: "stale", title: stale }) : "";
    el.replaceChildren(text, tag ? " " : "", tag);
    el.classList.toggle("stale", !!tag);
    el.title = tag ? `stale: ${stale}. Last value while progressing; ${title}` : title;
  }
  // MFU against a peak measured on this device at the job's start. On a CPU that peak is taken
  // while other processes may share the cores, so the ratio is only a rough figure: say so.
  function showMfu(last, stale) {
    const v = smoothed("mfu", last.mfu);
    const dev = String((job && job.info && job.info.device) || "");
    const cpu = dev.startsWith("cpu");
    const peak = job && job.info && job.info.peak_flops;
    const base = peak ? `achieved FLOP/s over a peak of ${TP.sig(peak / 1e12, 3)} TFLOP/s measured at start` : "achieved FLOP/s over the measured peak";
    // Above 100 % the peak it is measured against was wrong (taken while the machine was busy): no
    // utilisation can be given, so none is shown, and the figure says why.
    const seen = series.mfu ? series.mfu.value.reduce((m, x) => (x !== null && isFinite(x) && x > m ? x : m), v || 0) : v;
    if (v !== undefined && (v > 1 || seen > 1)) {
      setFigure("mfu", "unknown", "", null);
      const why = `The achieved FLOP/s (up to ${TP.num(100 * seen, 0)} % of it) exceed the peak of ${peak ? TP.sig(peak / 1e12, 3) + " TFLOP/s" : "FLOP/s"} measured at the job's start: that peak was measured while the machine was busy, so it is too low and no utilisation can be given.`;
      $("mfu").title = why;
      $("mfu").append(" ", TP.el("span", { class: "caveat", id: "mfu-why", text: "peak measured too low", title: why }));
      return;
    }
    const text = v === undefined ? "–" : `${TP.num(100 * v, v < 0.1 ? 1 : 0)} %`;
    setFigure("mfu", text, cpu ? `${base}. On a CPU the peak is measured with a short matmul while other processes may share the cores, so this ratio is rough and can read far too high or low.` : base, stale);
    if (cpu && v !== undefined) $("mfu").append(" ", TP.el("span", { class: "caveat", text: "rough on CPU", title: $("mfu").title }));
  }
  const openStalls = new Map(); // alert id -> message, while a stall alert is not cleared
  function staleness() {
    if (!job || !TP.ACTIVE.includes(job.state)) return null;
    if (openStalls.size) return [...openStalls.values()][0];
    const listed = TP.stallOf(jobId); // the jobs list's rule: an open stall alert
    if (listed) return listed;
    if (!lastProgress || !(series.tokens_per_s || series.eta_s)) return null;
    const age = Date.now() / 1000 - lastProgress;
    const limit = Math.max(30, 10 * (smoothed("step_time_s") || 0));
    return age > limit ? `no progress for ${TP.dur(age)}` : null;
  }

  function showHeartbeat() {
    const hb = $("heartbeat");
    const active = TP.ACTIVE.includes(job.state);
    if (active) hb.replaceChildren(TP.rel(job.alive_at, { hb: true, none: "none yet" }));
    else hb.replaceChildren(job.alive_at ? TP.rel(job.alive_at) : "–", job.alive_at ? TP.el("span", { class: "muted", text: ` (${job.state})` }) : "");
    const el = $("elapsed");
    $("elapsed-label").textContent = active ? "Running for" : job.state === "queued" ? "Queued for" : job.started_at ? "Ran for" : "Running for";
    if (job.started_at) {
      const end = job.finished_at || (active ? null : job.alive_at) || Date.now() / 1000;
      el.textContent = TP.dur((job.finished_at || (active ? Date.now() / 1000 : end)) - job.started_at);
      el.title = `started ${TP.abs(job.started_at)}${job.finished_at ? `, ended ${TP.abs(job.finished_at)}` : ""}`;
    } else if (job.state === "queued") { el.textContent = TP.dur(Date.now() / 1000 - job.created_at); el.title = `submitted ${TP.abs(job.created_at)}`; }
    else { el.textContent = "–"; el.title = `submitted ${TP.abs(job.created_at)}`; }
  }

  // A queued job says what it waits for: its place in the queue (the claim's order: priority, then
  // age), the jobs ahead of it, and what the workers are busy with. Asked again while it waits.
  let queueTimer = null, queueText = null;
  async function explainQueue() {
    clearTimeout(queueTimer);
    if (!job || job.state !== "queued") { queueText = null; return; }
    try {
      const [q, busy, ags] = await Promise.all([TP.api("/api/jobs?state=queued&limit=1000"),
        TP.api("/api/jobs?state=running&state=starting&limit=100"), TP.api("/api/agents")]);
      if (!job || job.state !== "queued") return;
      agents = new Map(ags.map((a) => [a.id, a]));
      const order = q.jobs.sort((a, b) => b.priority - a.priority || a.id - b.id);
      const at = order.findIndex((x) => x.id === jobId);
      const ahead = at > 0 ? order.slice(0, at) : [];
      const online = ags.filter((a) => a.state === "online");
      const parts = [`#${at >= 0 ? at + 1 : "?"} in the queue`];
      if (ahead.length) parts.push(`behind ${ahead.slice(0, 3).map((x) => `#${x.id} ${x.name}`).join(", ")}${ahead.length > 3 ? ` and ${ahead.length - 3} more` : ""}`);
      const working = new Set(busy.jobs.map((x) => x.agent_id));
      const idle = online.filter((a) => !working.has(a.id));
      if (!online.length) parts.push("no worker is online (start one: tokenpulse agent, or tokenpulse up)");
      else if (idle.length) parts.push(`idle worker${idle.length === 1 ? "" : "s"}: ${idle.map((a) => a.name).slice(0, 3).join(", ")}${idle.length > 3 ? " and others" : ""}; a claim should come within seconds`);
      else if (busy.jobs.length) {
        const b = busy.jobs.sort((x, y) => (x.last && x.last.eta_s || 1e12) - (y.last && y.last.eta_s || 1e12))[0]; // the first to finish
        const ag = agents.get(b.agent_id);
        const eta = b.last && b.last.eta_s !== undefined ? `, about ${TP.dur(b.last.eta_s)} left` : "";
        parts.push(`${online.length === 1 ? "the worker is" : `all ${online.length} workers are`} busy; the first to finish: ${ag ? ag.name : "a worker"} runs #${b.id} ${b.name}${b.step ? ` (step ${TP.num(b.step)}${b.total_steps ? "/" + TP.num(b.total_steps) : ""}${eta})` : ""}`);
      } else parts.push(`${online.length} worker${online.length === 1 ? "" : "s"} online; it should start in a moment`);
      queueText = `waiting: ${parts.join("; ")}`;
      showPhase(job.phase);
    } catch (e) { /* asked again below */ }
    queueTimer = setTimeout(explainQueue, 5000);
  }

  // While a job runs the phase line is the training process's own ("tokenizing 800/1,500
  // examples"); once it stops, it says how the job ended and where, never a stale live phase.
  function showPhase(p) {
    const st = job && job.state;
    const ended = st && (TP.FINAL.includes(st) || st === "paused");
    $("phase-text").textContent = st === "queued" ? queueText || (job.attempt ? `waiting for a worker (retry ${job.attempt})` : "waiting for a worker") : ended ? endText(p) : TP.phaseText(p);
    const bar = $("phase-progress");
    if (p && p.total && !ended && st !== "queued") { bar.hidden = false; bar.value = Math.min(1, (p.done || 0) / p.total); bar.title = `${Math.round(100 * bar.value)} %`; } else bar.hidden = true;
  }
  function endText(p) {
    const step = job.step, total = job.total_steps;
    const steps = step !== null && step !== undefined ? `${TP.num(step)}${total && total !== step ? "/" + TP.num(total) : ""}` : null;
    if (job.state === "completed") return `completed${steps ? ` · ${steps} steps` : ""}${job.output_dir ? " · final model saved" : ""}`;
    if (job.state === "paused") return `paused${steps ? ` at step ${steps}` : ""} · checkpoint saved; Resume continues from it`;
    const where = p && p.name && !["training", "saving"].includes(p.name) ? ` during ${p.name}` : "";
    return `${job.state}${where}${steps ? ` at step ${steps}` : ""}`;
  }

  // ---- alerts -----------------------------------------------------------------------------------
  function showAlert(a) {
    // Open and acknowledged alerts stay in view; cleared ones fold into one line below them.
    const box = a.state === "cleared" ? $("alerts-old-list") : $("alerts-live");
    let div = $("alerts").querySelector(`[data-alert="${a.id}"]`);
    if (!div) div = TP.el("div", { "data-alert": a.id, role: a.state === "open" ? "alert" : null });
    if (div.parentNode !== box) {
      const newer = [...box.children].find((x) => Number(x.dataset.alert) < a.id);
      box.insertBefore(div, newer || null);
    }
    const n = $("alerts-old-list").children.length;
    $("alerts-old").hidden = n === 0;
    $("alerts-old-summary").textContent = `${n} cleared alert${n === 1 ? "" : "s"}`;
    div.className = `alert ${a.severity} ${a.state}`;
    if (a.kind === "stalled" && a.state !== "cleared") openStalls.set(a.id, a.message); else openStalls.delete(a.id);
    if (job) showNumbers(job.last || {});
    // The first line is the headline a person reads at a glance; the arithmetic and frames fold under it.
    const [headline, ...more] = (a.message || "").split("\n");
    // A verdict's fix (a line "Fix: ...", worker/agent/advice.py) stays in view under the headline.
    const fixes = more.filter((l) => l.startsWith("Fix: "));
    const rest = more.filter((l) => !l.startsWith("Fix: ")).join("\n").trim();
    const ack = a.state === "open" ? TP.el("button", { type: "button", class: "small ghost", text: "Acknowledge", onclick: async (e) => {
      e.target.disabled = true;
      try { showAlert(await TP.api(`/api/alerts/${a.id}/ack`, { method: "POST" })); } catch (err) { e.target.disabled = false; $("action-error").textContent = err.message; }
    } }) : null;
    div.replaceChildren(
      TP.el("div", { class: "alert-head" },
        TP.el("span", { class: `sev ${a.severity}`, text: a.severity }), TP.el("strong", { text: ` ${a.kind}` }),
        TP.el("span", { class: "muted", text: ` · ${a.state}` }), " · ", TP.rel(a.updated_at || a.created_at), TP.el("span", { class: "spacer" }), ack),
      TP.el("div", { class: "alert-msg alert-headline" }, TP.headline(headline, a)),
      ...fixes.map((f) => TP.el("div", { class: "alert-msg alert-fix", text: f })),
      ...fixRows(a),
      rest ? TP.el("details", { class: "alert-more" }, TP.el("summary", { text: "Details" }), TP.el("div", { class: "alert-msg", text: rest })) : "",
      a.stack ? TP.el("details", {}, TP.el("summary", { text: `Stack dump (${a.stack.split("\n").length} lines; your code marked)` }), stackPre(a.stack)) : "");
  }
  // ---- fixes: a verdict's change applied (server/fixes.py), and what it did -----------------------
  const FIXABLE = ["queued", "starting", "running", "paused"];
  function fixRows(a) {
    const list = (a.data && a.data.fixes) || [];
    if (a.state === "cleared" || !list.length) return [];
    return list.map((f, i) => {
      const where = f.resume === "fresh" ? `restarts from step 0: ${f.why_fresh || "the checkpoint does not fit the change"}` : "resumes from a checkpoint saved now";
      const diff = Object.entries(f.changes || {}).map(([k, v]) => `${k} ${JSON.stringify(v[0])} → ${JSON.stringify(v[1])}`).join(", ");
      const apply = async () => {
        btn.disabled = true; btn.hidden = false; confirm.hidden = true; $("action-error").textContent = "";
        try {
          await TP.api(`/api/jobs/${jobId}/fix`, { method: "POST", body: { alert_id: a.id, n: i + 1 } });
          btn.textContent = "Applying…"; refreshChanges();
        } catch (err) { btn.disabled = false; $("action-error").textContent = err.message; }
      };
      // A fix that starts again from step 0 throws the run's progress away: asked first, saying what is lost.
      const confirm = TP.el("span", { class: "confirm fix-confirm", hidden: true });
      const btn = TP.el("button", { type: "button", class: "small apply-fix", text: "Apply fix", "data-fix": f.kind,
        title: "Save a checkpoint now, stop, and relaunch this job with the change", onclick: () => {
          const done = job ? stepNow(job.last || {}) : 0;
          if (f.resume !== "fresh" || !done) { apply(); return; }
          const ran = job.started_at ? ` and ${TP.dur(Date.now() / 1000 - job.started_at)} of training` : "";
          confirm.replaceChildren(`Restart from step 0? The ${TP.num(done)} steps done${ran} are run again. `,
            TP.el("button", { type: "button", class: "small danger fix-confirm-yes", text: "Restart with the fix", onclick: apply }), " ",
            TP.el("button", { type: "button", class: "small ghost fix-confirm-no", text: "Keep running",
              onclick: () => { confirm.hidden = true; btn.hidden = false; btn.focus(); } }));
          confirm.hidden = false; btn.hidden = true; confirm.querySelector(".fix-confirm-yes").focus();
        } });
      btn.hidden = !(job && FIXABLE.includes(job.state));
      return TP.el("div", { class: "fix-row" }, btn, confirm, " ",
        TP.el("strong", { text: f.title || f.kind }), TP.el("span", { class: "muted", text: ` · ${diff}` }),
        f.argv ? TP.el("pre", { class: "fix-argv", text: `- ${f.argv[0].join(" ")}\n+ ${f.argv[1].join(" ")}` }) : "",
        TP.el("div", { class: "fix-effect", text: `${f.effect || ""}${f.effect ? "; " : ""}${where}` }));
    });
  }
  const FMT = {
    tokens_per_s: (x) => `${Math.round(x).toLocaleString()}`, step_time_s: (x) => `${x.toPrecision(3)} s`,
    mem: (x) => `${Math.round(x).toLocaleString()} MiB`, loss: (x) => x.toPrecision(4), eta_s: (x) => TP.dur(x),
  };
  function cmpRows(c) {
    const b = c.before || {}, a = c.after || {};
    const mem = (x) => x.cuda_peak_mb || x.rss_mb;
    const eq = c.loss_equal_steps;
    // what got faster: tokens/s, a step's time and the real tokens it carries (packing: more tokens
    // in the same time, so fewer steps to an epoch), the epoch's time; the ETA counts the steps left
    const per = c.tokens_per_step || {}, epoch = c.epoch_s || {};
    const rows = [
      ["Real tokens/s", b.tokens_per_s, a.tokens_per_s, FMT.tokens_per_s],
      ["Step time", b.step_time_s, a.step_time_s, FMT.step_time_s],
      ["Real tokens per step", per.before, per.after, FMT.tokens_per_s],
      ["An epoch", epoch.before, epoch.after, FMT.eta_s],
      ["Memory", mem(b), mem(a), FMT.mem],
      [eq ? `Loss at equal steps (${eq.steps})` : "Loss (last steps)", eq ? eq.before : b.loss, eq ? eq.after : a.loss, FMT.loss],
      ["ETA (steps left × step time)", b.eta_s, a.eta_s, FMT.eta_s],
    ].filter(([name, x, y]) => !(name === "An epoch" && x == null && y == null));
    return rows.map(([name, x, y, f]) => TP.el("tr", {}, TP.el("th", { text: name }),
      TP.el("td", { class: "r", text: x == null ? "–" : f(x) }), TP.el("td", { class: "r", text: y == null ? "–" : f(y) })));
  }
  let changesTimer = null;
  async function refreshChanges() {
    let list;
    try { list = await TP.api(`/api/jobs/${jobId}/changes`); } catch (e) { return; }
    $("changes").hidden = !list.length;
    const undone = new Set(list.map((c) => c.reverts).filter((x) => x));
    const newest = [...list].reverse().find((c) => c.state === "applied" && c.kind !== "revert" && !undone.has(c.id));
    $("changes-list").replaceChildren(...[...list].reverse().map((c) => {
      const cmp = c.comparison || {};
      const verdict = cmp.verdict || cmp.waiting || (c.state === "pending" ? "waiting for the checkpoint…" : c.state);
      const cls = cmp.verdict ? (cmp.verdict.startsWith("verified") ? "good" : cmp.verdict.startsWith("no better") ? "bad" : "") : "pending";
      const diff = Object.entries(c.changes || {}).map(([k, v]) => `${k} ${JSON.stringify(v[0])} → ${JSON.stringify(v[1])}`).join(", ");
      const revert = c === newest && job && FIXABLE.includes(job.state) ? TP.el("button", { type: "button", class: "small ghost revert-fix", text: "Revert",
        title: "Undo this change: checkpoint, stop, relaunch with the settings before it", onclick: async (e) => {
          e.target.disabled = true;
          try { await TP.api(`/api/jobs/${jobId}/fix`, { method: "POST", body: { revert: true } }); refreshChanges(); }
          catch (err) { e.target.disabled = false; $("action-error").textContent = err.message; }
        } }) : "";
      const when = c.resume === "fresh" ? "from step 0" : `from step ${c.resume_step ?? "?"}`;
      return TP.el("div", { class: "change", "data-change": c.id },
        TP.el("div", { class: "change-head" }, TP.el("strong", { text: `#${c.id} ${c.title || c.kind}` }),
          TP.el("span", { class: "muted", text: ` · ${diff} · attempt ${c.from_attempt ?? "?"} → ${c.to_attempt ?? "?"} (${when}) · by ${c.by_name || (c.by != null ? `token ${c.by}` : "?")} · ` }),
          TP.rel(c.applied_at || c.created_at), TP.el("span", { class: "spacer" }), revert),
        cmp.before ? TP.el("table", { class: "small before-after" },
          TP.el("thead", {}, TP.el("tr", {}, TP.el("th", {}), TP.el("th", { class: "r", text: `Before (attempt ${c.from_attempt ?? "?"})` }),
            TP.el("th", { class: "r", text: `After (attempt ${c.to_attempt ?? "?"}, warm-up excluded)` }))),
          TP.el("tbody", {}, ...cmpRows(cmp))) : "",
        TP.el("div", { class: `change-verdict ${cls}`, text: verdict }));
    }));
    clearTimeout(changesTimer);
    if (list.some((c) => c.state === "pending" || (c.state === "applied" && !(c.comparison || {}).verdict))) changesTimer = setTimeout(refreshChanges, 3000);
  }

  // A stack with the user's own frames marked apart from library frames (site-packages, the standard
  // library, torch): the same rule as worker/agent/headline.py.
  const LIBRARY = /site-packages\/|dist-packages\/|\/lib\/python3|\/torch\/|<frozen |\/usr\/lib\/python|tokenpulse\/instrument\//;
  const FRAME = /^\s*(\S.*? \([^()]+:\d+\)|File "[^"]+", line \d+ in .+)\s*$/;
  function stackPre(stack) {
    const pre = TP.el("pre", { class: "stack" });
    for (const line of stack.split("\n")) {
      const cls = FRAME.test(line) ? (LIBRARY.test(line) ? "frame-lib" : "frame-own") : null;
      pre.append(cls ? TP.el("span", { class: cls, title: cls === "frame-own" ? "your code" : "library", text: line + "\n" }) : line + "\n");
    }
    return pre;
  }

  // ---- log --------------------------------------------------------------------------------------
  function appendLog(e) {
    const log = $("log");
    const follow = $("follow").checked;
    const line = TP.el("span", { class: `line ${e.data.stream || "stdout"}`, title: TP.abs(e.t), text: TP.stripControl(e.data.line) + "\n" });
    log.append(line);
    while (log.childNodes.length > 2000) log.removeChild(log.firstChild);
    if (follow) log.scrollTop = log.scrollHeight;
    lastLogSeq = Math.max(lastLogSeq, e.seq);
  }

  // ---- choices, checkpoints, attempts -----------------------------------------------------------
  function fmtVal(k, v) {
    if (v === null || v === undefined) return "–";
    if (typeof v === "number") {
      if (/frac/.test(k)) return `${TP.num(100 * v, 2)} %`;
      if (/params/.test(k)) return `${TP.compact(v)} parameters`;
      if (/tokens_per_batch|max_seq_length|row_len/.test(k)) return `${TP.num(v)} tokens`;
      if (k === "batch_size") return `${TP.num(v)} rows`;
      if (/_s$/.test(k)) return `${TP.sig(v, 3)} s`;
      if (k === "pid" || k === "port") return String(v); // an identity, never rounded
      if (Number.isInteger(v) && Math.abs(v) < 1e7) return TP.num(v); // counts exactly (1,500 examples)
      return TP.sig(v);
    }
    if (typeof v === "object") return JSON.stringify(v);
    return String(v);
  }
  function showInfo() {
    const box = $("info");
    if (!infoEvents.length) {
      const info = (job && job.info) || {};
      if (!Object.keys(info).length) return;
      infoEvents.push({ t: null, data: info });
    }
    const rows = [];
    for (const ev of infoEvents) {
      const { reason, measured, eval_generations, eval_step, metric_sources, metric_via, ...rest } = ev.data; // generations have their own panel; sources are by their charts
      if (!Object.keys(rest).length) continue;
      const main = Object.entries(rest).map(([k, v]) => `${k.replaceAll("_", " ")}: ${fmtVal(k, v)}`).join(" · ");
      rows.push(TP.el("li", {}, TP.el("span", { class: "choice", text: main }),
        reason ? TP.el("span", { class: "why", text: ` — ${reason}` }) : "",
        measured ? TP.el("details", {}, TP.el("summary", { text: "measurements" }), TP.el("pre", { text: JSON.stringify(measured, null, 1) })) : ""));
    }
    box.replaceChildren(TP.el("ul", { class: "choices" }, ...rows));
    showGenerations();
  }
  // The eval prompts' greedy generations as a prompt x step table, newest eval first, full width
  // under the charts (beside the eval curve, not 2,800 px down a side column). Each cell shows where
  // the prompt ends and the continuation begins, also when the continuation starts with a newline.
  function showGenerations() {
    const evs = infoEvents.filter((e) => Array.isArray(e.data.eval_generations)).slice(-5).reverse();
    const box = $("generations");
    box.hidden = !evs.length;
    if (!evs.length) return;
    const prompts = [];
    for (const e of evs) for (const g of e.data.eval_generations) if (!prompts.includes(g.prompt)) prompts.push(g.prompt);
    const cell = (prompt, out) => {
      if (out === undefined) return TP.el("td", { class: "muted", text: "–" });
      const nl = /^\r?\n/.test(out || "");
      return TP.el("td", { class: "gen" }, TP.el("span", { class: "gen-prompt", text: prompt }),
        nl ? TP.el("span", { class: "gen-nl", title: "the continuation starts on a new line", text: "⏎" }) : "",
        TP.el("span", { class: "gen-out", text: out ? out : " (nothing)" }));
    };
    $("generations-list").replaceChildren(TP.el("table", { class: "small gen-table" },
      TP.el("thead", {}, TP.el("tr", {}, TP.el("th", { text: "Prompt" }), ...evs.map((e) => TP.el("th", { text: `step ${TP.num(e.data.eval_step)}` })))),
      TP.el("tbody", {}, ...prompts.map((p) => TP.el("tr", {}, TP.el("th", { scope: "row", class: "gen-prompt-head", text: p }),
        ...evs.map((e) => { const g = e.data.eval_generations.find((x) => x.prompt === p); return cell(p, g ? g.output || "" : undefined); }))))));
  }
  // A command job: what runs where, with which settings; secrets by name only (the server never has them).
  function showCommand(s) {
    const quote = (a) => (/^[\w@%+=:,./-]+$/.test(a) ? a : `'${a.replaceAll("'", `'"'"'`)}'`);
    const row = (k, ...v) => [TP.el("dt", { text: k }), TP.el("dd", {}, ...v)];
    const env = Object.entries(s.env || {});
    $("command-info").replaceChildren(
      ...row("Command", TP.el("code", { id: "command-line", text: s.command.map(quote).join(" ") })),
      ...row("Working directory", s.cwd ? TP.el("code", { text: s.cwd }) : "a fresh directory per job on the worker"),
      ...row("Environment", ...(env.length ? env.map(([k, v]) => TP.el("div", {}, TP.el("code", { text: `${k}=${v}` }))) : ["–"])),
      ...row("Secrets", (s.secret_env || []).length ? `${s.secret_env.join(", ")} (from the worker's environment; values never stored or shown)` : "–"),
      ...row("Instrumentation", s.instrument === false ? "off" : "on (progress and metrics reported without code changes)"));
    $("command-box").hidden = false;
  }
  function showOutput() {
    const box = $("output");
    const items = [];
    if (job && job.output_dir) items.push(TP.el("p", {}, TP.el("span", { class: "label", text: "Final model " }), TP.el("code", { text: job.output_dir })));
    for (const c of checkpoints.slice(-10).reverse()) {
      if (c.data.final) continue;
      items.push(TP.el("p", {}, TP.el("span", { class: "label", text: `step ${TP.num(c.data.step)} ` }), TP.el("code", { text: c.data.path }), " ", TP.rel(c.t)));
    }
    if (!items.length && job && job.checkpoint) items.push(TP.el("p", {}, TP.el("span", { class: "label", text: "Latest checkpoint " }), TP.el("code", { text: job.checkpoint })));
    if (items.length) box.replaceChildren(...items);
  }
  function showAttempts(list) {
    $("attempts").replaceChildren(...list.map((a) => TP.el("tr", {},
      TP.el("td", { text: `#${a.attempt}` }), TP.el("td", { text: a.agent_id ? (agents.get(a.agent_id) || { name: `agent ${a.agent_id}` }).name : "–" }),
      TP.el("td", {}, TP.rel(a.started_at)), TP.el("td", {}, a.ended_at ? TP.rel(a.ended_at) : "–"),
      TP.el("td", { class: "wrap" }, `${a.outcome || (a.ended_at ? "ended" : "running")}${a.reason ? " — " + TP.reasonParts(a.reason).head : ""}`,
        a.reason && TP.reasonParts(a.reason).rest ? TP.el("a", { class: "small-link", href: a === list[list.length - 1] ? "#reason" : `#attempt-${a.attempt}`,
          text: a === list[list.length - 1] ? " (full output above)" : " (full output)",
          onclick: a === list[list.length - 1] ? null : (e) => { e.preventDefault(); e.target.replaceWith(TP.el("pre", { class: "traceback", text: TP.reasonParts(a.reason).rest })); } }) : ""),
      TP.el("td", { class: "attempt-class", text: attemptClass(a) }),
      TP.el("td", { class: "attempt-change", text: attemptChange(a.change) }),
      TP.el("td", { class: "attempt-next wrap", text: a.decision || "–" }),
      TP.el("td", { class: "attempt-ckpt", text: a.checkpoint_s != null ? `${TP.num(a.checkpoint_s, 1)} s` : "–" }))));
    if (!list.length) $("attempts").append(TP.el("tr", {}, TP.el("td", { colspan: 9, class: "muted", text: "Not started yet." })));
  }
  // the failure's class, with what the policy compares or reports for it (a hang's step and frame, the peak memory)
  function attemptClass(a) {
    const cls = a.failure_class || a.failure;
    if (!cls) return "–";
    const more = [];
    if (a.hang_step != null) more.push(`step ${a.hang_step}`);
    if (a.hang_frame) more.push(a.hang_frame);
    if (a.peak_mb != null) more.push(`peak ${TP.num(a.peak_mb)} MiB`);
    return more.length ? `${cls} (${more.join(", ")})` : cls;
  }
  // {"batch_size": [8, 4], "grad_accum": [1, 2]} -> "batch_size 8 → 4, grad_accum 1 → 2"
  function attemptChange(change) {
    if (!change) return "–";
    return Object.entries(change).map(([k, v]) => Array.isArray(v) && v.length === 2 ? `${k} ${v[0]} → ${v[1]}` : `${k} ${JSON.stringify(v)}`).join(", ");
  }

  let lastProgress = null;
  function showProgressAge() {
    const box = $("progress-age");
    if (!lastProgress) { box.textContent = "–"; return; }
    const t = box.querySelector("time");
    const active = job && TP.ACTIVE.includes(job.state);
    if (t && t.dataset.t == lastProgress && !!t.dataset.hb === active) return;
    box.replaceChildren(TP.rel(lastProgress, { hb: active }));
  }
  function onEvent(e) {
    const d = e.data;
    if (e.kind === "metrics" && TP.isSystem(d.values)) return; // the agent's sys/ samples: system.js charts them by time
    if (e.kind === "metrics" || (e.kind === "phase" && !d.quiet)) { lastProgress = Math.max(lastProgress || 0, e.t); showProgressAge(); }
    if (e.kind === "metrics") { addPoint(d.step, d.values, e.t); if (job) { job.last = { ...(job.last || {}), ...d.values, step: d.step }; job.step = d.step; showNumbers(job.last); } }
    else if (e.kind === "phase") {
      if (job) { job.phase = d; if (d.name === "training" && d.total) job.total_steps = d.total; }
      showPhase(d);
    }
    else if (e.kind === "log") { if (e.seq > lastLogSeq) appendLog(e); }
    else if (e.kind === "info") { if (job) Object.assign(job.info = job.info || {}, d); infoEvents.push(e); showInfo(); }
    else if (e.kind === "checkpoint") {
      checkpoints.push(e); if (d.final && job) job.output_dir = d.path;
      if (job && !d.final && Number.isInteger(d.step) && d.step > (job.step || 0)) job.step = d.step; // as the server does
      showOutput();
    }
  }

  // ---- REST: first load and every reconnect fill what the websocket missed ----------------------
  let refilling = null;
  // One refill at a time; one asked for meanwhile runs after it (its snapshot may predate the news).
  let refillAgain = false;
  function refill() {
    if (refilling) { refillAgain = true; return refilling; }
    refilling = doRefill().finally(() => { refilling = null; if (refillAgain) { refillAgain = false; refill(); } });
    return refilling;
  }
  async function doRefill() {
    const first = lastStep < 0 && !job;
    const mq = `/api/jobs/${jobId}/metrics?max_points=${MAX_POINTS}${lastStep >= 0 ? `&after_step=${lastStep}` : ""}`;
    const logq = lastLogSeq >= 0 ? `/api/jobs/${jobId}/events?kinds=log&after_seq=${lastLogSeq}&limit=2000` : `/api/jobs/${jobId}/events?kinds=log&tail=true&limit=500`;
    const [j, m, logs, other, alerts, ags] = await Promise.all([
      TP.api(`/api/jobs/${jobId}`), TP.api(mq), TP.api(logq),
      TP.api(`/api/jobs/${jobId}/events?kinds=info&kinds=checkpoint&limit=1000`),
      TP.api(`/api/alerts?job_id=${jobId}&limit=50`), TP.api("/api/agents")]);
    agents = new Map(ags.map((a) => [a.id, a]));
    if (j.attempts.length) lastAgent = j.attempts[j.attempts.length - 1].agent_id;
    let m2 = m;
    if (shownAttempt !== null && m.attempt > shownAttempt) startAttempt(m.attempt); // a new attempt began
    if (shownAttempt !== null && m.attempt === shownAttempt && lastStep < 0 && mq.includes("after_step")) {
      // the points asked for were after the previous attempt's last step: this attempt's all
      m2 = await TP.api(`/api/jobs/${jobId}/metrics?max_points=${MAX_POINTS}&attempt=${m.attempt}`);
    }
    if (m.attempt < (shownAttempt || 0)) return; // an older snapshot than the news already shown
    shownAttempt = m.attempt;
    await loadEarlier(j.attempts);
    for (const [k, s] of Object.entries(m2.series)) {
      if (k.startsWith("sys/")) continue; // keyed by time, not step: the System panels (system.js)
      if (s.t && s.t.length) lastProgress = Math.max(lastProgress || 0, s.t[s.t.length - 1]);
      mergePoints(k, s.step, s.value, s.t);
      noteNonfinite(k, s.nonfinite);
      if (s.downsampled && first) downsampledInfo[k] = s.total_points;
    }
    drawCharts(true);
    noteDownsampled(null);
    showSummary(j);
    showProgressAge();
    $("config").textContent = JSON.stringify(j.spec, null, 2);
    if (j.kind === "command") showCommand(j.spec);
    showAttempts(j.attempts);
    infoEvents.length = 0; checkpoints.length = 0;
    for (const e of other.events) (e.kind === "info" ? infoEvents : checkpoints).push(e);
    showInfo(); showOutput();
    if (first) $("log").textContent = "";
    for (const e of logs.events) if (e.seq > lastLogSeq) appendLog(e);
    if (!logs.events.length && first) $("log").textContent = "";
    alerts.slice().reverse().forEach(showAlert);
    if (location.hash === "#alerts" && first && alerts.length) $("alerts").scrollIntoView();
    refreshChanges();
  }

  // A new attempt: the points shown so far become a faded earlier attempt; the charts start again.
  // (the earlier one's overview is fetched anew: live points of the new attempt may have reached
  // its series before the news of the new attempt did)
  function startAttempt(attempt) {
    if (attempt === shownAttempt) return;
    for (const k of Object.keys(series)) delete series[k];
    lastStep = -1; detail = null; zoomed = null; downsampledInfo = {};
    shownAttempt = attempt;
    for (const id of Object.keys(charts)) { charts[id].destroy(); delete charts[id]; }
  }
  async function loadEarlier(attempts) {
    const want = attempts.map((a) => a.attempt).filter((a) => a < shownAttempt && !earlier[a]);
    const got = await Promise.all(want.map((a) => TP.api(`/api/jobs/${jobId}/metrics?max_points=500&attempt=${a}`)));
    got.forEach((r) => { earlier[r.attempt] = Object.fromEntries(Object.entries(r.series).filter(([k]) => !k.startsWith("sys/"))); });
    $("earlier-box").hidden = !Object.values(earlier).some((e) => Object.keys(e).length);
  }

  TP.live([`job:${jobId}`], (f) => {
    if (f.type === "events" && f.job_id === jobId) {
      if (f.missed) { refill(); return; } // the server dropped events for this (lagging) page: ask REST
      let metrics = false, state = false;
      for (const e of f.events) { onEvent(e); if (e.kind === "metrics") metrics = true; if (e.kind === "state") state = true; }
      if (metrics) scheduleDraw();
      if (job && job.state === "starting") showSummary({ state: "running", started_at: job.started_at || f.events[0].t }); // the first event makes it running
      // Events while this page still holds "queued": its REST snapshot was older than the claim's
      // frame (both in flight at a connect). Ask again rather than stay "queued" for the whole run.
      else if (job && job.state === "queued" && !state) refill();
      if (state) refill();
    } else if (f.type === "job" && f.job.id === jobId) {
      const was = job && job.state;
      showSummary(f.job);
      if (shownAttempt !== null && f.job.attempt > shownAttempt) { startAttempt(f.job.attempt); drawCharts(false); refill(); }
      else if (was !== f.job.state) refill();
    } else if (f.type === "heartbeat" && f.job_id === jobId && job) {
      job.alive_at = f.alive_at;
      const t = $("heartbeat").querySelector("time");
      if (t) { t.dataset.t = f.alive_at; t.title = TP.abs(f.alive_at); TP.tick(); } else showHeartbeat();
    } else if (f.type === "alert" && f.alert.job_id === jobId) showAlert(f.alert);
  }, refill);

  $("panel-add").addEventListener("change", (e) => {
    const k = e.target.value; if (!k) return;
    const next = [...CHARTS["chart-custom"].keys, k];
    setPanel(next); TP.pref.set(panelPrefKey, next); updatePanelPicker(); scheduleDraw();
  });
  window.TPJOB = { series, charts, job: () => job, csvFor, attempt: () => shownAttempt, earlier }; // for tests and bench/ui.py
  setInterval(() => { if (job) { showHeartbeat(); if (TP.ACTIVE.includes(job.state)) showNumbers(job.last || {}); } }, 1000);

  // A requested stack dump is cleared by the server once the worker has taken it, without a frame
  // for this page: ask until it is gone (the dump itself arrives in the log).
  let stackWatch = null;
  function watchStack() {
    if (stackWatch) return;
    const until = Date.now() + 120e3;
    stackWatch = setInterval(async () => {
      try {
        const j = await TP.api(`/api/jobs/${jobId}`);
        if (!j.stack_requested || Date.now() > until) { clearInterval(stackWatch); stackWatch = null; showSummary(j); }
      } catch (e) { if (Date.now() > until) { clearInterval(stackWatch); stackWatch = null; } }
    }, 1000);
  }

  // ---- chart options and export -----------------------------------------------------------------
  $("earlier").addEventListener("change", () => { TP.pref.set("tp-chart-earlier", $("earlier").checked); drawCharts(false); });
  $("earlier").checked = TP.pref.get("tp-chart-earlier", true);
  for (const id of ["logy", "clip", "xaxis"]) $(id).addEventListener("change", () => {
    try { localStorage.setItem(`tp-chart-${id}`, id === "xaxis" ? $(id).value : $(id).checked ? "1" : ""); } catch (e) { /* private mode */ }
    if (id === "xaxis") { zoomed = null; detail = null; }
    drawCharts(!!zoomed); noteDownsampled(null);
  });
  try {
    $("logy").checked = localStorage.getItem("tp-chart-logy") === "1";
    $("clip").checked = localStorage.getItem("tp-chart-clip") === "1";
    if (localStorage.getItem("tp-chart-xaxis") === "time") $("xaxis").value = "time";
  } catch (e) { /* private mode */ }

  function download(name, blob) {
    const a = TP.el("a", { href: URL.createObjectURL(blob), download: name });
    document.body.append(a); a.click(); a.remove();
    setTimeout(() => URL.revokeObjectURL(a.href), 10e3);
  }
  function csvFor(id) { // every point the chart holds, by attempt and step, with its wall-clock time
    const spec = activeSpec(CHARTS[id], false);
    const head = ["attempt", "step", "time", ...spec.keys, ...(spec.smooth ? [`${spec.keys[0]}_smoothed`] : [])];
    const rows = [head.join(",")];
    const shown = showEarlier() ? Object.keys(earlier).map(Number).sort((a, b) => a - b) : [];
    for (const a of [...shown, shownAttempt]) {
      const src = a === shownAttempt ? sourceFor : (k) => earlier[a][k];
      const cols = stepData({ keys: spec.keys, smooth: spec.smooth, sourceOf: src }), when = new Map();
      for (const k of spec.keys) { const s = src(k); if (s && s.t) s.step.forEach((x, i) => { if (s.t[i]) when.set(x, s.t[i]); }); }
      cols[0].forEach((x, i) => rows.push([a, x, when.has(x) ? new Date(when.get(x) * 1000).toISOString() : "",
        ...cols.slice(1).map((c) => (c[i] === null || c[i] === undefined ? "" : c[i]))].join(",")));
    }
    return rows.join("\n") + "\n";
  }
  function pngFor(id) { // the chart as drawn (axes included), with its title and legend
    const u = charts[id];
    const src = u.ctx.canvas, ratio = src.width / u.width;
    const spec = activeSpec(CHARTS[id]);
    const c = document.createElement("canvas");
    c.width = src.width; c.height = src.height + Math.round(56 * ratio);
    const g = c.getContext("2d");
    g.fillStyle = "#fff"; g.fillRect(0, 0, c.width, c.height);
    g.scale(ratio, ratio);
    g.fillStyle = "#111827"; g.font = "600 14px system-ui, sans-serif";
    g.fillText(`${job && job.name ? job.name + " · " : ""}${$(`${id}-title`).textContent}`, 8, 18);
    g.drawImage(src, 0, 28, u.width, src.height / ratio);
    let x = 8; const y = 28 + src.height / ratio + 18;
    g.font = "12px system-ui, sans-serif";
    spec.labels.forEach((l, i) => { g.fillStyle = (spec.colors || COLORS)[i]; g.fillRect(x, y - 8, 14, 3); g.fillStyle = "#374151"; g.fillText(l, x + 18, y); x += 26 + g.measureText(l).width; });
    return c;
  }
  function addExport(id) {
    const head = $(id).previousElementSibling;
    const name = (ext) => `job-${jobId}-${id.replace("chart-", "")}.${ext}`;
    head.append(TP.el("span", { class: "export" },
      TP.el("button", { type: "button", class: "small ghost", text: "CSV", title: "Save this chart's points as CSV", "aria-label": `${$(`${id}-title`).textContent}: save as CSV`,
        onclick: () => { if (charts[id]) download(name("csv"), new Blob([csvFor(id)], { type: "text/csv" })); } }),
      TP.el("button", { type: "button", class: "small ghost", text: "PNG", title: "Save this chart as an image", "aria-label": `${$(`${id}-title`).textContent}: save as PNG`,
        onclick: () => { if (charts[id]) pngFor(id).toBlob((b) => download(name("png"), b), "image/png"); } })));
  }
  for (const id of Object.keys(CHARTS)) addExport(id);
  $("smooth").addEventListener("input", () => { $("smooth-val").value = Number($("smooth").value).toFixed(2); drawCharts(true); });
  let resizeTimer = null;
  window.addEventListener("resize", () => {
    clearTimeout(resizeTimer);
    resizeTimer = setTimeout(() => { for (const [id, c] of Object.entries(charts)) c.setSize({ width: Math.max(280, $(id).clientWidth), height: 220 }); }, 100);
  });
  const act = (a) => async () => {
    $("action-error").textContent = "";
    try { showSummary(await TP.api(`/api/jobs/${jobId}/${a}`, { method: "POST" })); }
    catch (e) { $("action-error").textContent = `${a} failed: ${e.message}`; }
  };
  $("pause").onclick = act("pause"); $("resume").onclick = act("resume"); $("stack").onclick = act("stack");
  $("cancel").onclick = () => { $("cancel-confirm-box").hidden = false; $("cancel").hidden = true; $("cancel-confirm").focus(); };
  $("cancel-no").onclick = () => { $("cancel-confirm-box").hidden = true; $("cancel").hidden = false; $("cancel").focus(); };
  $("cancel-confirm").onclick = async () => { $("cancel-confirm-box").hidden = true; await act("cancel")(); };
  $("retry").onclick = async () => {
    try { const j = await TP.api(`/api/jobs/${jobId}/clone`, { method: "POST", body: { changes: {} } }); location.href = `/jobs/${j.id}`; }
    catch (e) { $("action-error").textContent = `retry failed: ${e.message}`; }
  };
})();

// The section links: only to the sections this job shows (generations, anatomy, system, ranks appear
// when the job has them).
function showSectionLinks() {
  document.querySelectorAll("#jump a").forEach((a) => {
    const target = document.querySelector(a.getAttribute("href"));
    a.hidden = !target || target.hidden;
  });
}
showSectionLinks();
setInterval(showSectionLinks, 1000);
