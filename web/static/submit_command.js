"use strict";
// The submit page's Command mode: run your own script as a job (POST /api/jobs/command). Self-contained
// beside submit.js: it switches which form shows and fills itself when cloning a command job.
(() => {
  const $ = (id) => document.getElementById(id);
  const form = $("command-form"), train = $("submit-form"), analysis = $("analysis"), errBox = $("command-error");
  let analysisWasShown = false;

  function setMode(mode) {
    const command = mode === "command";
    for (const r of document.querySelectorAll('input[name="job-mode"]')) r.checked = r.value === mode;
    if (command && !train.hidden) analysisWasShown = !analysis.hidden;
    form.hidden = !command; train.hidden = command;
    analysis.hidden = command || !analysisWasShown;
  }
  for (const r of document.querySelectorAll('input[name="job-mode"]')) r.addEventListener("change", () => setMode(r.value));

  // env lines -> {NAME: value}; a line without "=" is the caller's mistake, named like an API error
  function body() {
    const env = {}, errors = [];
    $("c-env").value.split("\n").forEach((line, i) => {
      if (!line.trim()) return;
      const eq = line.indexOf("=");
      if (eq <= 0) { errors.push({ field: "env", message: `line ${i + 1}: give NAME=VALUE` }); return; }
      env[line.slice(0, eq).trim()] = line.slice(eq + 1);
    });
    if (errors.length) { const e = new Error(errors[0].message); e.errors = errors; throw e; }
    const b = { command: $("c-command").value.trim(), env, instrument: $("c-instrument").checked,
      secret_env: $("c-secret-env").value.split(/[\s,]+/).filter(Boolean) };
    if ($("c-cwd").value.trim()) b.cwd = $("c-cwd").value.trim();
    if ($("c-name").value.trim()) b.name = $("c-name").value.trim();
    return b;
  }

  function clearErrors() {
    errBox.textContent = "";
    for (const el of form.querySelectorAll(".invalid")) { el.classList.remove("invalid"); el.removeAttribute("aria-invalid"); }
    for (const el of form.querySelectorAll(".field-error")) el.remove();
  }
  function showError(e) {
    clearErrors();
    let first = null;
    const rest = [];
    for (const fe of e.errors || []) {
      // inputs are named by id (c-<field>): their name attributes would clash with the training form's
      const input = fe.field && $(`c-${fe.field.split(".")[0].replaceAll("_", "-")}`);
      if (!input) { rest.push(fe.field && fe.field !== "body" ? `${fe.field}: ${fe.message}` : fe.message); continue; }
      input.classList.add("invalid"); input.setAttribute("aria-invalid", "true");
      const id = `${input.id}-error`;
      if (!$(id)) input.closest(".field").append(TP.el("span", { id, class: "field-error", role: "alert", text: fe.message }));
      input.setAttribute("aria-describedby", `${input.id}-help ${id}`);
      first = first || input;
    }
    errBox.textContent = rest.length ? rest.join("; ") : first ? "Please fix the highlighted field." : e.message;
    if (first) first.focus();
  }

  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    clearErrors();
    const btn = $("command-submit"); btn.disabled = true;
    try {
      const j = await TP.api("/api/jobs/command", { method: "POST", body: body() });
      location.href = `/jobs/${j.id}`;
    } catch (e) { showError(e); btn.disabled = false; }
  });

  const quote = (a) => (/^[\w@%+=:,./-]+$/.test(a) ? a : `'${a.replaceAll("'", `'"'"'`)}'`);
  function fill(j) {
    const s = j.spec;
    form.reset(); clearErrors();
    $("c-command").value = s.command.map(quote).join(" ");
    $("c-cwd").value = s.cwd || "";
    $("c-name").value = `${j.name} (clone)`;
    $("c-instrument").checked = s.instrument !== false;
    $("c-env").value = Object.entries(s.env || {}).map(([k, v]) => `${k}=${v}`).join("\n");
    $("c-secret-env").value = (s.secret_env || []).join(", ");
    setMode("command");
    const note = $("clone-note"); note.hidden = false;
    note.replaceChildren("Command copied from ", TP.el("a", { href: `/jobs/${j.id}`, text: `${j.name} #${j.id}` }), ` (${j.state}). Change what you like and run it.`);
  }
  async function cloneFrom(id) {
    if (!id) return;
    const j = await TP.api(`/api/jobs/${id}`);
    if (j.kind === "command") fill(j); else setMode("train");
  }
  $("clone-from").addEventListener("change", (ev) => {
    if (!ev.target.value) { form.reset(); return; }
    cloneFrom(ev.target.value).catch((e) => { errBox.textContent = `Cannot clone job ${ev.target.value}: ${e.message}`; });
  });
  const clone = train.getAttribute("data-clone"); // not train.dataset: the form's "dataset" input shadows it
  if (clone) cloneFrom(clone).catch((e) => { errBox.textContent = `Cannot clone job ${clone}: ${e.message}`; });
  else if (new URLSearchParams(location.search).get("mode") === "command") setMode("command");
})();
