// Admin page: pool gauges per tier and each conversation's chunks by tier (shared chunks
// marked), polled live.
"use strict";

// The token is exchanged once (POST /admin/session) for an HttpOnly cookie; it is never put
// in a URL the server sees: a link may carry it as #token=..., which browsers do not send.
const $ = (id) => document.getElementById(id);
const POLL_MS = 1000;
let timer = null;

function el(tag, cls, text) {
  const node = document.createElement(tag);
  if (cls) node.className = cls;
  if (text !== undefined) node.textContent = text;
  return node;
}

async function login(token) {
  const res = await fetch("/admin/session", {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify({ token }),
    credentials: "same-origin",
  });
  return res.ok;
}

async function fetchCache() {
  const res = await fetch("/api/admin/cache", { credentials: "same-origin", cache: "no-store" });
  if (res.status === 401) return null;
  if (!res.ok) throw new Error(`HTTP ${res.status}`);
  return res.json();
}

function pool(name, p) {
  const card = el("div", "card pool");
  card.dataset.tier = name;
  const pct = p.total ? (100 * p.used) / p.total : 0;
  const head = el("div", "pool-head");
  head.append(el("h2", "", `${name.toUpperCase()} pool`), el("span", "pool-pct", `${pct.toFixed(0)}%`));
  const bar = el("div", "gauge");
  const fill = el("div", `gauge-fill ${name}`);
  fill.style.width = `${pct}%`;
  bar.append(fill);
  const info = el("div", "muted small", `${p.used} of ${p.total} chunks used · ${p.free} free`);
  card.append(head, bar, info);
  return card;
}

function idle(s) {
  if (s === null || s === undefined) return "–";
  if (s < 60) return `${s.toFixed(1)} s`;
  if (s < 3600) return `${(s / 60).toFixed(1)} min`;
  return `${(s / 3600).toFixed(1)} h`;
}

function conversation(c, chunkSize) {
  const row = el("div", "conv-row" + (c.running ? " running" : ""));
  row.dataset.id = c.id;
  const counts = { gpu: 0, cpu: 0, dropped: 0 };
  for (const t of c.chunks) counts[t] = (counts[t] || 0) + 1;
  const holders = c.holders || [];
  const shared = holders.filter((n) => n > 1).length;
  const head = el("div", "conv-row-head");
  const name = el("code", "conv-id", c.id.slice(0, 12));
  name.title = c.id;
  head.append(name);
  if (c.title) head.append(el("span", "conv-name", c.title));
  if (c.running) head.append(el("span", "badge live", "running"));
  head.append(
    el("span", "muted small", `${c.tokens} tokens · ${c.chunks.length} chunks of ${chunkSize}`),
    el("span", "muted small", `GPU ${counts.gpu} · CPU ${counts.cpu} · dropped ${counts.dropped}`),
    el("span", "muted small", `idle ${idle(c.idle_s)}`)
  );
  if (shared) head.append(el("span", "badge shared", `${shared} shared`));
  const bar = el("div", "chunks");
  c.chunks.forEach((tier, i) => {
    const n = holders[i] || 1;
    const cell = el("i", `chunk ${tier}` + (n > 1 ? " shared" : ""));
    cell.title =
      `chunk ${i}: tokens ${i * chunkSize}–${(i + 1) * chunkSize - 1} · ${tier}` +
      (n > 1 ? ` · shared by ${n} conversations, stored once` : "");
    bar.append(cell);
  });
  row.append(head, bar);
  return row;
}

function render(snap) {
  $("device").textContent = `${snap.device} · ${snap.cache_mode} · ${snap.eviction} eviction`;
  $("updated").textContent = `updated ${new Date().toLocaleTimeString()}`;
  const pools = $("pools");
  pools.replaceChildren(...Object.entries(snap.pools).map(([k, v]) => pool(k, v)));
  const dl = $("counters");
  dl.replaceChildren();
  const sharing = snap.sharing || { chunks: 0, saved_blocks: 0 };
  const shown = { ...snap.counters, shared_chunks: sharing.chunks, blocks_saved_by_sharing: sharing.saved_blocks };
  for (const [k, v] of Object.entries(shown)) {
    const item = el("div", "counter");
    item.append(el("dt", "", k.replaceAll("_", " ")), el("dd", "", String(v)));
    dl.append(item);
  }
  const convs = $("convs");
  const rows = snap.conversations.map((c) => conversation(c, snap.chunk_size));
  if (!rows.length) rows.push(el("p", "muted", "No conversation holds cache yet."));
  convs.replaceChildren(...rows);
}

async function tick() {
  try {
    const snap = await fetchCache();
    if (snap === null) return showLogin("");
    $("login").hidden = true;
    $("dash").hidden = false;
    render(snap);
  } catch (e) {
    $("updated").textContent = `update failed: ${e.message}`;
  }
  timer = setTimeout(tick, POLL_MS);
}

function showLogin(message) {
  clearTimeout(timer);
  $("dash").hidden = true;
  $("login").hidden = false;
  $("login-error").textContent = message;
  $("token").focus();
}

$("login").addEventListener("submit", async (e) => {
  e.preventDefault();
  const ok = await login($("token").value.trim()).catch(() => false);
  $("token").value = "";
  if (!ok) return showLogin("That token was not accepted.");
  tick();
});

async function start() {
  const fragment = new URLSearchParams(location.hash.slice(1));
  const token = fragment.get("token");
  if (token) {
    history.replaceState(null, "", location.pathname); // out of the address bar and history
    if (!(await login(token).catch(() => false))) return showLogin("That token was not accepted.");
  }
  tick();
}

start();
