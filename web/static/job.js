"use strict";
(() => {
  const jobId = Number(document.getElementById("job").dataset.jobId);
  const $ = (id) => document.getElementById(id);
  let job = null, lastStep = -1;
  const series = {}; // name -> {step: [], value: []}
  const charts = {};

  const CHARTS = {
    "chart-loss": { keys: ["loss"], labels: ["loss"], smooth: true },
    "chart-tps": { keys: ["tokens_per_s", "padded_tokens_per_s"], labels: ["real tok/s", "padded tok/s"] },
    "chart-step": { keys: ["step_time_s"], labels: ["s/step"] },
    "chart-lr": { keys: ["lr"], labels: ["lr"] },
    "chart-mem": { keys: ["rss_mb", "cuda_peak_mb"], labels: ["RSS MB", "CUDA peak MB"] },
  };
  const COLORS = ["#2563eb", "#f97316", "#16a34a", "#9333ea"];

  function ema(vals, a) {
    if (!a) return vals;
    const out = []; let m = null;
    for (const v of vals) { m = m === null ? v : a * m + (1 - a) * v; out.push(m); }
    return out;
  }

  function chartData(spec) {
    const steps = new Set();
    for (const k of spec.keys) for (const s of (series[k] ? series[k].step : [])) steps.add(s);
    const xs = [...steps].sort((a, b) => a - b);
    const cols = [xs];
    for (const k of spec.keys) {
      const m = new Map();
      if (series[k]) series[k].step.forEach((s, i) => m.set(s, series[k].value[i]));
      cols.push(xs.map((x) => (m.has(x) ? m.get(x) : null)));
    }
    if (spec.smooth) {
      const a = Number($("smooth").value);
      cols.push(ema(cols[1].map((v) => v ?? NaN), a));
    }
    return cols;
  }

  function drawCharts() {
    for (const [id, spec] of Object.entries(CHARTS)) {
      const box = $(id);
      const data = chartData(spec);
      if (charts[id]) { charts[id].setData(data); continue; }
      const s = [{ label: "step" }, ...spec.labels.map((l, i) => ({ label: l, stroke: COLORS[i], width: spec.smooth ? 1 : 2, alpha: spec.smooth ? 0.35 : 1, spanGaps: true }))];
      if (spec.smooth) s.push({ label: "smoothed", stroke: COLORS[0], width: 2, spanGaps: true });
      charts[id] = new uPlot({ width: box.clientWidth || 500, height: 220, series: s, scales: { x: { time: false } },
        axes: [{ label: "step" }, {}], cursor: { drag: { x: true, y: false } } }, data, box);
    }
  }

  function addPoint(step, values) {
    for (const [k, v] of Object.entries(values)) {
      const s = series[k] || (series[k] = { step: [], value: [] });
      if (s.step.length && s.step[s.step.length - 1] >= step) continue; // already have it (REST refill)
      s.step.push(step); s.value.push(v);
    }
    lastStep = Math.max(lastStep, step);
  }

  function showSummary(j) {
    job = { ...(job || {}), ...j };
    $("job-name").textContent = job.name || `Job ${jobId}`;
    const st = $("job-state"); st.textContent = job.state; st.className = `badge ${job.state}`;
    const active = ["running", "starting"].includes(job.state);
    $("cancel").hidden = !(active || ["queued", "paused"].includes(job.state));
    $("pause").hidden = !active;
    $("resume").hidden = job.state !== "paused";
    showPhase(job.phase);
    const last = job.last || {};
    $("loss").textContent = TP.sig(last.loss);
    $("lr").textContent = last.lr !== undefined ? Number(last.lr).toExponential(2) : "–";
    $("tps").textContent = last.tokens_per_s !== undefined ? `${TP.num(last.tokens_per_s)} tok/s` : "–";
    $("eta").textContent = active ? TP.dur(last.eta_s) : "–";
    $("reason").textContent = job.reason ? job.reason : "";
    if (job.output_dir) $("output").textContent = job.output_dir;
    else if (job.checkpoint) $("output").textContent = `latest checkpoint: ${job.checkpoint}`;
  }

  function showPhase(p) {
    $("phase-text").textContent = TP.phaseText(p);
    const bar = $("phase-progress");
    if (p && p.total) { bar.hidden = false; bar.value = (p.done || 0) / p.total; } else bar.hidden = true;
  }

  function showAlert(a) {
    const box = $("alerts");
    let div = box.querySelector(`[data-alert="${a.id}"]`);
    if (!div) { div = TP.el("div", { "data-alert": a.id, role: "alert" }); box.prepend(div); }
    div.className = `alert ${a.severity} ${a.state}`;
    div.replaceChildren(TP.el("strong", { text: `${a.kind}${a.state === "cleared" ? " (cleared)" : ""}: ` }),
      TP.el("span", { text: a.message }),
      a.stack ? TP.el("details", {}, TP.el("summary", { text: "stack" }), TP.el("pre", { text: a.stack })) : "",
      a.state === "open" ? TP.el("button", { type: "button", text: "Acknowledge", onclick: async () => showAlert(await TP.api(`/api/alerts/${a.id}/ack`, { method: "POST" })) }) : "");
  }

  function appendLog(line) {
    const log = $("log");
    const follow = log.scrollTop + log.clientHeight >= log.scrollHeight - 20;
    log.append(line + "\n");
    while (log.childNodes.length > 2000) log.removeChild(log.firstChild);
    if (follow) log.scrollTop = log.scrollHeight;
  }

  function onEvent(e) {
    const d = e.data;
    if (e.kind === "metrics") addPoint(d.step, d.values);
    else if (e.kind === "phase") { showPhase(d); if (job) job.phase = d; }
    else if (e.kind === "log") appendLog(d.line);
    else if (e.kind === "info") { Object.assign(job.info = job.info || {}, d); showInfo(); }
  }

  function showInfo() {
    const dl = $("info"); dl.replaceChildren();
    for (const [k, v] of Object.entries((job && job.info) || {})) {
      dl.append(TP.el("dt", { text: k }), TP.el("dd", { text: typeof v === "object" ? JSON.stringify(v) : String(v) }));
    }
  }

  async function refill() { // at (re)connect: everything since what we have
    const [j, m, ev, alerts] = await Promise.all([
      TP.api(`/api/jobs/${jobId}`),
      TP.api(`/api/jobs/${jobId}/metrics?max_points=2000${lastStep >= 0 ? `&after_step=${lastStep}` : ""}`),
      TP.api(`/api/jobs/${jobId}/events?kinds=log&tail=true&limit=500`),
      TP.api(`/api/alerts?job_id=${jobId}`)]);
    showSummary(j);
    $("config").textContent = JSON.stringify(j.spec, null, 2);
    showInfo();
    $("attempts").replaceChildren(...j.attempts.map((a) => TP.el("li", { text: `#${a.attempt} on agent ${a.agent_id ?? "–"}: ${a.outcome || "running"}${a.reason ? " — " + a.reason : ""}` })));
    for (const [k, s] of Object.entries(m.series)) {
      const cur = series[k] || (series[k] = { step: [], value: [] });
      s.step.forEach((st, i) => { if (!cur.step.length || st > cur.step[cur.step.length - 1]) { cur.step.push(st); cur.value.push(s.value[i]); lastStep = Math.max(lastStep, st); } });
    }
    $("log").textContent = ""; for (const e of ev.events) appendLog(e.data.line);
    alerts.reverse().forEach(showAlert);
    drawCharts();
  }

  TP.live([`job:${jobId}`, "alerts"], (f) => {
    if (f.type === "events") { for (const e of f.events) onEvent(e); drawCharts(); }
    else if (f.type === "job" && f.job.id === jobId) { showSummary(f.job); if (["completed", "failed", "cancelled", "paused"].includes(f.job.state)) refill(); }
    else if (f.type === "heartbeat" && f.job_id === jobId) { job.alive_at = f.alive_at; }
    else if (f.type === "alert" && f.alert.job_id === jobId) {
      showAlert(f.alert);
      if (f.alert.state === "open" && "Notification" in window && Notification.permission === "granted")
        new Notification(`tokenpulse: job ${jobId} ${f.alert.kind}`, { body: f.alert.message });
    }
  }, refill);

  setInterval(() => {
    if (!job) return;
    const hb = $("heartbeat"); const active = ["running", "starting"].includes(job.state);
    hb.textContent = active ? TP.ago(job.alive_at) : (job.alive_at ? `${TP.ago(job.alive_at)} (${job.state})` : "never");
    hb.className = active ? TP.heartbeatClass(job.alive_at) : "";
    hb.title = TP.abs(job.alive_at);
  }, 1000);
  $("smooth").addEventListener("input", drawCharts);
  window.addEventListener("resize", () => { for (const [id, c] of Object.entries(charts)) c.setSize({ width: $(id).clientWidth, height: 220 }); });
  const act = (a) => async () => { try { showSummary(await TP.api(`/api/jobs/${jobId}/${a}`, { method: "POST" })); } catch (e) { $("reason").textContent = e.message; } };
  $("cancel").onclick = act("cancel"); $("pause").onclick = act("pause"); $("resume").onclick = act("resume");
  if ("Notification" in window && Notification.permission === "default") document.addEventListener("click", () => Notification.requestPermission(), { once: true });
})();
