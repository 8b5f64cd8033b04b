"use strict";
(() => {
  const form = document.getElementById("submit-form");
  const errBox = document.getElementById("form-error");
  const NUM = ["max_steps", "epochs", "learning_rate", "checkpoint_every", "seed"];
  const AUTO_NUM = ["batch_size", "grad_accum", "max_seq_length"];

  function spec() {
    const s = {};
    for (const el of form.elements) {
      if (!el.name) continue;
      if (el.type === "checkbox") { s[el.name] = el.checked; continue; }
      const v = el.value.trim();
      if (v === "") continue;
      if (NUM.includes(el.name)) s[el.name] = Number(v);
      else if (AUTO_NUM.includes(el.name)) s[el.name] = v === "auto" ? "auto" : Number(v);
      else s[el.name] = v;
    }
    if (s.epochs !== undefined && form.elements.max_steps.value === "200") delete s.max_steps;
    return s;
  }

  function showError(e) {
    for (const el of form.querySelectorAll(".invalid")) el.classList.remove("invalid");
    for (const el of form.querySelectorAll(".field-error")) el.remove();
    errBox.textContent = e.message;
    for (const fe of e.errors || []) {
      const input = form.elements[fe.field];
      if (input) {
        input.classList.add("invalid");
        input.closest("label").append(TP.el("span", { class: "field-error", text: fe.message }));
      }
    }
  }

  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    errBox.textContent = "";
    try {
      const j = await TP.api("/api/jobs", { method: "POST", body: spec() });
      location.href = `/jobs/${j.id}`;
    } catch (e) { showError(e); }
  });

  document.getElementById("analyze").addEventListener("click", async () => {
    const btn = document.getElementById("analyze");
    btn.disabled = true; btn.textContent = "Analyzing…"; errBox.textContent = "";
    try { showAnalysis(await TP.api("/api/datasets/analyze", { method: "POST", body: spec() })); }
    catch (e) { showError(e); }
    finally { btn.disabled = false; btn.textContent = "Analyze dataset"; }
  });

  let hist = null;
  function showAnalysis(a) {
    const sec = document.getElementById("analysis"); sec.hidden = false;
    const p = a.percentiles || {};
    document.getElementById("analysis-summary").replaceChildren(
      TP.el("p", { class: "recommend", text: `Recommended max sequence length: ${a.recommended_max_seq_length} tokens` }),
      TP.el("p", { text: `${TP.num(a.num_examples)} examples${a.sampled ? ` (sampled ${TP.num(a.sample_size)})` : ""}; ` +
        `mean ${TP.num(a.mean, 1)} tokens; p50 ${p.p50}, p90 ${p.p90}, p99 ${p.p99}, p99.9 ${p["p99.9"]}, max ${p.max}. ` +
        `Truncates ${TP.num(a.truncated_examples)} examples (${TP.num(100 * (a.truncated_fraction || 0), 2)} %).` }));
    const rows = [["Strategy", "Padding waste", "Real tokens / step"]];
    for (const [k, v] of Object.entries(a.strategies || {})) rows.push([k, `${TP.num(100 * v.padding_fraction, 1)} %`, TP.num(v.real_tokens_per_step)]);
    document.getElementById("analysis-table").replaceChildren(...rows.map((r, i) => TP.el("tr", {}, ...r.map((c) => TP.el(i ? "td" : "th", { text: c })))));
    const h = a.histogram || { edges: [], counts: [] };
    const data = [h.edges.slice(0, h.counts.length), h.counts];
    const box = document.getElementById("chart-hist");
    if (hist) hist.destroy();
    hist = new uPlot({ width: box.clientWidth || 600, height: 200, scales: { x: { time: false } },
      series: [{ label: "tokens" }, { label: "examples", stroke: "#2563eb", fill: "rgba(37,99,235,.3)", paths: uPlot.paths.bars({ size: [0.9] }) }],
      axes: [{ label: "tokens per example" }, {}] }, data, box);
  }

  const clone = form.dataset.clone;
  if (clone) TP.api(`/api/jobs/${clone}`).then((j) => {
    for (const [k, v] of Object.entries(j.spec)) {
      const el = form.elements[k];
      if (!el || v === null || typeof v === "object") continue;
      if (el.type === "checkbox") el.checked = !!v; else el.value = v;
    }
    form.elements.name.value = `${j.name} (clone)`;
  });
})();
