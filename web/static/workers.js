"use strict";
(() => {
  const body = document.getElementById("workers-body");
  let agents = [], jobs = new Map();
  async function load() {
    const [a, running] = await Promise.all([TP.api("/api/agents"), TP.api("/api/jobs?state=starting&state=running&state=paused&limit=1000")]);
    agents = a; jobs = new Map(running.jobs.map((j) => [j.id, j]));
    render();
  }
  function device(d) { // "cuda: NVIDIA H100 80GB (79.1 GiB)" or "cpu (16 cores)": show as given, bolding the kind
    const m = /^(\w+)(.*)$/.exec(d || "");
    return m ? TP.el("span", {}, TP.el("strong", { text: m[1].toUpperCase() }), m[2]) : "–";
  }
  function machine(m) { // the agent's latest system sample: CPU, memory, each GPU
    if (!m) return [TP.el("span", { class: "muted", text: "–" })];
    const gb = (mb) => `${(mb / 1024).toFixed(1)} GiB`;
    const out = [TP.el("div", { class: "sys-cpu", text: `CPU ${Math.round(m.cpu_pct)} % of ${m.cores} cores · load ${m.load1}` }),
      TP.el("div", { class: "sys-mem", text: `memory ${gb(m.mem_used_mb)} / ${gb(m.mem_total_mb)}` })];
    m.gpus.forEach((g, i) => out.push(TP.el("div", { class: "sys-gpu", text: [`GPU ${i}`, g.util_pct != null ? `${Math.round(g.util_pct)} %` : null,
      g.mem_mb != null ? gb(g.mem_mb) : null, g.power_w != null ? `${Math.round(g.power_w)} W` : null, g.temp_c != null ? `${Math.round(g.temp_c)} °C` : null].filter(Boolean).join(" · ") })));
    return out;
  }
  function render() {
    body.replaceChildren(...agents.map((a) => {
      const mine = a.jobs.map((id) => jobs.get(id) || { id, name: `job-${id}` });
      return TP.el("tr", { "data-agent": a.id },
        TP.el("td", { "data-label": "Agent" }, TP.el("strong", { text: a.name }), TP.el("span", { class: "muted", text: ` #${a.id}` })),
        TP.el("td", { "data-label": "Host", text: a.host }),
        TP.el("td", { "data-label": "Device", class: "wrap" }, device(a.device)),
        TP.el("td", { "data-label": "Machine", class: "wrap machine" }, ...machine(a.system)),
        TP.el("td", { class: "r", "data-label": "Slots", text: `${a.jobs.length} / ${a.capacity}` }),
        TP.el("td", { "data-label": "State" }, TP.el("span", { class: `badge ${a.state}`, text: a.state })),
        TP.el("td", { "data-label": "Current job", class: "wrap" }, ...(mine.length ? mine.map((j) => TP.el("div", {},
          TP.el("a", { href: `/jobs/${j.id}`, text: `${j.name} #${j.id}` }), j.phase ? TP.el("span", { class: "muted", text: ` · ${TP.phaseText(j.phase)}` }) : "")) : [TP.el("span", { class: "muted", text: "idle" })])),
        TP.el("td", { "data-label": "Last heartbeat" }, a.state === "online" ? TP.rel(a.seen_at, { hb: true }) : TP.rel(a.seen_at)),
        TP.el("td", { "data-label": "Registered" }, TP.rel(a.created_at)));
    }));
    if (!agents.length) body.append(TP.el("tr", {}, TP.el("td", { colspan: 9, class: "empty", text: "No workers registered yet." })));
    const on = agents.filter((a) => a.state === "online").length;
    document.getElementById("worker-counts").textContent = `${on} online · ${agents.length - on} offline`;
  }
  let t = null;
  const soon = () => { clearTimeout(t); t = setTimeout(load, 300); };
  TP.live(["agents", "jobs"], (f) => {
    if (f.type === "agent") soon();
    else if (f.type === "job") {
      const old = jobs.get(f.job.id);
      if (!old || old.state !== f.job.state || old.agent_id !== f.job.agent_id) soon();
      else { jobs.set(f.job.id, { ...old, ...f.job }); render(); }
    }
  }, load);
  setInterval(load, 5000); // agent heartbeats are not pushed; refresh their ages from REST
})();
