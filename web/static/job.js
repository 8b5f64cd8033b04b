"use strict";
(() => {
  const jobId = Number(document.getElementById("job").dataset.jobId);
  const $ = (id) => document.getElementById(id);
  const MAX_POINTS = 2000;
  let job = null, lastStep = -1, lastLogSeq = -1, firstChartMarked = false;
  const series = {}; // name -> {step: [], value: []}: the overview (downsampled by the server) + live points
  let detail = null; // {min, max, series} while zoomed into a downsampled range
  let downsampledInfo = {}; // name -> total points on the server
  const charts = {};
  const infoEvents = [];
  let agents = new Map(), lastAgent = null;
  const checkpoints = [];

  const fmtTps = (u, v) => v.map(TP.axis);
  const fmtMem = (u, v) => v.map(TP.axis);
  const fmtLr = (u, v) => v.map((x) => (x === 0 ? "0" : Number(x).toExponential(2)));
  const CHARTS = {
    "chart-loss": { keys: ["loss"], labels: ["loss"], smooth: true, value: (v) => TP.sig(v) },
    "chart-tps": { keys: ["padded_tokens_per_s", "tokens_per_s"], labels: ["padded", "real"], colors: ["#f97316", "#2563eb"], dash: [[5, 4], null], unit: "tok/s", axis: fmtTps, value: (v) => TP.compact(v, "tok/s") },
    "chart-step": { keys: ["step_time_s"], labels: ["step time"], unit: "s", value: (v) => (v === null || v === undefined ? "–" : `${TP.sig(v, 3)} s`) },
    "chart-lr": { keys: ["lr"], labels: ["lr"], axis: fmtLr, value: (v) => (v === null || v === undefined ? "–" : Number(v).toExponential(3)) },
    "chart-grad": { keys: ["grad_norm"], labels: ["grad norm"], value: (v) => TP.sig(v) },
    "chart-mem": { keys: ["rss_mb", "cuda_peak_mb"], labels: ["process RSS", "CUDA peak"], unit: "MiB", axis: fmtMem, value: (v) => TP.bytesMB(v) },
  };
  const COLORS = ["#2563eb", "#f97316", "#16a34a", "#9333ea"];

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
    const d = detail.series[k], step = [], value = [];
    if (base) for (let i = 0; i < base.step.length && base.step[i] < detail.min; i++) { step.push(base.step[i]); value.push(base.value[i]); }
    for (let i = 0; i < d.step.length; i++) { step.push(d.step[i]); value.push(d.value[i]); }
    if (base) for (let i = 0; i < base.step.length; i++) if (base.step[i] > detail.max) { step.push(base.step[i]); value.push(base.value[i]); }
    return { step, value };
  }

  function chartData(spec) {
    const srcs = spec.keys.map(sourceFor);
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
    if (spec.smooth) cols.push(ema(cols[1], Number($("smooth").value)));
    return cols;
  }

  let syncing = false;
  function makeChart(id, spec, data) {
    const box = $(id);
    const s = [{ label: "step", value: (u, v) => (v === null || v === undefined ? "–" : TP.num(v)) }];
    spec.labels.forEach((l, i) => s.push({ label: l, stroke: (spec.colors || COLORS)[i], width: spec.smooth ? 1 : 1.5, spanGaps: true,
      ...(spec.dash && spec.dash[i] ? { dash: spec.dash[i] } : {}),
      ...(spec.smooth ? { stroke: "rgba(37,99,235,0.3)" } : {}), value: (u, v) => spec.value(v) }));
    if (spec.smooth) s.push({ label: "smoothed", stroke: COLORS[0], width: 2, spanGaps: true, value: (u, v) => spec.value(v) });
    const opts = {
      width: Math.max(280, box.clientWidth || 500), height: 220, series: s,
      scales: { x: { time: false } },
      axes: [{ label: "step", labelSize: 18, size: 36, incrs: TP.STEP_INCRS, values: (u, v) => v.map(TP.axis) },
        { label: spec.unit || "", labelSize: spec.unit ? 18 : 0, size: 64, values: spec.axis }],
      cursor: { drag: { x: true, y: false, setScale: true }, sync: { key: `job${jobId}`, setSeries: false } },
      legend: { live: true },
      hooks: {
        setScale: [(u, key) => {
          if (key !== "x" || syncing || resetting) return;
          const { min, max } = u.scales.x;
          syncing = true;
          for (const c of Object.values(charts)) if (c !== u) c.setScale("x", { min, max });
          syncing = false;
          onZoom(min, max, u);
        }],
      },
    };
    const u = new uPlot(opts, data, box);
    u.over.setAttribute("aria-label", `${box.previousElementSibling ? box.previousElementSibling.textContent : id} chart`);
    return u;
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
    zoomTimer = setTimeout(async () => {
      const lo = Math.floor(min) - 1, hi = Math.ceil(max);
      const m = await TP.api(`/api/jobs/${jobId}/metrics?max_points=${MAX_POINTS}&after_step=${lo}&before_step=${hi}`);
      if (!zoomed || zoomed.min !== min || zoomed.max !== max) return;
      detail = { min: lo + 1, max: hi, series: m.series };
      drawCharts(true);
      noteDownsampled(m.series, true);
    }, 120);
  }
  function fullRange() {
    let lo = Infinity, hi = -Infinity;
    for (const s of Object.values(series)) if (s.step.length) { lo = Math.min(lo, s.step[0]); hi = Math.max(hi, s.step[s.step.length - 1]); }
    return lo <= hi ? [lo, hi] : null;
  }
  function resetZoom() {
    zoomed = null; detail = null;
    drawCharts(false);
    noteDownsampled(null);
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
    for (const [id, spec] of Object.entries(CHARTS)) {
      const data = chartData(spec);
      const box = $(id);
      box.dataset.points = data[0].length;
      if (!charts[id]) { if (!spec.keys.some((k) => series[k])) { emptyNote(box); continue; } box.replaceChildren(); syncing = true; try { charts[id] = makeChart(id, spec, data); } finally { syncing = false; } if (zoomed) charts[id].setScale("x", zoomed); continue; }
      // Data updates never count as a user's zoom: only a drag (or a double-click) does.
      syncing = true;
      try {
        if (zoomed && keepScale) { charts[id].setData(data, false); charts[id].setScale("x", zoomed); }
        else charts[id].setData(data, true);
      } finally { syncing = false; }
    }
    if (!firstChartMarked && charts["chart-loss"] && series.loss && series.loss.step.length) {
      firstChartMarked = true;
      performance.mark("tp:first-chart");
      document.body.dataset.firstChart = "1";
    }
  }
  function emptyNote(box) { if (!box.firstChild) box.append(TP.el("p", { class: "muted empty", text: "No points yet." })); }

  // Points arrive from two sources (websocket frames, REST refills) in any order: keep each series
  // sorted by step with every step once. The common case (newer than all) is a plain push.
  function mergePoints(k, steps, values) {
    const s = series[k] || (series[k] = { step: [], value: [] });
    const n = s.step.length;
    if (!steps.length) return;
    if (!n || steps[0] > s.step[n - 1]) { for (let i = 0; i < steps.length; i++) { s.step.push(steps[i]); s.value.push(values[i]); } }
    else {
      const st = [], va = []; let i = 0, j = 0;
      while (i < n || j < steps.length) {
        if (j >= steps.length || (i < n && s.step[i] < steps[j])) { st.push(s.step[i]); va.push(s.value[i]); i++; }
        else if (i >= n || steps[j] < s.step[i]) { st.push(steps[j]); va.push(values[j]); j++; }
        else { st.push(s.step[i]); va.push(s.value[i]); i++; j++; } // same step: keep one
      }
      s.step = st; s.value = va;
    }
    lastStep = Math.max(lastStep, s.step[s.step.length - 1]);
  }
  function addPoint(step, values) {
    for (const [k, v] of Object.entries(values)) mergePoints(k, [step], [v]);
  }

  // ---- summary ----------------------------------------------------------------------------------
  function showSummary(j) {
    job = { ...(job || {}), ...j };
    $("job-name").textContent = job.name || `Job ${jobId}`;
    document.title = `${job.name || "Job " + jobId} (${job.state}) · tokenpulse`;
    const st = $("job-state"); st.textContent = job.state; st.className = `badge ${job.state}`;
    const active = TP.ACTIVE.includes(job.state);
    const final = TP.FINAL.includes(job.state);
    const cancelling = job.requested_action === "cancel";
    $("cancel").hidden = !(active || ["queued", "paused"].includes(job.state)) || cancelling;
    if ($("cancel").hidden) $("cancel-confirm-box").hidden = true;
    $("pause").hidden = !active || !!job.requested_action || (job.kind === "command" && !(job.info && job.info.pausable));
    $("resume").hidden = job.state !== "paused";
    $("stack").hidden = !active;
    $("retry").hidden = !final;
    $("retry").textContent = job.state === "completed" ? "Run again" : "Retry";
    if (job.parent_id) $("parent").replaceChildren("cloned from ", TP.el("a", { href: `/jobs/${job.parent_id}`, text: `#${job.parent_id}` }));
    showPhase(job.phase);
    showNumbers(job.last || {});
    const r = $("reason");
    const why = job.requested_action ? `${job.requested_action} requested; waiting for the worker…` : job.reason;
    r.hidden = !why;
    r.textContent = why ? `${job.failure ? `[${job.failure}] ` : ""}${why}${job.exit_code !== null && job.exit_code !== undefined ? ` (exit code ${job.exit_code})` : ""}` : "";
    r.className = `reason ${job.state}`;
    const aid = job.agent_id || lastAgent;
    const ag = agents.get(aid);
    $("worker").replaceChildren(aid ? TP.el("a", { href: "/workers", text: ag ? `${ag.name} (${ag.host})` : `agent ${aid}`, title: ag ? ag.device : "" }) : "–");
    showHeartbeat();
    showOutput();
  }

  function showNumbers(last) {
    const step = last.step ?? job.step;
    $("step").textContent = step !== null && step !== undefined ? `${TP.num(step)}${job.total_steps ? " / " + TP.num(job.total_steps) : ""}` : "–";
    $("loss").textContent = TP.sig(last.loss);
    $("lr").textContent = last.lr !== undefined ? Number(last.lr).toExponential(2) : "–";
    $("tps").textContent = last.tokens_per_s !== undefined ? TP.compact(last.tokens_per_s, "tok/s") : "–";
    $("tps").title = last.padded_tokens_per_s !== undefined ? `padded: ${TP.compact(last.padded_tokens_per_s, "tok/s")}` : "";
    $("eta").textContent = job && TP.ACTIVE.includes(job.state) && last.eta_s !== undefined ? TP.dur(last.eta_s) : "–";
  }

  function showHeartbeat() {
    const hb = $("heartbeat");
    const active = TP.ACTIVE.includes(job.state);
    if (active) hb.replaceChildren(TP.rel(job.alive_at, { hb: true, none: "none yet" }));
    else hb.replaceChildren(job.alive_at ? TP.rel(job.alive_at) : "–", job.alive_at ? TP.el("span", { class: "muted", text: ` (${job.state})` }) : "");
    const el = $("elapsed");
    if (job.started_at) {
      const end = job.finished_at || (active ? null : job.alive_at) || Date.now() / 1000;
      el.textContent = TP.dur((job.finished_at || (active ? Date.now() / 1000 : end)) - job.started_at);
      el.title = `started ${TP.abs(job.started_at)}${job.finished_at ? `, ended ${TP.abs(job.finished_at)}` : ""}`;
    } else { el.textContent = job.state === "queued" ? "waiting for a worker" : "–"; el.title = `submitted ${TP.abs(job.created_at)}`; }
  }

  function showPhase(p) {
    $("phase-text").textContent = !p && job && job.state === "queued" ? "waiting for a worker" : TP.phaseText(p);
    const bar = $("phase-progress");
    if (p && p.total) { bar.hidden = false; bar.value = Math.min(1, (p.done || 0) / p.total); bar.title = `${Math.round(100 * bar.value)} %`; } else bar.hidden = true;
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
    const ack = a.state === "open" ? TP.el("button", { type: "button", class: "small ghost", text: "Acknowledge", onclick: async (e) => {
      e.target.disabled = true;
      try { showAlert(await TP.api(`/api/alerts/${a.id}/ack`, { method: "POST" })); } catch (err) { e.target.disabled = false; $("action-error").textContent = err.message; }
    } }) : null;
    div.replaceChildren(
      TP.el("div", { class: "alert-head" },
        TP.el("span", { class: `sev ${a.severity}`, text: a.severity }), TP.el("strong", { text: ` ${a.kind}` }),
        TP.el("span", { class: "muted", text: ` · ${a.state}` }), " · ", TP.rel(a.updated_at || a.created_at), TP.el("span", { class: "spacer" }), ack),
      TP.el("div", { class: "alert-msg", text: a.message }),
      a.stack ? TP.el("details", {}, TP.el("summary", { text: `Stack dump (${a.stack.split("\n").length} lines)` }), TP.el("pre", { text: a.stack })) : "");
  }

  // ---- log --------------------------------------------------------------------------------------
  function appendLog(e) {
    const log = $("log");
    const follow = $("follow").checked;
    const line = TP.el("span", { class: `line ${e.data.stream || "stdout"}`, title: TP.abs(e.t), text: e.data.line + "\n" });
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
      const { reason, measured, ...rest } = ev.data;
      const main = Object.entries(rest).map(([k, v]) => `${k.replaceAll("_", " ")}: ${fmtVal(k, v)}`).join(" · ");
      rows.push(TP.el("li", {}, TP.el("span", { class: "choice", text: main }),
        reason ? TP.el("span", { class: "why", text: ` — ${reason}` }) : "",
        measured ? TP.el("details", {}, TP.el("summary", { text: "measurements" }), TP.el("pre", { text: JSON.stringify(measured, null, 1) })) : ""));
    }
    box.replaceChildren(TP.el("ul", { class: "choices" }, ...rows));
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
      TP.el("td", { class: "wrap", text: `${a.outcome || (a.ended_at ? "ended" : "running")}${a.reason ? " — " + a.reason : ""}` }))));
    if (!list.length) $("attempts").append(TP.el("tr", {}, TP.el("td", { colspan: 5, class: "muted", text: "Not started yet." })));
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
    if (e.kind === "metrics" || e.kind === "phase") { lastProgress = Math.max(lastProgress || 0, e.t); showProgressAge(); }
    if (e.kind === "metrics") { addPoint(d.step, d.values); if (job) { job.last = { ...(job.last || {}), ...d.values, step: d.step }; job.step = d.step; showNumbers(job.last); } }
    else if (e.kind === "phase") {
      if (job) { job.phase = d; if (d.name === "training" && d.total) job.total_steps = d.total; }
      showPhase(d);
    }
    else if (e.kind === "log") { if (e.seq > lastLogSeq) appendLog(e); }
    else if (e.kind === "info") { if (job) Object.assign(job.info = job.info || {}, d); infoEvents.push(e); showInfo(); }
    else if (e.kind === "checkpoint") { checkpoints.push(e); if (d.final && job) job.output_dir = d.path; showOutput(); }
  }

  // ---- REST: first load and every reconnect fill what the websocket missed ----------------------
  let refilling = null;
  function refill() { refilling = refilling || doRefill().finally(() => { refilling = null; }); return refilling; }
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
    for (const [k, s] of Object.entries(m.series)) {
      if (s.t && s.t.length) lastProgress = Math.max(lastProgress || 0, s.t[s.t.length - 1]);
      mergePoints(k, s.step, s.value);
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
  }

  TP.live([`job:${jobId}`], (f) => {
    if (f.type === "events" && f.job_id === jobId) {
      if (f.missed) { refill(); return; } // the server dropped events for this (lagging) page: ask REST
      let metrics = false, state = false;
      for (const e of f.events) { onEvent(e); if (e.kind === "metrics") metrics = true; if (e.kind === "state") state = true; }
      if (metrics) scheduleDraw();
      if (job && job.state === "starting") showSummary({ state: "running", started_at: job.started_at || f.events[0].t }); // the first event makes it running
      if (state) refill();
    } else if (f.type === "job" && f.job.id === jobId) {
      const was = job && job.state;
      showSummary(f.job);
      if (was !== f.job.state) refill();
    } else if (f.type === "heartbeat" && f.job_id === jobId && job) {
      job.alive_at = f.alive_at;
      const t = $("heartbeat").querySelector("time");
      if (t) { t.dataset.t = f.alive_at; t.title = TP.abs(f.alive_at); TP.tick(); } else showHeartbeat();
    } else if (f.type === "alert" && f.alert.job_id === jobId) showAlert(f.alert);
  }, refill);

  window.TPJOB = { series, charts, job: () => job }; // for tests and bench/ui.py
  setInterval(() => { if (job) showHeartbeat(); }, 1000);
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
