"use strict";
(() => {
  const PAGE = 50;
  let offset = 0, jobs = new Map(), total = 0;
  const body = document.getElementById("jobs-body");
  const search = document.getElementById("search"), stateSel = document.getElementById("state-filter");

  async function load() {
    const p = new URLSearchParams({ limit: PAGE, offset });
    if (search.value) p.set("q", search.value);
    if (stateSel.value) p.set("state", stateSel.value);
    const [data, alerts] = await Promise.all([TP.api(`/api/jobs?${p}`), TP.api("/api/alerts?state=open&limit=1000")]);
    const openAlerts = {};
    for (const a of alerts) openAlerts[a.job_id] = (openAlerts[a.job_id] || 0) + 1;
    jobs = new Map(data.jobs.map((j) => [j.id, { ...j, alerts: openAlerts[j.id] || 0 }]));
    total = data.total;
    render();
  }

  function matches(j) {
    if (stateSel.value && j.state !== stateSel.value) return false;
    if (search.value && !(`${j.name} ${j.id}`.includes(search.value))) return false;
    return true;
  }

  function row(j) {
    const last = j.last || {};
    const p = j.phase;
    const frac = p && p.total ? (p.done || 0) / p.total : null;
    const tr = TP.el("tr", { "data-job": j.id, class: `state-${j.state}` },
      TP.el("td", {}, TP.el("a", { href: `/jobs/${j.id}`, text: j.name || `job-${j.id}` })),
      TP.el("td", {}, TP.el("span", { class: `badge ${j.state}`, text: j.state })),
      TP.el("td", { class: "phase" }, TP.el("span", { text: TP.phaseText(p) }),
        frac !== null ? TP.el("progress", { max: 1, value: frac }) : ""),
      TP.el("td", { text: j.total_steps ? `${TP.num(j.step || 0)}/${TP.num(j.total_steps)}` : TP.num(j.step) }),
      TP.el("td", { text: TP.sig(last.loss) }),
      TP.el("td", { text: last.tokens_per_s !== undefined ? `${TP.num(last.tokens_per_s)} tok/s` : "–" }),
      TP.el("td", { text: ["running", "starting"].includes(j.state) ? TP.dur(last.eta_s) : "–" }),
      TP.el("td", { class: `hb ${["running", "starting"].includes(j.state) ? TP.heartbeatClass(j.alive_at) : ""}`, "data-alive": j.alive_at || "",
        text: ["running", "starting"].includes(j.state) ? TP.ago(j.alive_at) : "–", title: TP.abs(j.alive_at) }),
      TP.el("td", {}, j.alerts ? TP.el("span", { class: "alert-badge", text: `⚠ ${j.alerts}` }) : ""),
      TP.el("td", { text: j.agent_id ? `agent ${j.agent_id}` : "–" }),
      TP.el("td", { text: TP.ago(j.created_at), title: TP.abs(j.created_at) }));
    return tr;
  }

  function render() {
    body.replaceChildren(...[...jobs.values()].sort((a, b) => b.id - a.id).map(row));
    if (!jobs.size) body.append(TP.el("tr", {}, TP.el("td", { colspan: 11, class: "empty", text: "No jobs yet. Press “Run demo” to train a tiny model." })));
    document.getElementById("page-info").textContent = `${total ? offset + 1 : 0}–${Math.min(offset + PAGE, total)} of ${total}`;
    document.getElementById("prev").disabled = offset === 0;
    document.getElementById("next").disabled = offset + PAGE >= total;
  }

  TP.live(["jobs", "alerts"], (f) => {
    if (f.type === "job") {
      const old = jobs.get(f.job.id);
      if (old || (offset === 0 && matches(f.job))) {
        jobs.set(f.job.id, { ...(old || {}), ...f.job, alerts: old ? old.alerts : 0 });
        if (!old) total += 1;
        render();
      }
    } else if (f.type === "heartbeat") {
      const j = jobs.get(f.job_id);
      if (j) { j.alive_at = f.alive_at; }
    } else if (f.type === "alert") {
      const j = jobs.get(f.alert.job_id);
      if (j) { j.alerts = Math.max(0, j.alerts + (f.alert.state === "open" ? 1 : -1)); render(); }
    }
  }, load);

  setInterval(() => { // ages move on their own
    for (const td of body.querySelectorAll("td.hb[data-alive]")) {
      const t = Number(td.dataset.alive), tr = td.closest("tr"), j = jobs.get(Number(tr.dataset.job));
      if (j && ["running", "starting"].includes(j.state)) { td.textContent = TP.ago(j.alive_at); td.className = `hb ${TP.heartbeatClass(j.alive_at)}`; }
    }
  }, 1000);
  search.addEventListener("input", () => { offset = 0; load(); });
  stateSel.addEventListener("change", () => { offset = 0; load(); });
  document.getElementById("prev").onclick = () => { offset = Math.max(0, offset - PAGE); load(); };
  document.getElementById("next").onclick = () => { offset += PAGE; load(); };
  document.getElementById("demo").onclick = async () => {
    const j = await TP.api("/api/jobs", { method: "POST", body: { name: "demo" } });
    location.href = `/jobs/${j.id}`;
  };
})();
