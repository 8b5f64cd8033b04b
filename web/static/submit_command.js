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
    for (const k of ["nproc_per_node", "max_retries", "priority"]) { // sent as typed: the API names a bad one
      const v = $(`c-${k.replaceAll("_", "-")}`).value.trim();
      if (v !== "") b[k] = /^-?\d+$/.test(v) ? Number(v) : v;
    }
    if ($("c-cwd").value.trim()) b.cwd = $("c-cwd").value.trim();
    if ($("c-name").value.trim()) b.name = $("c-name").value.trim();
    return b;
  }

  // inputs are named by id (c-<field>): their name attributes would clash with the training form's
  const { clear: clearErrors, show: showError } = TP.formErrors(form, errBox,
    (f) => $(`c-${f.split(".")[0].replaceAll("_", "-")}`));

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
    for (const k of ["nproc_per_node", "max_retries", "priority"]) if (s[k] !== undefined && s[k] !== null) $(`c-${k.replaceAll("_", "-")}`).value = s[k];
    setMode("command");
    const note = $("clone-note"); note.hidden = false;
    note.replaceChildren("Command copied from ", TP.el("a", { href: `/jobs/${j.id}`, text: `${j.name} #${j.id}` }), ` (${j.state}). Change what you like and run it.`);
  }
  // submit.js's "Start from job" picker fetches the job and says which one it picked
  document.addEventListener("tp-clone", (ev) => { if (ev.detail.kind === "command") fill(ev.detail); else setMode("train"); });
  if (!$("clone-from").getAttribute("data-clone") && new URLSearchParams(location.search).get("mode") === "command") setMode("command");
})();
