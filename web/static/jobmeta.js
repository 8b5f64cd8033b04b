"use strict";
// The job page's project, tags and note (PATCH /api/jobs/{id}); the sweep it is a trial of.
(() => {
  const $ = (id) => document.getElementById(id);
  const jobId = Number($("job").dataset.jobId);
  const status = (text) => { $("meta-status").textContent = text; };

  function show(job) {
    $("meta-project").value = job.project || "default";
    $("meta-tags").replaceChildren(...(job.tags || []).map((t) => TP.el("span", { class: "chip" }, t,
      TP.el("button", { type: "button", class: "small ghost", "aria-label": `Remove the tag ${t}`, text: "×", onclick: () => edit({ remove_tags: [t] }) }))));
    if (document.activeElement !== $("meta-note")) $("meta-note").value = job.note || "";
    const sweep = $("meta-sweep");
    sweep.hidden = !job.sweep_id;
    if (job.sweep_id) { sweep.href = `/sweeps/${job.sweep_id}`; sweep.textContent = `a trial of sweep ${job.sweep_id}`; }
  }

  async function edit(body) {
    try { show(await TP.api(`/api/jobs/${jobId}`, { method: "PATCH", body })); status("saved"); }
    catch (e) { status(e.field ? `${e.field}: ${e.message}` : e.message); }
  }

  $("meta-tag-add").addEventListener("keydown", (e) => {
    if (e.key !== "Enter" || !e.target.value.trim()) return;
    const tag = e.target.value.trim(); e.target.value = "";
    edit({ add_tags: [tag] });
  });
  $("meta-save").onclick = () => edit({ project: $("meta-project").value.trim() || "default", note: $("meta-note").value });
  TP.api(`/api/jobs/${jobId}`).then(show).catch(() => status("could not load the job"));
})();
