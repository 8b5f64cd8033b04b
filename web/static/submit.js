"use strict";
(() => {
  const form = document.getElementById("submit-form");
  const errBox = document.getElementById("form-error");
  const $ = (id) => document.getElementById(id);

  function setPath(obj, path, v) {
    const parts = path.split(".");
    let o = obj;
    for (const p of parts.slice(0, -1)) o = o[p] = o[p] || {};
    o[parts[parts.length - 1]] = v;
  }

  // The form as a JobSpec. Empty inputs are left out (the API's defaults apply); numbers that do not
  // parse are sent as typed so the API's message names the field.
  function spec() {
    const s = {};
    for (const el of form.elements) {
      if (!el.name || !el.dataset.kind || el.name === "lora.enabled") continue;
      if (el.name.startsWith("lora.") && !form.elements["lora.enabled"].checked) continue;
      const kind = el.dataset.kind;
      if (kind === "bool") { if (!el.dataset.auto) setPath(s, el.name, el.checked); continue; }
      const v = el.value.trim();
      if (v === "" || kind === "json") continue;
      if (kind === "int" || kind === "float") setPath(s, el.name, isFinite(Number(v)) ? Number(v) : v);
      else if (kind === "auto-int") setPath(s, el.name, v === "auto" ? "auto" : isFinite(Number(v)) ? Number(v) : v);
      else if (kind === "list") setPath(s, el.name, v.split(",").map((x) => x.trim()).filter(Boolean));
      else if (kind === "prompt") { const all = prompts(el.name).map((x) => x.value).filter((x) => x.trim()); if (all.length) setPath(s, el.name, all); }
      else setPath(s, el.name, v);
    }
    const extra = $("f-extra").value.trim();
    if (extra) {
      let x;
      try { x = JSON.parse(extra); } catch (e) { const err = new Error("extra settings: not valid JSON"); err.errors = [{ field: "extra", message: `not valid JSON: ${e.message}` }]; throw err; }
      for (const [k, v] of Object.entries(x)) s[k] = v && typeof v === "object" && !Array.isArray(v) && s[k] ? { ...s[k], ...v } : v;
    }
    return s;
  }

  // "Loss on the response only": on for data with a prompt (prompt/response, Alpaca, chats), off for
  // plain text. Until the person sets it, the box shows what the data's shape says (the named fields,
  // else the last analysis; unknown: half-ticked) and is not sent: the server decides it from the
  // dataset's columns by the same rule (server/validate.py has_prompt).
  const respOnly = form.elements.loss_on_response_only;
  let analyzedFields = null; // the fields the last analysis found, for the dataset it analyzed
  function autoRespOnly(on) {
    respOnly.dataset.auto = on ? "1" : "";
    showRespOnly();
  }
  function showRespOnly() {
    if (!respOnly.dataset.auto) { respOnly.indeterminate = false; return; }
    const v = (n) => (form.elements[n].value || "").trim();
    const data = v("dataset");
    let shaped = null;
    if (v("messages_field") || v("prompt_field")) shaped = true;
    else if (v("text_field") || !data || data === "builtin:demo") shaped = false;
    else if (analyzedFields && analyzedFields.dataset === data) shaped = !!(analyzedFields.fields.messages || analyzedFields.fields.prompt || analyzedFields.fields.instruction);
    respOnly.indeterminate = shaped === null;
    respOnly.checked = !!shaped;
    respOnly.title = shaped === null ? "decided from the dataset's columns when you submit (on for prompt/response, Alpaca and chat data)" : "";
  }
  respOnly.addEventListener("change", () => autoRespOnly(false));
  for (const n of ["dataset", "text_field", "prompt_field", "messages_field"]) form.elements[n].addEventListener("input", showRespOnly);
  autoRespOnly(true);

  // Eval prompts: one box each, so a prompt may hold newlines (and Clone keeps "Q: ...?\nA:" whole).
  const prompts = (name) => [...form.querySelectorAll(`textarea[data-kind="prompt"][name="${name}"]`)];
  function setPrompts(name, values) {
    const list = form.querySelector(`.prompt-list[data-name="${name}"]`), first = prompts(name)[0];
    for (const x of prompts(name).slice(1)) x.closest(".prompt-row").remove();
    first.value = values[0] || "";
    for (const v of values.slice(1)) addPrompt(list, v);
  }
  function addPrompt(list, value = "") {
    const first = list.querySelector("textarea"), n = list.querySelectorAll("textarea").length + 1;
    if (n > 8) return null; // the API takes at most 8
    const box = TP.el("textarea", { name: first.name, "data-kind": "prompt", rows: 2, spellcheck: "false", "aria-label": `Prompt ${n}`, id: `${first.id}-${n}` });
    box.value = value;
    list.append(TP.el("div", { class: "prompt-row" }, box, TP.el("button", { type: "button", class: "small ghost", text: "Remove", "aria-label": `Remove prompt ${n}`,
      onclick: (e) => e.target.closest(".prompt-row").remove() })));
    return box;
  }
  for (const b of form.querySelectorAll(".add-prompt")) b.addEventListener("click", () => {
    const box = addPrompt($(`${b.dataset.for}-list`)); if (box) box.focus();
  });
  const { clear: clearErrors, show: showError } = TP.formErrors(form, errBox, (f) => {
    const m = /^(.*)\.(\d+)$/.exec(f); // eval_prompts.2: that prompt's box
    if (m && prompts(m[1]).length) return prompts(m[1])[Number(m[2])] || prompts(m[1])[0];
    const x = form.elements[f];
    return x && !x.tagName && x.length ? x[0] : x; // several boxes of one name: the first
  });

  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    clearErrors();
    const btn = $("submit"); btn.disabled = true;
    try {
      const j = await TP.api("/api/jobs", { method: "POST", body: spec() });
      // Queued with warnings: we stay here to show them, and the button stays off (a second click
      // would queue a duplicate) until a setting is changed for a new job.
      if (j.preflight && j.preflight.analysis === "pending") { submitted(j); await checkingData(j); }
      else if (j.warnings && j.warnings.length) { showWarnings(j); submitted(j); } else location.href = `/jobs/${j.id}`;
    } catch (e) { showError(e); btn.disabled = false; }
  });
  // The data analysis outlasted the submit's wait: the job is queued; stay here saying so, and show
  // the warnings when the analysis is done (or go to the job if there are none), never drop them.
  async function checkingData(j) {
    const box = $("submit-warnings"), t0 = Date.now();
    const status = TP.el("span", { id: "checking-data", text: "checking your data…" });
    box.hidden = false;
    box.replaceChildren(TP.el("p", {}, `Job #${j.id} is queued and runs as asked; `, status, " ",
      TP.el("a", { href: `/jobs/${j.id}`, id: "open-job", text: `open job #${j.id} now` })));
    const tick = setInterval(() => { status.textContent = `checking your data… ${Math.round((Date.now() - t0) / 1000)} s`; }, 1000);
    try {
      for (let i = 0; i < 5; i++) {
        const p = await TP.api(`/api/jobs/${j.id}/preflight?wait_s=60`);
        if (p.preflight.analysis === "pending") continue;
        const warnings = [...(j.warnings || [])];
        for (const w of p.warnings) if (!warnings.some((x) => x.kind === w.kind && x.field === w.field)) warnings.push(w);
        if (warnings.length) { showWarnings({ ...j, warnings }); return; }
        if (p.preflight.analysis === "failed" || p.preflight.analysis === "busy") {
          status.textContent = `the data check could not run (${p.preflight.analysis}); the worker checks again at start.`; return;
        }
        location.href = `/jobs/${j.id}`; return;
      }
      status.textContent = "the data check is still running; its warnings will appear on the job page as alerts.";
    } catch (e) { status.textContent = `the data check failed: ${e.message}`; }
    finally { clearInterval(tick); }
  }
  function submitted(j) {
    const btn = $("submit");
    btn.disabled = true; btn.textContent = `Queued as #${j.id}`;
    btn.title = "Change a setting to submit another job";
    form.addEventListener("input", () => { btn.disabled = false; btn.textContent = "Submit job"; btn.title = ""; }, { once: true });
  }
  // The submit's preflight advice: the job is queued and runs as asked; each warning names the
  // setting and the fix, so the user can open the job, or cancel it and change the setting.
  const warnList = (ws) => TP.el("ul", { class: "warnings" }, ...ws.map((w) => TP.el("li", {},
    TP.el("strong", { text: `${w.field}: ` }), w.message, TP.el("span", { class: "fix", text: ` — fix: ${w.fix}` }))));
  function showWarnings(j) {
    const box = $("submit-warnings");
    box.hidden = false;
    box.replaceChildren(TP.el("p", {}, `Job #${j.id} is queued and runs as asked, with ${j.warnings.length} warning${j.warnings.length === 1 ? "" : "s"}: `,
      TP.el("a", { href: `/jobs/${j.id}`, id: "open-job", text: `open job #${j.id}` }),
      " · ", TP.el("button", { type: "button", class: "small ghost", text: "Cancel it", onclick: async (e) => {
        e.target.disabled = true;
        try { await TP.api(`/api/jobs/${j.id}/cancel`, { method: "POST" }); e.target.textContent = "Cancelled"; } catch (err) { e.target.disabled = false; errBox.textContent = err.message; }
      } })), warnList(j.warnings));
    box.scrollIntoView({ block: "nearest" });
  }
  form.addEventListener("input", (ev) => { // an edited field loses its stale error
    const el = ev.target; if (!el.classList.contains("invalid")) return;
    el.classList.remove("invalid"); el.removeAttribute("aria-invalid");
    const fe = el.closest(".field") && el.closest(".field").querySelector(".field-error"); if (fe) fe.remove();
  });

  // ---- Analyze dataset ---------------------------------------------------------------------------
  let started = 0, timer = null;
  // measure: seconds the worker code may spend finding, per sequence length, the largest micro-batch that fits
  const MEASURE_S = 30;
  $("analyze").addEventListener("click", () => runAnalysis(0));
  $("measure").addEventListener("click", () => runAnalysis(MEASURE_S));
  async function runAnalysis(measure) {
    const btn = $("analyze"), status = $("analyze-status");
    clearErrors();
    btn.disabled = true; $("measure").disabled = true; btn.textContent = "Analyzing…"; started = Date.now();
    timer = setInterval(() => { status.textContent = `${measure ? "tokenizing and measuring memory" : "tokenizing the dataset"}… ${Math.round((Date.now() - started) / 1000)} s`; }, 500);
    clearAnalysis(); // results of an earlier dataset must never stand for this one
    try {
      const body = spec();
      const a = await TP.api(`/api/datasets/analyze${measure ? `?measure=${measure}` : ""}`, { method: "POST", body });
      analyzedFields = { dataset: body.dataset || "", fields: a.fields || {} };
      showRespOnly();
      showAnalysis(a);
      status.textContent = `analyzed in ${TP.num((Date.now() - started) / 1000, 1)} s`;
    } catch (e) {
      showError(e);
      status.textContent = "";
      const fe = (e.errors || []).find((x) => x.field) || {};
      status.replaceChildren(TP.el("span", { id: "analysis-error", class: "error", text: `Analysis failed: ${fe.message || e.message}` }));
    }
    finally { clearInterval(timer); btn.disabled = false; $("measure").disabled = false; btn.textContent = "Analyze dataset"; }
  }

  // The sequence-length vs micro-batch trade-off, measured by the worker code on this machine.
  function showMemory(m) {
    const box = $("analysis-memory");
    box.hidden = !m;
    if (!m) return;
    const cell = (r) => (r.fits ? `${TP.num(r.max_rows)} rows` : r.fits === false ? "does not fit" : "not measured");
    $("analysis-memory-note").textContent = `Measured on ${m.device} (${m.precision}) with rows full of your data's tokens, within about ${TP.num(m.budget_s)} s: the largest micro-batch that fits at each max sequence length, and its speed. "limited by time" or "cap" means more rows may fit.`;
    $("analysis-memory-table").replaceChildren(
      TP.el("tr", {}, ...["Max sequence length", "Largest micro-batch", "Tokens/s", "Limited by"].map((h, i) => TP.el("th", { class: i ? "r" : "", text: h }))),
      ...m.table.map((r) => TP.el("tr", { "data-seq-len": r.seq_len }, TP.el("td", { text: TP.num(r.seq_len) }), TP.el("td", { class: "r", text: cell(r) }),
        TP.el("td", { class: "r", text: r.fits ? TP.compact(r.tokens_per_s, "tok/s") : "–" }), TP.el("td", { class: "r", text: r.limited_by }))));
  }
  let hist = null;
  function clearAnalysis() {
    $("analysis-memory").hidden = true;
    $("analysis").hidden = true;
    for (const id of ["analysis-summary", "analysis-warnings", "analysis-pct", "analysis-table", "chart-hist"]) $(id).replaceChildren();
    $("analysis-note").textContent = "";
    if (hist) { hist.destroy(); hist = null; }
  }
  const LAYOUT = { max_length: "Pad to max length", dynamic: "Dynamic padding", pack: "Packing (padding-free)" };
  function showAnalysis(a) {
    const sec = $("analysis"); sec.hidden = false;
    const p = a.percentiles || {};
    const rec = a.recommended_max_seq_length;
    const useBtn = TP.el("button", { type: "button", class: "small", id: "use-recommended", text: `Use ${rec}`, onclick: () => {
      form.elements.max_seq_length.value = rec; form.elements.max_seq_length.focus(); } });
    const truncated = a.truncated ?? 0;
    $("analysis-warnings").replaceChildren(...((a.warnings || []).length ? [warnList(a.warnings)] : []));
    showMemory(a.memory);
    $("analysis-summary").replaceChildren(
      TP.el("p", { class: "recommend" }, "Recommended max sequence length: ", TP.el("strong", { id: "recommended", text: `${TP.num(rec)} tokens` }), " ", useBtn),
      TP.el("p", { text: `Covers ${a.length_coverage} % of examples whole` + (a.model_max_length ? `; the model accepts up to ${TP.num(a.model_max_length)} tokens.` : ".") }),
      TP.el("p", {}, `At ${TP.num(a.max_seq_length)} tokens it truncates `, TP.el("strong", { id: "truncated", text: `${TP.num(truncated)} example${truncated === 1 ? "" : "s"} (${TP.num(100 * (a.truncated_frac || 0), 2)} %)` }), "."),
      TP.el("p", { class: "muted", text: `${TP.num(a.examples)} examples${a.sampled ? ` (lengths from a sample of ${TP.num(a.sample_size)})` : ""}, ${TP.compact(a.tokens)} tokens, mean ${TP.num(a.mean, 1)} tokens per example. Fields: ${Object.entries(a.fields || {}).map(([k, v]) => `${k} = ${v}`).join(", ") || "–"}.` }));

    const pk = Object.keys(p);
    $("analysis-pct").replaceChildren(TP.el("tr", {}, ...pk.map((k) => TP.el("th", { class: "r", text: k }))),
      TP.el("tr", {}, ...pk.map((k) => TP.el("td", { class: "r", text: `${TP.num(p[k])}` }))));

    // Every layout at the same real tokens per optimizer step (training's step is a token budget):
    // what differs is how many tokens are computed to get them, padding included.
    const rows = Object.entries(a.layouts || {});
    const best = Math.min(...rows.map(([, v]) => v.computed_per_real_token ?? Infinity));
    $("analysis-table").replaceChildren(
      TP.el("tr", {}, ...[["Layout"], ["Padding waste", "Share of computed tokens that are padding"],
        ["Tokens computed per step", "Padding included, to get the same real tokens per step"],
        ["Computed per real token", "Tokens computed (padding included) for each real token learned from"],
        ["Compute vs. pad to max length", "Compute for the same real tokens, relative to padding every row to max length; lower is better"]]
        .map(([h, title], i) => TP.el("th", { class: i ? "r" : "", text: h, title }))),
      ...rows.map(([k, v]) => TP.el("tr", { class: v.computed_per_real_token === best ? "best" : "", "data-layout": k },
        TP.el("td", { text: LAYOUT[k] || k }),
        TP.el("td", { class: "r" }, TP.el("span", { class: `waste ${v.padding_frac > 0.5 ? "bad" : v.padding_frac > 0.2 ? "warn" : "ok"}`, text: `${TP.num(100 * v.padding_frac, 1)} %` })),
        TP.el("td", { class: "r", text: TP.num(v.padded_tokens_per_step) }),
        TP.el("td", { class: "r", text: v.computed_per_real_token ? `${TP.num(v.computed_per_real_token, 2)}` : "–" }),
        TP.el("td", { class: "r", text: v.compute_vs_max_length ? `${TP.num(100 * v.compute_vs_max_length, 0)} %` : "–" }))));
    const stepFrom = a.real_tokens_per_step_from === "tokens_per_batch" ? "as set in Tokens per optimizer step"
      : `${TP.num(a.rows_per_step)} examples of mean length, the default`;
    $("analysis-note").textContent = `Compared at the same ${TP.num(a.real_tokens_per_step)} real tokens per optimizer step (${stepFrom}), as training runs every layout. ` +
      "Padding waste is the share of computed tokens that are padding; the last column is the compute each layout needs for those real tokens, relative to padding every row to max length (lower is better; attention and per-row overheads come on top)." +
      (a.layouts && a.layouts.pack && a.layouts.pack.row_len ? ` Packed rows hold up to ${TP.num(a.layouts.pack.row_len)} tokens.` : "");

    const h = a.histogram || [];
    const xs = h.map((b) => (b.lo + b.hi) / 2), ys = h.map((b) => b.count);
    const box = $("chart-hist");
    if (hist) hist.destroy();
    box.replaceChildren();
    const width = Math.max(280, box.clientWidth || 500);
    hist = new uPlot({ width, height: 200, scales: { x: { time: false, range: (u, lo, hi) => [0, Math.max(hi, rec) * 1.02] } },
      legend: { show: true },
      series: [{ label: "tokens", value: (u, v) => (v === null || v === undefined ? "–" : `${TP.num(v)} tokens`) },
        { label: "examples", stroke: "#2563eb", fill: "rgba(37,99,235,.35)", paths: uPlot.paths.bars({ size: [0.95, 100] }), points: { show: false } }],
      axes: [{ label: "tokens per example", labelSize: 18 }, { label: "examples", labelSize: 18, size: 50 }],
      hooks: { draw: [(u) => { // the recommended length as a dashed line
        const x = Math.round(u.valToPos(rec, "x", true)); const ctx = u.ctx;
        ctx.save(); ctx.strokeStyle = "#dc2626"; ctx.setLineDash([5, 4]); ctx.lineWidth = 2;
        ctx.beginPath(); ctx.moveTo(x, u.bbox.top); ctx.lineTo(x, u.bbox.top + u.bbox.height); ctx.stroke();
        ctx.fillStyle = "#dc2626"; ctx.font = `${12 * devicePixelRatio}px system-ui`;
        const label = `recommended ${rec} `, right = x + ctx.measureText(label).width > u.bbox.left + u.bbox.width;
        ctx.textAlign = right ? "right" : "left"; ctx.fillText(right ? label : ` ${label}`, x, u.bbox.top + 14 * devicePixelRatio); ctx.restore();
      }] } }, [xs, ys], box);
    sec.scrollIntoView({ behavior: "smooth", block: "nearest" });
  }

  // ---- clone from an earlier job -----------------------------------------------------------------
  function fill(j) {
    if (j.kind === "command") return; // the Command form fills itself (submit_command.js)
    form.reset(); for (const list of form.querySelectorAll(".prompt-list")) setPrompts(list.dataset.name, []);
    const lora = j.spec.lora;
    form.elements["lora.enabled"].checked = !!lora;
    const extra = {};
    for (const [k, v] of Object.entries(j.spec)) {
      if (k === "lora" || k === "stall" || k === "slurm") {
        for (const [kk, vv] of Object.entries(v || {})) {
          const el = form.elements[`${k}.${kk}`];
          if (el) el.type === "checkbox" ? (el.checked = !!vv) : (el.value = vv === null ? "" : Array.isArray(vv) ? vv.join(", ") : vv);
        }
        continue;
      }
      if (prompts(k).length) { setPrompts(k, Array.isArray(v) ? v : []); continue; }
      const el = form.elements[k];
      if (!el) { if (v !== null) extra[k] = v; continue; }
      if (el.type === "checkbox") el.checked = !!v; else el.value = v === null || v === undefined ? "" : Array.isArray(v) ? v.join(el.dataset.kind === "lines" ? "\n" : ", ") : v;
    }
    $("f-extra").value = Object.keys(extra).length ? JSON.stringify(extra) : "";
    autoRespOnly(j.spec.loss_on_response_only === null || j.spec.loss_on_response_only === undefined);
    for (const el of form.querySelectorAll("details.group [name]")) { // a folded group holding a setting opens
      const dflt = el.tagName === "SELECT" ? ([...el.options].find((o) => o.defaultSelected) || el.options[0] || {}).value : el.dataset.default ?? el.defaultValue;
      const set = el.type === "checkbox" ? el.checked !== el.defaultChecked : el.value !== dflt;
      if (set && el.name !== "extra" && !el.name.startsWith("lora.")) el.closest("details").open = true;
    }
    if (lora) $("details-lora").open = true;
    if (Object.keys(extra).length) $("details-extra").open = true;
    if (Object.values(j.spec.stall || {}).some((v) => v !== null)) $("details-stall").open = true;
    if (j.spec.slurm) $("details-slurm").open = true;
    form.elements.name.value = `${j.name} (clone)`;
    const note = $("clone-note"); note.hidden = false;
    note.replaceChildren("Settings copied from ", TP.el("a", { href: `/jobs/${j.id}`, text: `${j.name} #${j.id}` }), ` (${j.state}). Change what you like and submit.`);
  }
  // "Start from job": any job, by #id or a name fragment; the list suggests matches as you type.
  // (The id to clone sits on this input, not on the form: form.dataset would be the form's
  // <input name="dataset">, which shadows the DOM property.)
  const pickBox = $("clone-from"), options = $("clone-options"), pickErr = $("clone-error");
  const clone = pickBox.getAttribute("data-clone");
  let suggestSeq = 0, suggestTimer = null;
  async function suggest() {
    const my = ++suggestSeq, q = pickBox.value.trim();
    const p = new URLSearchParams({ limit: 20 }); if (q && !/^#\d+ /.test(q)) p.set("q", q);
    const d = await TP.api(`/api/jobs?${p}`);
    if (my !== suggestSeq) return;
    options.replaceChildren(...d.jobs.map((j) => TP.el("option", { value: `#${j.id} ${j.name}`, text: j.state })));
  }
  function defaults() {
    form.reset(); for (const list of form.querySelectorAll(".prompt-list")) setPrompts(list.dataset.name, []); $("clone-note").hidden = true; $("f-extra").value = ""; pickErr.textContent = "";
    autoRespOnly(true);
    history.replaceState(null, "", "/submit");
  }
  async function pick() {
    const q = pickBox.value.trim();
    if (!q) return defaults();
    let id = (/^#?\s*(\d+)(\s|$)/.exec(q) || [])[1];
    try {
      if (!id) { // a name: the one job that has it, or the newest that contains it
        const d = await TP.api(`/api/jobs?${new URLSearchParams({ q, limit: 50 })}`);
        const exact = d.jobs.filter((j) => j.name === q);
        const hit = exact.length ? exact[0] : d.jobs[0];
        if (!hit) { pickErr.textContent = `No job matches “${q}”. Type its #id or part of its name.`; return; }
        id = hit.id;
      }
      const j = await TP.api(`/api/jobs/${id}`);
      pickErr.textContent = "";
      if (j.kind !== "command") fill(j);
      document.dispatchEvent(new CustomEvent("tp-clone", { detail: j })); // submit_command.js fills a command job
      pickBox.value = `#${j.id} ${j.name}`;
      history.replaceState(null, "", `/submit?clone=${j.id}`);
    } catch (e) { pickErr.textContent = e.status === 404 ? `There is no job #${id}.` : `Cannot clone job ${id}: ${e.message}`; }
  }
  pickBox.addEventListener("input", () => { clearTimeout(suggestTimer); suggestTimer = setTimeout(suggest, 150); });
  pickBox.addEventListener("change", pick); // Enter, leaving the box, or choosing a suggestion
  suggest();
  if (clone) { pickBox.value = `#${clone}`; pick(); }
  TP.live([], () => {}, null); // the header's live dot and alert badge
})();
