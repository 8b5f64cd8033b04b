"use strict";
// The rank table of a distributed job (GET /api/jobs/{id}/ranks): one row per rank with its host,
// pid, device, step, step time, own work per step (waits for the other ranks left out), memory and
// the age of its last progress, and how it ended once the attempt is over: a full-width panel above
// the log. Hidden for a one-process job. Polled while the job runs.
(() => {
  const jobId = Number(document.getElementById("job").dataset.jobId);
  const box = document.getElementById("ranks");
  if (!box) return;
  const body = document.getElementById("ranks-body");
  const LABELS = ["Rank", "Host", "PID", "Device", "Step", "Step time", "Own work", "Last progress", "Memory", "Exit"];
  const secs = (v) => (v === null || v === undefined ? "–" : `${TP.sig(v, 3)} s`);
  async function refresh() {
    let rows, job;
    try { [rows, job] = await Promise.all([TP.api(`/api/jobs/${jobId}/ranks`), TP.api(`/api/jobs/${jobId}`)]); } catch (e) { return setTimeout(refresh, 5000); }
    box.hidden = !rows.length;
    // Rank 0's events are the job's: its step is at least the job's (the header's), which metrics
    // carry sooner than the heartbeats that fill this table.
    for (const r of rows) if (r.rank === 0 && job && job.step !== null && (r.step === null || r.step < job.step)) r.step = job.step;
    const steps = rows.map((r) => r.step).filter((s) => s !== null);
    const fetched = Date.now() / 1000;
    const lead = steps.length ? Math.max(...steps) : null;
    body.replaceChildren(...rows.map((r) => TP.el("tr", { "data-rank": r.rank, class: r.step !== null && lead !== null && r.step < lead - 1 ? "behind" : "" },
      TP.el("td", { text: String(r.rank) }), TP.el("td", { text: r.host || "–" }), TP.el("td", { text: r.pid ? String(r.pid) : "–" }),
      TP.el("td", { text: r.device || "–" }), TP.el("td", { text: r.step === null ? "–" : TP.num(r.step) }),
      TP.el("td", { text: secs(r.step_time_s) }), TP.el("td", { text: secs(r.busy_s) }),
      // a time that ticks (the age is the server's, at this fetch: no clock skew with the agent)
      TP.el("td", {}, r.progress_age_s === null ? "–" : TP.rel(fetched - r.progress_age_s)),
      TP.el("td", { text: TP.bytesMB(r.rss_mb) }), TP.el("td", { text: r.exit || "–" }))));
    for (const tr of body.children) [...tr.children].forEach((td, i) => td.setAttribute("data-label", LABELS[i]));
    const spec = (job && job.spec) || {};
    const ranked = (spec.nproc_per_node || 1) * (spec.nnodes || 1) > 1;
    if (ranked && job && !TP.FINAL.includes(job.state)) setTimeout(refresh, 1000); // a one-process job has no ranks
  }
  refresh();
})();
