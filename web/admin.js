// Admin page (shared chunks marked): pool gauges, live charts of the last minutes (uPlot, vendored), counters, and
// a sortable, filterable, paged table of conversations with their chunks by tier.
"use strict";

// The token is exchanged once (POST /admin/session) for an HttpOnly cookie; it is never put
// in a URL the server sees: a link may carry it as #token=..., which browsers do not send.
const $ = (id) => document.getElementById(id);
const POLL_MS = 1000;
const WINDOW_S = 300; // the charts show the last five minutes
const PAGE_SIZE = 50; // rows built per render, whatever the number of conversations
const COLORS = { gpu: "#22a06b", cpu: "#e8a33d", disk: "#3d8fe8", recomputed: "#d6455d", prefetched: "#7b61ff", ttft: "#5b5bd6" };

let timer = null;
const samples = []; // {t, gpu, cpu, cached, swapped, recomputed, prefetched, ttft}
let previous = null; // the last snapshot, for rates
let snapshot = null;
const table = { key: "idle_s", dir: 1, page: 0, filter: "" };
const charts = {};
const renderTimes = []; // ms per render, the last 100 (read by tests and the benchmark)

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

// --- pools and counters ----------------------------------------------------------------
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
  const info = el("div", "muted small", `${p.used} of ${p.total} blocks used · ${p.free} free`);
  card.append(head, bar, info);
  const kv = snapshot && snapshot.kv_bytes && snapshot.kv_bytes[name];
  if (kv && kv.sliding) {  // sliding layers keep only their window: the bytes per layer type
    const mib = (b) => `${(b / 2 ** 20).toFixed(1)} MiB`;
    card.append(el("div", "muted small kv-bytes", `KV: full layers ${mib(kv.full)} · sliding layers ${mib(kv.sliding)}`));
  }
  return card;
}

function renderCounters(counters) {
  const dl = $("counters");
  dl.replaceChildren();
  for (const [k, v] of Object.entries(counters)) {
    const item = el("div", "counter");
    item.append(el("dt", "", k.replaceAll("_", " ")), el("dd", "", String(v)));
    dl.append(item);
  }
}

// --- charts ----------------------------------------------------------------------------
function chartOptions(series, width, yLabel, yRange) {
  return {
    width,
    height: 200,
    legend: { live: false },
    cursor: { drag: { x: false, y: false } },
    scales: { x: { time: true }, y: yRange ? { range: yRange } : { auto: true } },
    axes: [
      { stroke: "#8a90a4", grid: { stroke: "rgba(128,128,128,0.15)" } },
      { stroke: "#8a90a4", grid: { stroke: "rgba(128,128,128,0.15)" }, label: yLabel, size: 60 },
    ],
    // Points too: a rate or a TTFT seen in one poll only is a single point, not a line.
    series: [{}, ...series.map(([label, color]) => ({ label, stroke: color, width: 2, points: { show: true, size: 4 } }))],
  };
}

function makeCharts() {
  const width = (id) => Math.max(260, $(id).clientWidth);
  charts.pools = new uPlot(
    chartOptions([["GPU", COLORS.gpu], ["CPU", COLORS.cpu], ["disk", COLORS.disk]], width("chart-pools"), "%", [0, 100]),
    [[], [], [], []],
    $("chart-pools")
  );
  charts.tokens = new uPlot(
    chartOptions(
      [
        ["cached (GPU)", COLORS.gpu],
        ["swapped in (CPU)", COLORS.cpu],
        ["recomputed", COLORS.recomputed],
        ["prefetched", COLORS.prefetched],
        ["read from disk", COLORS.disk],
      ],
      width("chart-tokens"),
      "tokens/s"
    ),
    [[], [], [], [], [], []],
    $("chart-tokens")
  );
  charts.ttft = new uPlot(chartOptions([["TTFT", COLORS.ttft]], width("chart-ttft"), "ms"), [[], []], $("chart-ttft"));
  window.addEventListener("resize", () => {
    for (const [name, chart] of Object.entries(charts)) {
      chart.setSize({ width: Math.max(260, $(`chart-${name}`).clientWidth), height: 200 });
    }
  });
}

function rate(now, before, key, dt) {
  if (!(key in now.counters)) return null; // a counter this engine does not report
  const d = now.counters[key] - (before.counters[key] || 0);
  return d >= 0 ? d / dt : null;
}

function addSample(snap) {
  const pct = (p) => (p.total ? (100 * p.used) / p.total : 0);
  const s = { t: snap.time, gpu: pct(snap.pools.gpu), cpu: pct(snap.pools.cpu), disk: snap.pools.disk ? pct(snap.pools.disk) : null };
  if (previous && snap.time > previous.time) {
    const dt = snap.time - previous.time;
    s.cached = rate(snap, previous, "cached_tokens", dt);
    s.swapped = rate(snap, previous, "swapped_in_tokens", dt);
    s.recomputed = rate(snap, previous, "recomputed_tokens", dt);
    s.prefetched = rate(snap, previous, "prefetched_tokens", dt);
    s.disk_read = rate(snap, previous, "disk_tokens", dt);
    const turns = snap.turns.count - previous.turns.count;
    s.ttft = turns > 0 ? (1000 * (snap.turns.ttft_sum_s - previous.turns.ttft_sum_s)) / turns : null;
  }
  previous = snap;
  samples.push(s);
  while (samples.length && samples[0].t < snap.time - WINDOW_S) samples.shift();
}

function renderCharts() {
  if (!charts.pools) makeCharts();
  const col = (k) => samples.map((s) => (s[k] === undefined ? null : s[k]));
  const t = col("t");
  charts.pools.setData([t, col("gpu"), col("cpu"), col("disk")]);
  charts.tokens.setData([t, col("cached"), col("swapped"), col("recomputed"), col("prefetched"), col("disk_read")]);
  charts.ttft.setData([t, col("ttft")]);
}

// --- the conversations table -------------------------------------------------------------
function idle(s) {
  if (s === null || s === undefined) return "–";
  if (s < 60) return `${s.toFixed(1)} s`;
  if (s < 3600) return `${(s / 60).toFixed(1)} min`;
  return `${(s / 3600).toFixed(1)} h`;
}

function withCounts(c) {
  const counts = { gpu: 0, cpu: 0, disk: 0, dropped: 0 };
  for (const t of c.chunks) counts[t] = (counts[t] || 0) + 1;
  return { ...c, ...counts };
}

function compare(a, b) {
  const { key, dir } = table;
  const x = a[key];
  const y = b[key];
  if (x === y) return a.id < b.id ? -1 : 1;
  if (x === null || x === undefined) return 1; // missing values last, either way
  if (y === null || y === undefined) return -1;
  if (typeof x === "string" || typeof y === "string") return dir * String(x).localeCompare(String(y));
  return dir * (x < y ? -1 : 1);
}

function row(c, chunkSize) {
  const tr = el("tr", "conv-row" + (c.running ? " running" : ""));
  tr.dataset.id = c.id;
  const id = el("td");
  const code = el("code", "conv-id", c.id.slice(0, 12));
  code.title = c.id;
  id.append(code);
  const num = (v) => el("td", "num", v);
  const state = el("td");
  if (c.running) state.append(el("span", "badge live", "running"));
  const holders = c.holders || [];
  const shared = holders.filter((n) => n > 1).length;
  if (shared) state.append(el("span", "badge shared", `${shared} shared`));
  const bar = el("td");
  const chunks = el("div", "chunks");
  c.chunks.forEach((tier, i) => {
    const n = holders[i] || 1;
    const cell = el("i", `chunk ${tier}` + (n > 1 ? " shared" : ""));
    cell.title =
      `chunk ${i}: tokens ${i * chunkSize}–${(i + 1) * chunkSize - 1} · ${tier}` +
      (n > 1 ? ` · shared by ${n} conversations, stored once` : "");
    chunks.append(cell);
  });
  bar.append(chunks);
  tr.append(
    id,
    el("td", "conv-name", c.title || ""),
    num(String(c.tokens)),
    num(String(c.gpu)),
    num(String(c.cpu)),
    num(String(c.disk)),
    num(String(c.dropped)),
    num(idle(c.idle_s)),
    num(c.retention === null || c.retention === undefined ? "–" : c.retention.toPrecision(3)),
    state,
    bar
  );
  return tr;
}

function renderTable() {
  if (!snapshot) return;
  const query = table.filter.toLowerCase();
  let convs = snapshot.conversations.map(withCounts);
  if (query) {
    convs = convs.filter((c) => c.id.toLowerCase().includes(query) || (c.title || "").toLowerCase().includes(query));
  }
  convs.sort(compare);
  const pages = Math.max(1, Math.ceil(convs.length / PAGE_SIZE));
  table.page = Math.min(table.page, pages - 1);
  const shown = convs.slice(table.page * PAGE_SIZE, (table.page + 1) * PAGE_SIZE);
  const body = $("convs");
  if (!shown.length) {
    const td = el("td", "muted", query ? "No conversation matches." : "No conversation holds cache yet.");
    td.colSpan = 10;
    const tr = el("tr");
    tr.append(td);
    body.replaceChildren(tr);
  } else {
    body.replaceChildren(...shown.map((c) => row(c, snapshot.chunk_size)));
  }
  $("conv-count").textContent = `${snapshot.conversations.length} in the engine`;
  $("page-info").textContent = `page ${table.page + 1} of ${pages} · ${convs.length} shown`;
  $("prev").disabled = table.page === 0;
  $("next").disabled = table.page >= pages - 1;
  for (const th of document.querySelectorAll("#conv-head th[data-key]")) {
    const on = th.dataset.key === table.key;
    th.classList.toggle("sorted", on);
    th.setAttribute("aria-sort", on ? (table.dir > 0 ? "ascending" : "descending") : "none");
  }
}

// --- the loop ----------------------------------------------------------------------------
function render(snap) {
  const t0 = performance.now();
  snapshot = snap;
  $("device").textContent = `${snap.device} · ${snap.cache_mode} · ${snap.eviction} eviction`;
  $("updated").textContent = `updated ${new Date().toLocaleTimeString()}`;
  $("pools").replaceChildren(...Object.entries(snap.pools).map(([k, v]) => pool(k, v)));
  const sharing = snap.sharing || { chunks: 0, saved_blocks: 0 };
  renderCounters({ ...snap.counters, shared_chunks: sharing.chunks, blocks_saved_by_sharing: sharing.saved_blocks });
  addSample(snap);
  renderCharts();
  renderTable();
  renderTimes.push(performance.now() - t0);
  if (renderTimes.length > 100) renderTimes.shift();
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

$("conv-head").addEventListener("click", (e) => {
  const th = e.target.closest("th[data-key]");
  if (!th) return;
  const key = th.dataset.key;
  // Numbers start largest first, text A to Z; a second click turns the order round.
  if (table.key === key) table.dir = -table.dir;
  else {
    table.key = key;
    table.dir = ["id", "title", "idle_s"].includes(key) ? 1 : -1;
  }
  table.page = 0;
  renderTable();
});
$("filter").addEventListener("input", () => {
  table.filter = $("filter").value.trim();
  table.page = 0;
  renderTable();
});
$("prev").addEventListener("click", () => {
  table.page = Math.max(0, table.page - 1);
  renderTable();
});
$("next").addEventListener("click", () => {
  table.page += 1;
  renderTable();
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
