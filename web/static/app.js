// Shared helpers: the REST client (with the CSRF header cookie sessions need), a websocket that
// reconnects and tells the page to refill from REST, the header's alert badge and browser
// notifications, relative times that tick, and number formatting with units.
"use strict";
const TP = (() => {
  async function api(path, opts = {}) {
    const init = { method: opts.method || "GET", headers: { "X-TokenPulse-CSRF": "1" } };
    if (opts.body !== undefined) {
      init.headers["Content-Type"] = "application/json";
      init.body = JSON.stringify(opts.body);
    }
    const r = await fetch(path, init);
    if (r.status === 401) { location.href = "/login?next=" + encodeURIComponent(location.pathname + location.search); throw new Error("login"); }
    const data = r.status === 204 ? null : await r.json().catch(() => null);
    if (!r.ok) {
      const d = data && data.detail;
      const err = new Error(typeof d === "string" ? d : (d && d.message) || r.statusText);
      err.field = d && d.field; err.errors = (d && d.errors) || []; err.status = r.status;
      throw err;
    }
    return data;
  }

  // ---- live: one websocket per page --------------------------------------------------------------
  // topics: ["jobs"], ["job:3"]...; onFrame(frame); onOpen() runs at every (re)connect so the page
  // can fetch from REST whatever it missed while disconnected. "alerts" is always subscribed: the
  // header badge and notifications live here.
  const openAlerts = new Map(); // id -> alert
  const alertListeners = [];
  function onAlert(fn) { alertListeners.push(fn); }

  function live(topics, onFrame, onOpen) {
    let delay = 500, first = true;
    const dot = document.getElementById("conn");
    const all = [...new Set([...topics, "alerts"])];
    function setDot(on, text) {
      if (!dot) return;
      dot.classList.toggle("on", on); dot.title = text; dot.setAttribute("aria-label", text);
      const label = dot.querySelector(".conn-text"); if (label) label.textContent = on ? "live" : "offline";
    }
    // The server gone: a banner anyone sees (not only the small dot), with the time of the last data,
    // so frozen numbers are not taken for live ones. Shown after a moment (a quick reconnect is quiet).
    let lastData = null, bannerTimer = null;
    function banner(show) {
      let b = document.getElementById("offline-banner");
      if (!show) { clearTimeout(bannerTimer); bannerTimer = null; if (b) b.hidden = true; document.body.classList.remove("offline"); return; }
      if (bannerTimer) return; // already on its way
      bannerTimer = setTimeout(() => {
        bannerTimer = null;
        if (!b) { b = el("div", { id: "offline-banner", class: "offline-banner", role: "alert" }); document.body.prepend(b); }
        b.replaceChildren(el("strong", { text: "The server is not answering." }), " The numbers on this page are from ",
          lastData ? rel(lastData) : "before it went away", lastData ? ` (${new Date(lastData * 1000).toLocaleTimeString("en-GB")})` : "",
          "; reconnecting… The page refills when it is back.");
        b.hidden = false; document.body.classList.add("offline");
      }, 1500);
    }
    function connect() {
      const proto = location.protocol === "https:" ? "wss" : "ws";
      const ws = new WebSocket(`${proto}://${location.host}/ws?topics=${all.join(",")}`);
      ws.onopen = async () => {
        delay = 500; setDot(true, "live: updates arrive as they happen");
        lastData = Date.now() / 1000; banner(false);
        const reconnect = !first; first = false;
        try { await Promise.all([refillAlerts(!reconnect), onOpen ? onOpen(reconnect) : null]); }
        catch (e) { if (e.message !== "login") console.warn("refill failed:", e.message); }
      };
      ws.onmessage = (m) => {
        const f = JSON.parse(m.data);
        lastData = Date.now() / 1000;
        if (f.type === "alert") { handleAlert(f.alert, true); alertListeners.forEach((fn) => fn(f.alert)); }
        onFrame(f);
      };
      ws.onclose = (ev) => {
        if (ev.code === 4401) { location.href = "/login?next=" + encodeURIComponent(location.pathname + location.search); return; }
        setDot(false, "reconnecting… (the page refills from the server when it is back)");
        if (!document.getElementById("offline-banner") || document.getElementById("offline-banner").hidden) banner(true);
        setTimeout(connect, delay); delay = Math.min(delay * 2, 5000);
      };
    }
    connect();
  }

  async function refillAlerts(initial) {
    const list = await api("/api/alerts?state=open&limit=1000");
    const known = new Set(openAlerts.keys());
    openAlerts.clear();
    for (const a of list) { openAlerts.set(a.id, a); if (!initial && !known.has(a.id)) notify(a); }
    renderBadge();
    alertListeners.forEach((fn) => fn(null));
  }

  function handleAlert(a, live) {
    const isNew = a.state === "open" && !openAlerts.has(a.id);
    if (a.state === "open") openAlerts.set(a.id, a); else openAlerts.delete(a.id);
    renderBadge();
    if (isNew && live) notify(a);
  }

  function renderBadge() {
    const b = document.getElementById("alert-count");
    if (!b) return;
    const n = openAlerts.size;
    b.hidden = n === 0;
    b.textContent = `⚠ ${n}`;
    b.title = n ? [...openAlerts.values()].slice(0, 10).map((a) => `job ${a.job_id ?? "–"}: ${a.kind} — ${a.message.split("\n")[0]}`).join("\n") : "";
    b.setAttribute("aria-label", `${n} open alert${n === 1 ? "" : "s"}`);
    b.href = "/alerts?state=open"; // every open alert, across jobs (the Alerts page)
  }

  function notify(a) {
    if (!("Notification" in window) || Notification.permission !== "granted") return;
    try {
      const n = new Notification(`tokenpulse: job ${a.job_id ?? ""} ${a.kind}`, { body: a.message.slice(0, 200), tag: `alert-${a.id}` });
      n.onclick = () => { window.focus(); if (a.job_id) location.href = `/jobs/${a.job_id}#alerts`; };
    } catch (e) { /* some browsers only allow notifications from a service worker */ }
  }

  function askNotifications() {
    const btn = document.getElementById("notify");
    if (!btn) return;
    if (!("Notification" in window) || Notification.permission !== "default") { btn.hidden = true; return; }
    btn.hidden = false;
    btn.onclick = async () => { await Notification.requestPermission(); btn.hidden = true; };
  }

  // ---- formatting --------------------------------------------------------------------------------
  const nf = new Intl.NumberFormat("en-US");
  function num(x, digits = 0) {
    if (x === null || x === undefined || Number.isNaN(Number(x))) return "–";
    return Number(x).toLocaleString("en-US", { maximumFractionDigits: digits, minimumFractionDigits: digits });
  }
  function sig(x, n = 4) {
    if (x === "nan" || x === "inf" || x === "-inf") return x === "nan" ? "NaN" : x; // a non-finite latest value
    if (x === null || x === undefined || !isFinite(x)) return "–";
    const v = Number(x);
    return Math.abs(v) >= 1e5 || (Math.abs(v) < 1e-3 && v !== 0) ? v.toExponential(2) : String(Number(v.toPrecision(n)));
  }
  // One formatter per unit, used by figures, legends and axes alike. Thousands and up get a
  // k/M/G prefix with 3 significant digits (8.92 ktok/s, 10.5 ktok/s): never "8,915 tok/s" beside "10.5 ktok/s".
  function compact(x, unit = "") { // 12.3 k tok/s
    if (x === null || x === undefined || !isFinite(x)) return "–";
    const a = Math.abs(x);
    const [d, s] = a >= 1e9 ? [1e9, " G"] : a >= 1e6 ? [1e6, " M"] : a >= 1e3 ? [1e3, " k"] : [1, " "];
    const v = x / d, av = Math.abs(v);
    const text = v.toLocaleString("en-US", { maximumFractionDigits: av < 10 ? 2 : av < 100 ? 1 : 0 });
    return `${text}${unit ? s + unit : s.trim()}`.trim();
  }
  // Small numbers (learning rates): below 0.01 always as 2.00e-4 / 1.97e-3, never "0.00197" beside
  // "2.00e-4"; a plain "0" rather than "0.00e+0".
  function small(x, d = 2) {
    if (x === null || x === undefined || !isFinite(x)) return "–";
    const v = Number(x), a = Math.abs(v);
    if (v === 0) return "0";
    return a >= 1e-2 && a < 1e4 ? String(Number(v.toPrecision(d + 1))) : v.toExponential(d);
  }
  function axis(x, digits = 3) { // one tick label: 500, 1.5k, 10k, 2.5M
    if (x === null || x === undefined) return "";
    digits = typeof digits === "number" && digits >= 1 && digits <= 21 ? Math.round(digits) : 3; // .map() passes an index
    const a = Math.abs(x);
    if (a >= 1e6) return `${Number((x / 1e6).toPrecision(digits))}M`;
    if (a >= 1e3) return `${Number((x / 1e3).toPrecision(digits))}k`;
    if (a !== 0 && a < 1e-2) return small(x, Math.max(0, digits - 1)).replace(/\.?0+e/, "e");
    return String(Number(x.toPrecision(digits)));
  }
  // A whole axis' labels: as few digits as keep neighbouring ticks apart (737.5 / 738 / 738.5, never
  // 737 / 737 / 736).
  function ticks(vals, fmt = axis) {
    let out = [];
    for (let d = 2; d <= 7; d++) {
      out = vals.map((x) => (x === null || x === undefined ? "" : fmt(x, d)));
      const shown = out.filter((x) => x !== "");
      if (new Set(shown).size === shown.length) return out;
    }
    return out;
  }
  // A logged metric's unit from its name, for the charts of metrics tokenpulse does not know:
  // fractions as percentages, times in seconds, rates per second, memory in MiB.
  function metricFormat(key) {
    const leaf = key.split("/").pop();
    if (/(^|_)(frac|fraction|ratio)$|_frac_|padding_frac/.test(leaf)) return { unit: "%", value: (v) => (v === null || v === undefined || !isFinite(v) ? "–" : `${num(100 * v, Math.abs(v) < 0.1 ? 2 : 1)} %`), axis: (v, d) => axis(100 * v, d) };
    if (/tokens_per_s(ec(ond)?)?$/.test(leaf)) return { unit: "tok/s", value: (v) => compact(v, "tok/s"), axis };
    if (/_per_s(ec(ond)?)?$/.test(leaf)) return { unit: "/s", value: (v) => compact(v, "/s"), axis };
    if (/(^|_)(runtime|time|seconds|duration)$|_s$/.test(leaf)) return { unit: "s", value: (v) => (v === null || v === undefined || !isFinite(v) ? "–" : `${sig(v, 3)} s`), axis };
    if (/_(mb|mib)$/.test(leaf)) return { unit: "MiB", value: (v) => bytesMB(v), axis };
    if (/(^|_)(lr|learning_rate)$/.test(leaf)) return { unit: "", value: (v) => small(v, 3), axis };
    return { unit: "", value: (v) => (v !== null && v !== undefined && Math.abs(v) < 1e-2 && v !== 0 ? small(v, 3) : sig(v)), axis };
  }
  // Tick spacing for step axes: whole steps only.
  const STEP_INCRS = [1, 2, 5, 10, 20, 25, 50, 100, 200, 250, 500, 1e3, 2e3, 2500, 5e3, 1e4, 2e4, 25e3, 5e4, 1e5, 2e5, 25e4, 5e5, 1e6, 2e6, 25e5, 5e6, 1e7, 2e7, 5e7, 1e8];
  function bytesMB(mb) { return mb === null || mb === undefined ? "–" : mb >= 1024 ? `${num(mb / 1024, 2)} GiB` : `${num(mb, 0)} MiB`; }
  function dur(s) {
    if (s === null || s === undefined || !isFinite(s)) return "–";
    s = Math.max(0, Math.round(s));
    if (s < 60) return `${s} s`;
    if (s < 3600) return `${Math.floor(s / 60)} min ${s % 60} s`;
    if (s < 86400) return `${Math.floor(s / 3600)} h ${Math.floor((s % 3600) / 60)} min`;
    return `${Math.floor(s / 86400)} d ${Math.floor((s % 86400) / 3600)} h`;
  }
  function ago(t) { // coarse: "12 s ago", "7 min ago", "3 h 5 min ago", "2 d ago" (exact time on hover)
    if (!t) return "never";
    const d = Math.max(0, Date.now() / 1000 - t);
    if (d < 1) return "just now";
    if (d < 60) return `${Math.floor(d)} s ago`;
    if (d < 3600) return `${Math.floor(d / 60)} min ago`;
    if (d < 86400) return `${Math.floor(d / 3600)} h ${Math.floor((d % 3600) / 60)} min ago`;
    return `${Math.floor(d / 86400)} d ago`;
  }
  function abs(t) { return t ? new Date(t * 1000).toLocaleString("en-GB", { dateStyle: "medium", timeStyle: "medium" }) : ""; }
  function phaseText(p) {
    if (!p) return "–";
    let s = p.name;
    if (p.total) s += ` ${nf.format(Math.round(p.done || 0))}/${nf.format(Math.round(p.total))}${p.unit ? " " + p.unit : ""}`;
    else if (p.done !== undefined && p.done !== null) s += ` ${nf.format(Math.round(p.done))}${p.unit ? " " + p.unit : ""}`;
    if (p.detail) s += ` · ${p.detail}`;
    return s;
  }
  function el(tag, attrs = {}, ...kids) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs)) {
      if (v === undefined || v === null || v === false) continue;
      if (k === "class") e.className = v; else if (k === "text") e.textContent = v;
      else if (k.startsWith("on")) e.addEventListener(k.slice(2), v); else e.setAttribute(k, v === true ? "" : v);
    }
    for (const k of kids) if (k !== null && k !== undefined && k !== "") e.append(k);
    return e;
  }
  // A <time> that says "12 s ago" and shows the absolute time on hover; ticks on its own.
  function rel(t, opts = {}) {
    return el("time", { class: `rel${opts.hb ? " hb " + heartbeatClass(t) : ""}`, "data-t": t || "", datetime: t ? new Date(t * 1000).toISOString() : null,
      title: t ? abs(t) : "", "data-hb": opts.hb ? "1" : null, text: t ? ago(t) : (opts.none || "–") });
  }
  function heartbeatClass(t) {
    if (!t) return "hb-none";
    const age = Date.now() / 1000 - t;
    return age < 15 ? "hb-ok" : age < 60 ? "hb-warn" : "hb-bad";
  }
  function tick() {
    for (const e of document.querySelectorAll("time.rel[data-t]")) {
      const t = Number(e.dataset.t);
      if (!t) continue;
      const text = ago(t);
      if (e.textContent !== text) e.textContent = text;
      if (e.dataset.hb) e.className = `rel hb ${heartbeatClass(t)}`;
    }
    for (const e of document.querySelectorAll("[data-stuck-since]")) {
      const text = `Stuck ${dur(Date.now() / 1000 - Number(e.dataset.stuckSince))}${e.dataset.stuckRest}`;
      if (e.textContent !== text) e.textContent = text;
    }
  }
  // A stall's headline ("Stuck 30 s in fetch_batch ...") as written when the alert opened, kept
  // current while it is open: an element whose text the ticker above rewrites every second.
  const STUCK = /^Stuck (\d+(?:\.\d+)?) (s|min|h)\b/;
  function headline(text, a, attrs = {}) {
    const m = STUCK.exec(text);
    if (!m || a.state === "cleared") return el("span", { ...attrs, text });
    // the agent says since when (data.stuck_since); else the headline's figure, as of its last update
    const since = (a.data && a.data.stuck_since) || (a.updated_at || a.created_at || Date.now() / 1000) - Number(m[1]) * { s: 1, min: 60, h: 3600 }[m[2]];
    const rest = text.slice(m[0].length);
    return el("span", { ...attrs, "data-stuck-since": since, "data-stuck-rest": rest, text: `Stuck ${dur(Date.now() / 1000 - since)}${rest}` });
  }
  setInterval(tick, 1000);

  // A running job whose stall alert is open: its live figures are the last healthy ones. The jobs
  // list and the job page mark them stale by this one rule.
  function stallOf(jobId) {
    for (const a of openAlerts.values()) if (a.job_id === jobId && a.kind === "stalled") return a.message.split("\n")[0];
    return null;
  }
  // A failure's reason leads with its root cause (the file and row, or the innermost frame and the
  // exception): that first line is what lists and headlines show; the rest (a traceback, the last
  // output) is shown once, in monospace, on the job page.
  function reasonParts(reason) {
    const lines = String(reason || "").split("\n");
    const i = lines.findIndex((l) => l.trim());
    if (i < 0) return { head: "", rest: "" };
    return { head: lines[i].trim(), rest: lines.slice(i + 1).join("\n").replace(/^\s*\n/, "").trimEnd() };
  }
  const ACTIVE = ["running", "starting"];
  const FINAL = ["completed", "failed", "cancelled"];

  // A 422's field errors on a form: each beside its input (inputFor(field) finds it), the rest in errBox.
  function formErrors(form, errBox, inputFor) {
    function clear() {
      errBox.textContent = "";
      for (const x of form.querySelectorAll(".invalid")) { x.classList.remove("invalid"); x.removeAttribute("aria-invalid"); }
      for (const x of form.querySelectorAll(".field-error")) x.remove();
    }
    function show(e) {
      clear();
      let first = null;
      const rest = [];
      for (const fe of e.errors || []) {
        const input = fe.field && fe.field !== "body" ? inputFor(fe.field) : null;
        if (!input || !input.closest) { rest.push(fe.field && fe.field !== "body" ? `${fe.field}: ${fe.message}` : fe.message); continue; }
        input.classList.add("invalid"); input.setAttribute("aria-invalid", "true");
        const id = `${input.id}-error`;
        if (!document.getElementById(id)) input.closest(".field").append(el("span", { id, class: "field-error", role: "alert", text: fe.message }));
        input.setAttribute("aria-describedby", `${input.id}-help ${id}`);
        const det = input.closest("details"); if (det) det.open = true;
        first = first || input;
      }
      errBox.textContent = rest.length ? rest.join("; ") : first ? `Please fix the highlighted field${(e.errors || []).length > 1 ? "s" : ""}.` : e.message;
      if (first) first.focus();
    }
    return { clear, show };
  }
  document.addEventListener("DOMContentLoaded", askNotifications);
  if (document.readyState !== "loading") askNotifications();
  return { api, formErrors, live, onAlert, openAlerts, num, sig, compact, small, axis, ticks, metricFormat, stallOf, headline, reasonParts, STEP_INCRS, bytesMB, dur, ago, abs, rel, phaseText, el, heartbeatClass, tick, ACTIVE, FINAL };
})();
// Terminal control codes (colours, tqdm's cursor-up ESC[A) out of a log line stored before the agent
// dropped them (tokenpulse/terminal.py, the same rule).
// eslint-disable-next-line no-control-regex
TP.stripControl = (s) => String(s).replace(/\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[@-Z\\^_]|\x9b[0-?]*[ -/]*[@-~]/g, "").replace(/[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]/g, "");
// A metrics event of the agent's system samples (worker/agent/sysmetrics.py: every name sys/...).
TP.isSystem = (values) => { for (const k in values) return k.startsWith("sys/"); return false; };
// A run's colour, from its id alone: the same job has the same colour on every page and in every
// comparison (the golden angle spreads neighbouring ids far apart on the hue circle).
TP.jobColor = (id) => `hsl(${Math.round((Number(id) * 137.508) % 360)}, 70%, ${Number(id) % 2 ? 42 : 52}%)`;
TP.jobColorA = (id, alpha) => TP.jobColor(id).replace("hsl(", "hsla(").replace(")", `, ${alpha})`);
// localStorage that never throws (private mode, a full quota): a lost preference is not an error.
TP.pref = {
  get(key, dflt) { try { const v = localStorage.getItem(key); return v === null ? dflt : JSON.parse(v); } catch (e) { return dflt; } },
  set(key, v) { try { localStorage.setItem(key, JSON.stringify(v)); } catch (e) { /* not kept */ } },
};
