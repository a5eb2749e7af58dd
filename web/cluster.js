// Admin page, cluster section: every replica's health, pools and the conversations it holds
// (GET /api/admin/cluster). Kept apart from admin.js; shown only when the server is a replica.
"use strict";

(() => {
  const POLL_MS = 2000;
  const LISTED = 40; // conversations shown per replica

  function el(tag, cls, text) {
    const node = document.createElement(tag);
    if (cls) node.className = cls;
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function poolText(name, p) {
    if (!p) return `${name} –`;
    const pct = p.total ? Math.round((100 * p.used) / p.total) : 0;
    return `${name} ${p.used}/${p.total} (${pct}%)`;
  }

  function replicaRow(r) {
    const row = el("div", "replica-row");
    row.dataset.replica = r.id;
    const head = el("div", "replica-head");
    head.append(el("code", "conv-id", r.id));
    const health = r.alive ? r.health || "ok" : "down";
    head.append(el("span", health === "ok" ? "badge live" : "badge", health));
    if (r.self) head.append(el("span", "muted small", "(this replica)"));
    const pools = r.pools || {};
    head.append(
      el("span", "muted small", `pid ${r.pid ?? "–"}`),
      el("span", "muted small", `${poolText("GPU", pools.gpu)} · ${poolText("CPU", pools.cpu)}`),
      el("span", "muted small", `${r.conversations ?? 0} conversations`)
    );
    if (!r.alive && r.seen_s_ago != null) head.append(el("span", "muted small", `last seen ${r.seen_s_ago} s ago`));
    row.append(head);
    const held = r.held || [];
    if (held.length) {
      const list = el("details");
      list.append(el("summary", "muted small", `holds ${held.length} shown of ${r.conversations}`));
      for (const c of held.slice(0, LISTED)) {
        const line = el("div", "muted small", `GPU ${c.gpu} · CPU ${c.cpu} · dropped ${c.dropped} · ${c.tokens} tokens`);
        const id = el("code", "conv-id", c.id.slice(0, 12));
        id.title = c.id;
        line.prepend(id, " ");
        list.append(line);
      }
      row.append(list);
    }
    return row;
  }

  async function tick() {
    // Only once admin.js has signed in (the dashboard is shown): a fetch before that is a 401.
    if (document.getElementById("dash").hidden) return setTimeout(tick, POLL_MS / 4);
    try {
      const res = await fetch("/api/admin/cluster", { credentials: "same-origin", cache: "no-store" });
      if (res.ok) {
        const body = await res.json();
        const card = document.getElementById("cluster-card");
        card.hidden = body.directory === "disabled";
        const note = body.directory === "ok" ? "" : ` · directory ${body.directory}`;
        document.getElementById("cluster-note").textContent = `seen from ${body.replica}${note}`;
        document.getElementById("cluster").replaceChildren(...body.replicas.map(replicaRow));
      }
    } catch (e) {
      // The main view reports connection trouble; this section just waits for the next poll.
    }
    setTimeout(tick, POLL_MS);
  }

  tick();
})();
