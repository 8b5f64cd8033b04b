"use strict";
// The sweeps list and the new-sweep form (POST /api/sweeps; a 422 names the field).
(() => {
  const $ = (id) => document.getElementById(id);
  const form = $("sweep-form");

  async function load() {
    const sweeps = await TP.api("/api/sweeps");
    $("sweeps-body").replaceChildren(...(sweeps.length ? sweeps.map((s) => TP.el("tr", { "data-sweep": s.id },
      TP.el("td", {}, TP.el("a", { href: `/sweeps/${s.id}`, text: s.name }), TP.el("span", { class: "muted id", text: ` #${s.id}` })),
      TP.el("td", { text: s.project }), TP.el("td", {}, TP.el("span", { class: `badge ${s.state}`, text: s.state })),
      TP.el("td", { text: s.method }), TP.el("td", { text: `${s.objective.metric} (${s.objective.goal})` }),
      TP.el("td", { class: "r", text: String(s.trials) }), TP.el("td", { class: "r", text: s.best ? `${TP.sig(s.best.value)} (#${s.best.number})` : "–" }),
      TP.el("td", {}, TP.rel(s.created_at)))) : [TP.el("tr", {}, TP.el("td", { colspan: 8, class: "empty", text: "No sweeps yet: start one below." }))]));
  }

  function json(name) {
    try { return JSON.parse(form.elements[name].value); } catch (e) { throw new Error(`${name}: not valid JSON (${e.message})`); }
  }

  form.addEventListener("submit", async (e) => {
    e.preventDefault();
    $("sweep-error").textContent = "";
    const f = form.elements;
    try {
      const body = { name: f.name.value || null, project: f.project.value || "default", method: f.method.value,
        objective: { metric: f.metric.value, goal: f.goal.value }, base: json("base"), parameters: json("parameters"),
        budget: { trials: Number(f.trials.value), parallel: Number(f.parallel.value), ...(f.hours.value ? { hours: Number(f.hours.value) } : {}) },
        pruner: { kind: f.pruner.value } };
      const s = await TP.api("/api/sweeps", { method: "POST", body });
      location.href = `/sweeps/${s.id}`;
    } catch (err) { $("sweep-error").textContent = err.field ? `${err.field}: ${err.message}` : err.message; }
  });

  $("from-job").addEventListener("change", async (e) => {
    const id = e.target.value.replace("#", "").trim();
    if (!id) return;
    try {
      const job = await TP.api(`/api/jobs/${id}`);
      const { name, project, tags, ...base } = job.spec;
      form.elements.base.value = JSON.stringify(base, null, 1);
      form.elements.project.value = job.project || "default";
    } catch (err) { $("sweep-error").textContent = `job ${id}: ${err.message}`; }
  });
  load();
  setInterval(load, 5000);
})();
