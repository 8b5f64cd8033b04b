// The Alerts page: every alert across jobs, filtered by state, kind, severity and job (the filters
// live in the URL, so the header badge can open "open alerts"); live through the alerts topic; the
// alert rules a person wrote (list, add, remove) below.
"use strict";
(() => {
  const body = document.getElementById("alerts-body");
  const form = document.getElementById("alert-filters");
  const fields = { state: "f-state", kind: "f-kind", severity: "f-severity", job_id: "f-job" };
  const params = new URLSearchParams(location.search);
  for (const [k, id] of Object.entries(fields)) if (params.get(k)) document.getElementById(id).value = params.get(k);
  let alerts = [];

  function query() {
    const q = new URLSearchParams();
    for (const [k, id] of Object.entries(fields)) { const v = document.getElementById(id).value.trim(); if (v) q.set(k, v); }
    return q;
  }
  async function load() {
    const q = query();
    history.replaceState(null, "", q.toString() ? `/alerts?${q}` : "/alerts");
    q.set("limit", "1000");
    try { alerts = await TP.api(`/api/alerts?${q}`); } catch (e) { body.replaceChildren(TP.el("tr", {}, TP.el("td", { colspan: 8, class: "error", text: e.message }))); return; }
    render();
  }
  function render() {
    document.getElementById("alert-total").textContent = `${alerts.length} alert${alerts.length === 1 ? "" : "s"}`;
    const kinds = document.getElementById("kinds");
    kinds.replaceChildren(...[...new Set(["rule:", ...alerts.map((a) => a.kind)])].map((k) => TP.el("option", { value: k })));
    if (!alerts.length) { body.replaceChildren(TP.el("tr", {}, TP.el("td", { colspan: 8, class: "empty", text: "No alerts match." }))); return; }
    body.replaceChildren(...alerts.map((a) => TP.el("tr", { "data-alert": a.id, class: `sev-${a.severity} st-${a.state}` },
      TP.el("td", { "data-label": "Job" }, a.job_id ? TP.el("a", { href: `/jobs/${a.job_id}#alerts`, text: `#${a.job_id}${a.job_name ? " " + a.job_name : ""}` }) : "–"),
      TP.el("td", { "data-label": "Kind", class: "kind", "data-kind": a.kind, title: a.kind, text: a.rule_name ? `rule: ${a.rule_name}` : a.kind }),
      TP.el("td", { "data-label": "Severity" }, TP.el("span", { class: `badge sev-${a.severity}`, text: a.severity })),
      TP.el("td", { "data-label": "State", class: "state", text: a.state }),
      TP.el("td", { "data-label": "Message", class: "wrap msg" }, ...message(a.message, a)),
      TP.el("td", { "data-label": "Opened" }, TP.rel(a.created_at)),
      TP.el("td", { "data-label": "Updated" }, TP.rel(a.updated_at)),
      TP.el("td", {}, a.state === "open" ? TP.el("button", { class: "ghost small", type: "button", text: "Acknowledge",
        onclick: async () => { await TP.api(`/api/alerts/${a.id}/ack`, { method: "POST" }); load(); } }) : ""))));
  }
  // The headline in one line; the detail (timeout arithmetic, library paths, a traceback) folded below it.
  function message(text, a) {
    let { head, rest } = TP.reasonParts(text);
    if (head.length > 160) { // one long line: its first sentence or clause is the headline
      const cut = head.slice(40).search(/[.;] /);
      if (cut >= 0) { rest = `${head.slice(41 + cut).trim()}${rest ? "\n" + rest : ""}`; head = head.slice(0, 41 + cut); }
    }
    return [TP.headline(head, a, { class: "msg-head" }),
      rest ? TP.el("details", { class: "msg-detail" }, TP.el("summary", { text: "Details" }), TP.el("pre", { text: rest })) : ""];
  }
  form.addEventListener("input", () => load());
  form.addEventListener("change", () => load());
  form.addEventListener("submit", (e) => { e.preventDefault(); load(); });
  let pending = null; // live frames: refetch at most twice a second (the filters are the server's)
  TP.live([], () => {}, load);
  TP.onAlert(() => { if (!pending) pending = setTimeout(() => { pending = null; load(); }, 500); });

  // ---- rules ----------------------------------------------------------------------------------
  const rulesBody = document.getElementById("rules-body");
  const ruleForm = document.getElementById("rule-form");
  const $ = (id) => document.getElementById(id);
  function when(r) {
    return { above: `${r.metric} > ${r.threshold}`, below: `${r.metric} < ${r.threshold}`,
      no_improvement: `${r.metric} not better (${r.mode === "max" ? "higher" : "lower"} is better) for ${r.steps} steps`,
      jump: `${r.metric} jumps ${r.sigmas} σ`, nonfinite: `${r.metric} is NaN or infinite`, state: `job ${r.state}` }[r.condition];
  }
  async function loadRules() {
    const rules = await TP.api("/api/rules");
    if (!rules.length) { rulesBody.replaceChildren(TP.el("tr", {}, TP.el("td", { colspan: 7, class: "empty", text: "No rules yet." }))); return; }
    rulesBody.replaceChildren(...rules.map((r) => TP.el("tr", { "data-rule": r.id },
      TP.el("td", { "data-label": "Id" }, TP.el("a", { href: `/alerts?kind=rule:${r.id}`, text: `rule:${r.id}` })),
      TP.el("td", { "data-label": "Name", text: r.name }),
      TP.el("td", { "data-label": "Jobs", text: r.scope === "all" ? "all" : r.scope === "name" ? r.pattern : `#${r.job_id}` }),
      TP.el("td", { "data-label": "When", class: "when", text: when(r) }),
      TP.el("td", { "data-label": "Severity" }, TP.el("span", { class: `badge sev-${r.severity}`, text: r.severity })),
      TP.el("td", { "data-label": "Channels", text: r.channels.map((c) => c.format).join(", ") || "–" }),
      TP.el("td", {}, TP.el("button", { class: "ghost small", type: "button", text: "Remove", "aria-label": `Remove rule ${r.name}`,
        onclick: async () => { await TP.api(`/api/rules/${r.id}`, { method: "DELETE" }); loadRules(); load(); } })))));
  }
  const NEEDS = { above: ["metric", "threshold"], below: ["metric", "threshold"], no_improvement: ["metric", "steps"],
    jump: ["metric", "sigmas"], nonfinite: ["metric"], state: ["state"] };
  function shape() {
    const need = NEEDS[$("r-condition").value];
    for (const f of ruleForm.querySelectorAll("[data-for]")) f.hidden = !need.includes(f.dataset.for);
    $("r-pattern").hidden = $("r-scope").value !== "name";
    $("r-job_id").hidden = $("r-scope").value !== "job";
  }
  ruleForm.addEventListener("change", shape);
  shape();
  const errors = TP.formErrors(ruleForm, $("rule-error"), (field) => $(`r-${field.split(".")[0] === "channels" ? "url" : field}`));
  ruleForm.addEventListener("submit", async (e) => {
    e.preventDefault();
    const cond = $("r-condition").value, scope = $("r-scope").value;
    const b = { name: $("r-name").value.trim(), scope, condition: cond, severity: $("r-severity").value };
    if (scope === "name") b.pattern = $("r-pattern").value.trim() || null;
    if (scope === "job") b.job_id = $("r-job_id").value ? Number($("r-job_id").value) : null;
    const num = (id) => ($(id).value === "" ? null : Number($(id).value));
    for (const f of NEEDS[cond]) b[f] = f === "metric" ? ($("r-metric").value.trim() || null) : f === "state" ? $("r-state").value : num(`r-${f}`);
    if (cond === "no_improvement") b.mode = $("r-mode").value;
    if ($("r-url").value.trim()) b.channels = [{ url: $("r-url").value.trim(), format: $("r-format").value }];
    try {
      await TP.api("/api/rules", { method: "POST", body: b });
      errors.clear(); ruleForm.reset(); shape(); loadRules();
    } catch (err) { errors.show(err); }
  });
  // metric names people log, for the datalist: the latest metrics of recent jobs
  TP.api("/api/jobs?limit=50&names=true").then((r) => {
    const names = new Set(r.metric_names || []);
    $("metric-names").replaceChildren(...[...names].sort().map((n) => TP.el("option", { value: n })));
  }).catch(() => {});
  load();
  loadRules();
})();
