"use strict";
(() => {
  const body = document.getElementById("workers-body");
  let agents = [];
  async function load() { agents = await TP.api("/api/agents"); render(); }
  function render() {
    body.replaceChildren(...agents.map((a) => TP.el("tr", {},
      TP.el("td", { text: `${a.name} (#${a.id})` }), TP.el("td", { text: a.host }), TP.el("td", { text: a.device }),
      TP.el("td", {}, TP.el("span", { class: `badge ${a.state}`, text: a.state })),
      TP.el("td", {}, ...a.jobs.map((j) => TP.el("a", { href: `/jobs/${j}`, text: `#${j} ` }))),
      TP.el("td", { class: a.state === "online" ? TP.heartbeatClass(a.seen_at) : "", text: TP.ago(a.seen_at), title: TP.abs(a.seen_at) }))));
    if (!agents.length) body.append(TP.el("tr", {}, TP.el("td", { colspan: 6, class: "empty", text: "No agents registered." })));
  }
  TP.live(["agents", "jobs"], () => load(), load);
  setInterval(render, 2000);
})();
