// Shared helpers: the REST client (with the CSRF header cookie sessions need), a websocket that
// reconnects and tells the page to refill from REST, and formatting with units.
"use strict";
const TP = (() => {
  async function api(path, opts = {}) {
    const init = { method: opts.method || "GET", headers: { "X-TokenPulse-CSRF": "1" } };
    if (opts.body !== undefined) {
      init.headers["Content-Type"] = "application/json";
      init.body = JSON.stringify(opts.body);
    }
    const r = await fetch(path, init);
    if (r.status === 401) { location.href = "/login?next=" + encodeURIComponent(location.pathname); throw new Error("login"); }
    const data = r.status === 204 ? null : await r.json().catch(() => null);
    if (!r.ok) {
      const d = data && data.detail;
      const err = new Error(typeof d === "string" ? d : (d && d.message) || r.statusText);
      err.field = d && d.field; err.errors = (d && d.errors) || []; err.status = r.status;
      throw err;
    }
    return data;
  }

  // topics: ["jobs"], ["job:3"]...; onFrame(frame); onOpen() runs at every (re)connect so the
  // page can fetch what it missed while disconnected.
  function live(topics, onFrame, onOpen) {
    let delay = 500;
    const dot = document.getElementById("conn");
    function connect() {
      const proto = location.protocol === "https:" ? "wss" : "ws";
      const ws = new WebSocket(`${proto}://${location.host}/ws?topics=${topics.join(",")}`);
      ws.onopen = () => { delay = 500; if (dot) { dot.classList.add("on"); dot.title = "live"; } if (onOpen) onOpen(); };
      ws.onmessage = (m) => onFrame(JSON.parse(m.data));
      ws.onclose = () => {
        if (dot) { dot.classList.remove("on"); dot.title = "reconnecting…"; }
        setTimeout(connect, delay); delay = Math.min(delay * 2, 10000);
      };
    }
    connect();
  }

  const nf = new Intl.NumberFormat("en-US");
  function num(x, digits = 0) {
    if (x === null || x === undefined || Number.isNaN(x)) return "–";
    return x.toLocaleString("en-US", { maximumFractionDigits: digits, minimumFractionDigits: digits });
  }
  function sig(x, n = 4) { return x === null || x === undefined ? "–" : Number(x).toPrecision(n); }
  function dur(s) {
    if (s === null || s === undefined || !isFinite(s)) return "–";
    s = Math.max(0, Math.round(s));
    if (s < 60) return `${s} s`;
    if (s < 3600) return `${Math.floor(s / 60)} min ${s % 60} s`;
    return `${Math.floor(s / 3600)} h ${Math.floor((s % 3600) / 60)} min`;
  }
  function ago(t) { return t ? `${dur(Date.now() / 1000 - t)} ago` : "never"; }
  function abs(t) { return t ? new Date(t * 1000).toLocaleString() : ""; }
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
      if (k === "class") e.className = v; else if (k === "text") e.textContent = v;
      else if (k.startsWith("on")) e.addEventListener(k.slice(2), v); else e.setAttribute(k, v);
    }
    for (const k of kids) e.append(k);
    return e;
  }
  function heartbeatClass(t) {
    if (!t) return "hb-none";
    const age = Date.now() / 1000 - t;
    return age < 15 ? "hb-ok" : age < 60 ? "hb-warn" : "hb-bad";
  }
  return { api, live, num, sig, dur, ago, abs, phaseText, el, heartbeatClass };
})();
