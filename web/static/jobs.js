"use strict";
(() => {
  const PAGE = 50;
  const ACTIVE_FILTER = ["queued", "starting", "running", "paused"];
  const url = new URLSearchParams(location.search);
  let offset = Number(url.get("offset") || 0), jobs = new Map(), total = 0, agents = new Map(), loaded = false, queued = 0;
  const selected = new Set();
  const $ = (id) => document.getElementById(id);
  const body = $("jobs-body"), search = $("search"), stateSel = $("state-filter");
  const projectSel = $("project-filter"), tagBox = $("tag-filter"), groupSel = $("group-by");
  search.value = url.get("q") || ""; stateSel.value = url.get("state") || "";
  tagBox.value = url.get("tag") || ""; groupSel.value = url.get("group") || "";
  if (url.get("project")) { projectSel.append(TP.el("option", { value: url.get("project"), text: url.get("project") })); projectSel.value = url.get("project"); }

  function states() { return stateSel.value === "active" ? ACTIVE_FILTER : stateSel.value ? [stateSel.value] : []; }

  function syncUrl() {
    const p = new URLSearchParams();
    if (search.value) p.set("q", search.value);
    if (stateSel.value) p.set("state", stateSel.value);
    if (projectSel.value) p.set("project", projectSel.value);
    if (tagBox.value.trim()) p.set("tag", tagBox.value.trim());
    if (groupSel.value) p.set("group", groupSel.value);
    if (offset) p.set("offset", offset);
    history.replaceState(null, "", p.toString() ? `/?${p}` : "/");
  }

  let loadSeq = 0, metricNames = [];
  async function load() {
    const my = ++loadSeq;
    const p = new URLSearchParams({ limit: PAGE, offset, spec: "true", names: "true" }); // settings: the picked columns
    for (const c of view.cols) if (c.startsWith("last:")) p.append("columns", c); // rows carry only the picked metrics
    if (search.value.trim()) p.set("q", search.value.trim()); // "#4" is job 4; the server knows
    for (const s of states()) p.append("state", s);
    if (projectSel.value) p.set("project", projectSel.value);
    if (tagBox.value.trim()) p.append("tag", tagBox.value.trim());
    // the picked columns' sort and filters apply to every job on the server, not this page alone
    if (view.sort && view.cols.includes(view.sort)) { p.set("sort", view.sort); if (view.dir < 0) p.set("desc", "true"); }
    for (const c of view.cols) { const f = serverFilter(c, view.filters[c]); if (f) p.append("filter", f); }
    const [data, ags, waiting] = await Promise.all([TP.api(`/api/jobs?${p}`), TP.api("/api/agents"), TP.api("/api/jobs?state=queued&limit=1")]);
    if (my !== loadSeq) return; // a newer filter won
    agents = new Map(ags.map((a) => [a.id, a]));
    queued = waiting.total;
    jobs = new Map(data.jobs.map((j) => [j.id, j]));
    metricNames = data.metric_names || [];
    total = data.total; loaded = true;
    render();
  }

  function matches(j) {
    const st = states();
    if (st.length && !st.includes(j.state)) return false;
    if (projectSel.value && j.project !== projectSel.value) return false;
    if (tagBox.value.trim() && !(j.tags || []).includes(tagBox.value.trim())) return false;
    const q = search.value.trim();
    if (q.startsWith("#") && /^#\s*\d+$/.test(q)) return String(j.id) === q.slice(1).trim();
    if (q && !(j.name || "").includes(q) && String(j.id) !== q) return false;
    return true;
  }

  function alertsFor(id) { let n = 0; for (const a of TP.openAlerts.values()) if (a.job_id === id) n++; return n; }

  function row(j) {
    const last = j.last || {};
    const p = j.phase;
    const active = TP.ACTIVE.includes(j.state);
    const frac = p && p.total ? Math.min(1, (p.done || 0) / p.total) : null;
    const nAlerts = alertsFor(j.id);
    const ranOn = j.agent_id || j.last_agent_id; // a finished job: the agent of its last attempt
    const ag = agents.get(ranOn);
    const step = j.step ?? (last.step ?? null);
    const stalled = active ? TP.stallOf(j.id) : null; // the same rule as the job page's stale figures
    const staleTag = () => (stalled ? [" ", TP.el("span", { class: "stale-tag", text: "stale", title: `stale: ${stalled}` })] : []);
    return TP.el("tr", { "data-job": j.id, class: `state-${j.state}` },
      TP.el("td", { class: "sel" }, TP.el("input", { type: "checkbox", "aria-label": `Select ${j.name} for comparison`, checked: selected.has(j.id),
        onchange: (e) => { e.target.checked ? selected.add(j.id) : selected.delete(j.id); compareLink(); } })),
      TP.el("td", { class: "name", "data-label": "Job" }, TP.el("a", { href: `/jobs/${j.id}`, text: j.name || `job-${j.id}` }), TP.el("span", { class: "muted id", text: ` #${j.id}` }),
        TP.el("span", { class: "job-tags" }, j.project && j.project !== "default" ? TP.el("span", { class: "chip project", text: j.project, title: "project" }) : "",
          ...(j.tags || []).map((t) => TP.el("span", { class: "chip", text: t, title: "tag" })))),
      TP.el("td", { "data-label": "State" }, TP.el("span", { class: `badge ${j.state}`, text: j.state }),
        stalled ? TP.el("a", { class: "badge stalled", href: `/jobs/${j.id}#alerts`, text: "stalled", title: stalled }) : ""),
      TP.el("td", { class: "phase", "data-label": "Phase" }, TP.el("span", { class: "phase-text", text: phaseCell(j, active) }),
        j.state === "failed" && j.reason ? TP.el("span", { class: "reason-text", text: TP.reasonParts(j.reason).head }) : "",
        frac !== null && (active || j.state === "paused") ? TP.el("progress", { max: 1, value: frac, "aria-label": `${Math.round(frac * 100)} %` }) : ""),
      TP.el("td", { class: "r", "data-label": "Step", text: step !== null ? `${TP.num(step)}${j.total_steps ? " / " + TP.num(j.total_steps) : ""}` : (j.total_steps ? `– / ${TP.num(j.total_steps)}` : "–") }),
      TP.el("td", { class: "r", "data-label": "Loss", text: TP.sig(last.loss) }),
      TP.el("td", { class: `r${stalled && last.tokens_per_s !== undefined ? " stale" : ""}`, "data-label": "Real tokens/s" },
        last.tokens_per_s !== undefined ? TP.compact(last.tokens_per_s, "tok/s") : "–", ...(last.tokens_per_s !== undefined ? staleTag() : [])),
      TP.el("td", { class: `r${stalled && active && last.eta_s !== undefined ? " stale" : ""}`, "data-label": "ETA" },
        active && last.eta_s !== undefined ? TP.dur(last.eta_s) : "–", ...(active && last.eta_s !== undefined ? staleTag() : [])),
      TP.el("td", { "data-label": "Heartbeat" }, active ? TP.rel(j.alive_at, { hb: true, none: "none yet" }) : TP.el("span", { class: "muted", text: "–" })),
      TP.el("td", { "data-label": "Alerts" }, nAlerts ? TP.el("a", { class: "alert-badge", href: `/jobs/${j.id}#alerts`, text: `⚠ ${nAlerts}`, title: `${nAlerts} open alert${nAlerts > 1 ? "s" : ""}` }) : ""),
      TP.el("td", { "data-label": "Worker", class: j.agent_id ? "" : "muted", text: ranOn ? (ag ? ag.name : `agent ${ranOn}`) : "–",
        title: ranOn && !j.agent_id ? "the worker that ran its last attempt" : null }),
      TP.el("td", { "data-label": "Submitted" }, TP.rel(j.created_at)),
      TP.el("td", { "data-label": "Started" }, TP.rel(j.started_at)),
      ...view.cols.map((c) => TP.el("td", { class: "r picked", "data-label": colLabel(c), "data-col": c, text: fmtCell(c, colValue(j, c)) })));
  }

  // ---- picked columns: settings ("spec:learning_rate") and latest metrics ("last:eval/loss"),
  // sorted and filtered here, kept per browser --------------------------------------------------
  const view = Object.assign({ cols: [], sort: null, dir: 1, filters: {} }, TP.pref.get("tp-jobs-view", {}));
  const saveView = () => TP.pref.set("tp-jobs-view", view);
  function flat(o, prefix = "", out = {}) {
    for (const [k, v] of Object.entries(o || {})) {
      if (v && typeof v === "object" && !Array.isArray(v)) flat(v, `${prefix}${k}.`, out); else out[prefix + k] = v;
    }
    return out;
  }
  const colLabel = (c) => c.slice(c.indexOf(":") + 1) + (c.startsWith("last:") ? " (last)" : "");
  function colValue(j, c) {
    const key = c.slice(c.indexOf(":") + 1);
    if (c.startsWith("last:")) return (j.last || {})[key];
    return flat(j.spec)[key];
  }
  function fmtCell(c, v) {
    if (v === undefined || v === null) return "–";
    if (typeof v === "number") return c.startsWith("last:") ? TP.metricFormat(c.slice(5)).value(v) : String(v);
    return typeof v === "object" ? JSON.stringify(v) : String(v);
  }
  // A filter: ">0.001", "<=5", "=3" compare numbers; anything else is a piece of the text.
  function passes(j) {
    for (const [c, f] of Object.entries(view.filters)) {
      if (!f || !view.cols.includes(c)) continue;
      const v = colValue(j, c), m = /^\s*(>=|<=|>|<|=)\s*(-?[\d.eE+-]+)\s*$/.exec(f);
      if (m) {
        const x = Number(v), y = Number(m[2]);
        if (v === undefined || v === null || !isFinite(x)) return false;
        if (!({ ">": x > y, "<": x < y, ">=": x >= y, "<=": x <= y, "=": x === y })[m[1]]) return false;
      } else if (!fmtCell(c, v).toLowerCase().includes(f.trim().toLowerCase())) return false;
    }
    return true;
  }
  function serverFilter(c, f) { // a filter box in the API's words: "last:loss<0.5", "spec:model~gpt"
    if (!f || !f.trim()) return null;
    const m = /^\s*(>=|<=|>|<|=)\s*(-?[\d.eE+-]+)\s*$/.exec(f);
    return m ? `${c}${m[1]}${m[2]}` : `${c}~${f.trim()}`;
  }
  let refilter = null;
  const reload = (delay = 0) => { clearTimeout(refilter); refilter = setTimeout(() => { offset = 0; load(); }, delay); };
  function compareBy(c) {
    return (a, b) => {
      const x = colValue(a, c), y = colValue(b, c);
      if (x === undefined || x === null) return y === undefined || y === null ? 0 : 1; // blanks last
      if (y === undefined || y === null) return -1;
      return (typeof x === "number" && typeof y === "number" ? x - y : String(x).localeCompare(String(y), undefined, { numeric: true })) * view.dir;
    };
  }
  let shownPicks = null, shownFilters = null, shownHead = null;
  // ~90 settings and metrics: the picker's search box shows the ones whose name holds the text
  function findColumns() {
    const q = $("col-search").value.trim().toLowerCase();
    $("col-options").querySelectorAll("label.col-pick").forEach((l) => { l.hidden = !!q && !l.textContent.toLowerCase().includes(q); });
  }
  $("col-search").addEventListener("input", findColumns);
  // the menu opens under its button, toward the side with room (the toolbar's controls move it)
  $("col-picker").addEventListener("toggle", () => {
    const box = $("col-picks"), at = $("col-picker").getBoundingClientRect();
    const leftward = at.right - Math.max(box.offsetWidth, 240) >= 0;
    box.style.right = leftward ? "0" : "auto"; box.style.left = leftward ? "auto" : "0";
    if ($("col-picker").open) $("col-search").focus();
  });

  function renderColumns(list) {
    const specKeys = new Set(), lastKeys = new Set();
    for (const j of list) { Object.keys(flat(j.spec)).forEach((k) => specKeys.add(k)); Object.keys(j.last || {}).forEach((k) => lastKeys.add(k)); }
    metricNames.forEach((k) => lastKeys.add(k));
    const opt = (c) => TP.el("label", { class: "check col-pick" }, TP.el("input", { type: "checkbox", value: c, checked: view.cols.includes(c),
      onchange: (e) => { view.cols = e.target.checked ? [...view.cols, c] : view.cols.filter((x) => x !== c); saveView(); renderNow(); } }), ` ${c.slice(c.indexOf(":") + 1)}`);
    // rebuilt only when what they show changes: a rebuild under the user's hand loses their click or typing
    const picks = JSON.stringify([[...lastKeys].sort(), [...specKeys].sort(), view.cols]);
    if (picks !== shownPicks) { shownPicks = picks; $("col-options").replaceChildren(
      TP.el("h3", { text: "Latest metrics" }), ...[...lastKeys].sort().map((k) => opt(`last:${k}`)),
      TP.el("h3", { text: "Settings" }), ...[...specKeys].sort().filter((k) => k !== "name").map((k) => opt(`spec:${k}`)));
      findColumns(); }
    const head = $("jobs-head"), filters = $("jobs-filters");
    const filterCols = view.cols.join("\n");
    if (filterCols !== shownFilters) { shownFilters = filterCols; filters.replaceChildren(TP.el("th", { colspan: 13, class: "filter-note", text: view.cols.length ? "Filter (>0.001, <5, =3 or text):" : "" }),
      ...view.cols.map((c) => TP.el("th", { class: "picked" }, TP.el("input", { type: "search", class: "col-filter", "data-col": c, value: view.filters[c] || "",
        "aria-label": `Filter on ${colLabel(c)}`, oninput: (e) => { view.filters[c] = e.target.value; saveView(); renderBody(); reload(300); } })))); }
    filters.hidden = !view.cols.length;
    const headKey = JSON.stringify([view.cols, view.sort, view.dir]);
    if (headKey === shownHead) return; // the sort buttons stay under the user's hand through live updates
    shownHead = headKey;
    head.querySelectorAll("th.picked").forEach((th) => th.remove());
    head.append(...view.cols.map((c) => TP.el("th", { class: "r picked", "data-col": c, "aria-sort": view.sort === c ? (view.dir > 0 ? "ascending" : "descending") : "none" },
      TP.el("button", { type: "button", class: "sort", title: "Sort by this column", onclick: () => {
        if (view.sort === c) view.dir = -view.dir; else { view.sort = c; view.dir = 1; }
        saveView(); renderNow(); reload(); } }, colLabel(c), view.sort === c ? (view.dir > 0 ? " ▲" : " ▼") : ""),
      TP.el("button", { type: "button", class: "small ghost unpick", title: "Remove this column", "aria-label": `Remove the column ${colLabel(c)}`,
        onclick: () => { view.cols = view.cols.filter((x) => x !== c); saveView(); renderNow(); reload(); } }, "×"))));
  }

  function phaseCell(j, active) {
    if (j.state === "paused") return j.step !== null && j.step !== undefined ? `paused at step ${TP.num(j.step)}` : "paused";
    if (active) return TP.phaseText(j.phase);
    if (j.state === "queued") return (j.attempt ? `waiting for a worker (retry ${j.attempt})` : "waiting for a worker") + (online() ? "" : " · none online");
    if (j.state === "completed") return j.started_at && j.finished_at ? `finished in ${TP.dur(j.finished_at - j.started_at)}` : "finished";
    if (j.state === "failed") return `failed${j.failure ? ` (${j.failure})` : ""}${j.reason ? ":" : ""}`; // the cause follows, visible
    if (j.state === "cancelled") return j.step ? `cancelled at step ${TP.num(j.step)}` : "cancelled (never started)";
    return "–";
  }

  function compareLink() {
    const a = $("compare-selected");
    a.href = `/compare?${[...selected].map((id) => `job=${id}`).join("&")}`;
    a.setAttribute("aria-disabled", selected.size < 1 ? "true" : "false");
    a.textContent = selected.size ? `Compare selected (${selected.size})` : "Compare selected";
  }

  let pending = false;
  function render() {
    if (pending) return; pending = true;
    requestAnimationFrame(() => { pending = false; renderNow(); });
  }
  function renderBody() {
    const all = [...jobs.values()].sort((a, b) => b.id - a.id);
    const list = all.filter(passes);
    if (view.sort && view.cols.includes(view.sort)) list.sort(compareBy(view.sort));
    body.replaceChildren(...grouped(list));
    if (!list.length) {
      const filtered = search.value || stateSel.value || list.length < all.length;
      body.append(TP.el("tr", {}, TP.el("td", { colspan: 13 + view.cols.length, class: "empty", text: filtered ? "No job matches these filters." : "No jobs yet. Press “Run demo” to train a tiny model, or “New job”." })));
    }
    return all;
  }
  // Rows under a heading per project (or per tag: a job with two tags shows under both).
  function grouped(list) {
    if (!groupSel.value) return list.map(row);
    const groups = new Map();
    for (const j of list) {
      const keys = groupSel.value === "project" ? [j.project || "default"] : ((j.tags || []).length ? j.tags : ["(no tag)"]);
      for (const k of keys) { if (!groups.has(k)) groups.set(k, []); groups.get(k).push(j); }
    }
    return [...groups.keys()].sort().flatMap((k) => [
      TP.el("tr", { class: "group-head" }, TP.el("th", { colspan: 13 + view.cols.length, scope: "rowgroup", text: `${k} · ${groups.get(k).length}` })),
      ...groups.get(k).map(row)]);
  }
  async function loadProjects() {
    const want = url.get("project") || projectSel.value;
    try {
      const ps = await TP.api("/api/projects");
      projectSel.replaceChildren(TP.el("option", { value: "", text: "All projects" }),
        ...ps.map((p) => TP.el("option", { value: p.project, text: `${p.project} (${p.jobs})` })));
      projectSel.value = want || "";
    } catch (e) { /* the filter stays as it is */ }
  }
  function renderNow() {
    renderColumns([...jobs.values()]);
    const list = renderBody();
    $("page-info").textContent = `${total ? offset + 1 : 0}–${Math.min(offset + list.length, total)} of ${TP.num(total)}`;
    $("prev").disabled = offset === 0;
    $("next").disabled = offset + PAGE >= total;
    let run = 0, q = 0; for (const j of list) { if (TP.ACTIVE.includes(j.state)) run++; if (j.state === "queued") q++; }
    $("counts").textContent = `${run} running · ${q} queued on this page`;
    renderNoWorker();
    syncUrl();
  }

  // Jobs wait and nothing can run them: say so, and how to start a worker.
  function online() { return [...agents.values()].filter((a) => a.state === "online").length; }
  function renderNoWorker() {
    const box = $("no-worker");
    const show = queued > 0 && online() === 0;
    box.hidden = !show;
    if (!show) return;
    const known = [...agents.values()].sort((a, b) => (b.seen_at || 0) - (a.seen_at || 0));
    box.replaceChildren(TP.el("strong", { text: `No worker is online: ${TP.num(queued)} queued job${queued === 1 ? " waits" : "s wait"}.` }), " ",
      known.length ? TP.el("span", {}, `The last one seen, ${known[0].name} (${known[0].state}), reported `, TP.rel(known[0].seen_at), ". ") : "",
      "Start a worker with ", TP.el("code", { text: `tokenpulse agent --server ${location.origin} --token-file agent_token` }),
      " (the agent token is in the server's data directory), or run ", TP.el("code", { text: "tokenpulse up" }), ", which has one built in. ",
      TP.el("a", { href: "/workers", text: "Workers" }));
  }
  let recount = null;
  function refreshFacts() { // queued count and agents, debounced: frames can come in bursts
    clearTimeout(recount);
    recount = setTimeout(async () => {
      try {
        const [ags, waiting] = await Promise.all([TP.api("/api/agents"), TP.api("/api/jobs?state=queued&limit=1")]);
        agents = new Map(ags.map((a) => [a.id, a])); queued = waiting.total; render();
      } catch (e) { /* the next frame or poll tries again */ }
    }, 300);
  }

  TP.live(["jobs", "agents"], (f) => {
    if (!loaded) return;
    if (f.type === "agent") { refreshFacts(); return; }
    if (f.type === "job") {
      const old = jobs.get(f.job.id);
      if (!old || old.state !== f.job.state) refreshFacts();
      if (old) {
        const ranOn = f.job.agent_id || (old.agent_id ?? old.last_agent_id); // a job that ends keeps its worker
        if (!matches(f.job) && offset === 0 && states().length) { jobs.delete(f.job.id); total -= 1; } else jobs.set(f.job.id, { ...old, ...f.job, last: { ...(old.last || {}), ...(f.job.last || {}) }, last_agent_id: ranOn });
        render();
      } else if (offset === 0 && matches(f.job) && (jobs.size < PAGE || f.job.id > Math.max(...jobs.keys()))) {
        jobs.set(f.job.id, f.job); total += 1;
        if (jobs.size > PAGE) jobs.delete(Math.min(...jobs.keys()));
        if (f.job.agent_id && !agents.has(f.job.agent_id)) load(); else render();
      }
    } else if (f.type === "heartbeat") {
      const j = jobs.get(f.job_id);
      if (j) {
        j.alive_at = f.alive_at;
        const t = body.querySelector(`tr[data-job="${f.job_id}"] time.hb`);
        if (t) { t.dataset.t = f.alive_at; t.title = TP.abs(f.alive_at); }
      }
    } else if (f.type === "alert") render();
  }, load);

  // Hours being lost now, by cause: the open slow verdicts' costs x each running job's ETA (GET /api/costs)
  async function refreshCosts() {
    const box = document.getElementById("costs");
    try {
      const c = await TP.api("/api/costs");
      const causes = Object.entries(c.by_cause).filter(([, h]) => h > 0).sort((a, b) => b[1] - a[1]);
      box.hidden = !causes.length;
      const n = new Set(c.jobs.map((x) => x.job_id)).size;
      box.textContent = causes.length ? `Being lost now over ${n} running job${n === 1 ? "" : "s"}: ${TP.dur(c.total_hours * 3600)} of their remaining time — ` +
        causes.map(([k, h]) => `${k} ${TP.dur(h * 3600)}`).join(" · ") + ". Each job's alert has its fix." : "";
    } catch (e) { /* the next tick tries again */ }
  }
  refreshCosts();
  setInterval(refreshCosts, 10000);
  TP.onAlert(() => { if (loaded) render(); }); // badges follow the open alerts
  setInterval(() => { if (loaded) refreshFacts(); }, 10000); // an agent that comes back says so only by heartbeats
  // live frames carry the listed metrics only: picked metric columns are read again every 10 s
  setInterval(() => { if (loaded && view.cols.some((c) => c.startsWith("last:"))) load(); }, 10000);
  let debounce = null;
  search.addEventListener("input", () => { clearTimeout(debounce); debounce = setTimeout(() => { offset = 0; load(); }, 200); });
  stateSel.addEventListener("change", () => { offset = 0; load(); });
  projectSel.addEventListener("change", () => { offset = 0; load(); });
  tagBox.addEventListener("input", () => { clearTimeout(debounce); debounce = setTimeout(() => { offset = 0; load(); }, 200); });
  groupSel.addEventListener("change", () => renderNow());
  loadProjects();
  $("prev").onclick = () => { offset = Math.max(0, offset - PAGE); load(); };
  $("next").onclick = () => { offset += PAGE; load(); };
  $("compare-selected").addEventListener("click", (e) => { if (!selected.size) e.preventDefault(); });
  $("demo").onclick = async () => {
    $("demo").disabled = true;
    try { const j = await TP.api("/api/jobs", { method: "POST", body: { name: "demo" } }); location.href = `/jobs/${j.id}`; }
    catch (e) { alert(e.message); $("demo").disabled = false; }
  };
})();
