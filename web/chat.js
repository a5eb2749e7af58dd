// Chat page: conversation list, streaming replies over /ws/chat/{id}, stop, history reload.
// Everything users or the model wrote is set with textContent, never parsed as HTML.
"use strict";

const $ = (id) => document.getElementById(id);
const state = {
  conversations: [],
  current: null, // conversation id
  ws: null,
  wsFor: null,
  reply: null, // {bubble, text, meta} of the reply being streamed
  retry: 0,
  lastTyping: 0,
};

function el(tag, cls, text) {
  const node = document.createElement(tag);
  if (cls) node.className = cls;
  if (text !== undefined) node.textContent = text;
  return node;
}

async function api(method, path, body) {
  const res = await fetch(path, {
    method,
    headers: body ? { "Content-Type": "application/json" } : {},
    body: body ? JSON.stringify(body) : undefined,
    credentials: "same-origin",
  });
  if (res.status === 204) return null;
  const data = await res.json().catch(() => ({}));
  if (!res.ok) throw new Error(data.message || `${method} ${path}: HTTP ${res.status}`);
  return data;
}

// --- banner and connection pill ------------------------------------------------------
function showError(message) {
  const b = $("banner");
  b.textContent = message;
  b.hidden = false;
  clearTimeout(showError.timer);
  showError.timer = setTimeout(() => (b.hidden = true), 8000);
}

function setConn(stateName, label) {
  const pill = $("conn");
  pill.dataset.state = stateName;
  pill.textContent = label;
}

// --- conversation list ---------------------------------------------------------------
function renderList() {
  const nav = $("conversations");
  nav.replaceChildren();
  for (const c of state.conversations) {
    const item = el("div", "conv" + (c.id === state.current ? " active" : ""));
    item.dataset.id = c.id;
    const title = el("button", "conv-title", c.title || "Untitled chat");
    title.type = "button";
    title.addEventListener("click", () => openChat(c.id));
    const del = el("button", "conv-del", "×");
    del.type = "button";
    del.title = "Delete chat";
    del.setAttribute("aria-label", "Delete chat");
    del.addEventListener("click", (e) => {
      e.stopPropagation();
      deleteChat(c.id);
    });
    item.append(title, del);
    nav.append(item);
  }
}

async function loadList() {
  const data = await api("GET", "/api/conversations");
  state.conversations = data.conversations;
  renderList();
}

async function deleteChat(id) {
  if (!confirm("Delete this chat and its history?")) return;
  try {
    await api("DELETE", `/api/conversations/${id}`);
  } catch (e) {
    return showError(e.message);
  }
  if (id === state.current) newChat();
  await loadList();
}

function newChat() {
  closeSocket();
  state.current = null;
  history.replaceState(null, "", "/");
  $("chat-title").textContent = "New chat";
  clearMessages();
  setConn("idle", "not connected");
  setGenerating(false);
  renderList();
  $("input").focus();
}

// --- messages ------------------------------------------------------------------------
function clearMessages() {
  const box = $("messages");
  box.replaceChildren($("empty") || el("div"));
  $("empty").hidden = false;
}

function addMessage(role, text, metaText) {
  $("empty").hidden = true;
  const row = el("div", `msg ${role}`);
  const bubble = el("div", "bubble", text);
  row.append(bubble);
  const meta = el("div", "meta", metaText || "");
  row.append(meta);
  $("messages").append(row);
  scrollDown();
  return { row, bubble, meta };
}

function scrollDown() {
  const box = $("messages");
  box.scrollTop = box.scrollHeight;
}

function describe(done) {
  const u = done.usage;
  const parts = [`${u.completion_tokens} tokens`];
  const reused = [];
  if (u.cached_tokens) reused.push(`${u.cached_tokens} on GPU`);
  if (u.swapped_in_tokens) reused.push(`${u.swapped_in_tokens} from CPU`);
  if (u.recomputed_tokens) reused.push(`${u.recomputed_tokens} recomputed`);
  if (reused.length) parts.push("context: " + reused.join(", "));
  parts.push(`first token ${Math.round(done.timing.ttft_ms)} ms`);
  parts.push(`total ${(done.timing.total_ms / 1000).toFixed(1)} s`);
  if (done.turns_left_out) {
    const n = done.turns_left_out;
    parts.push(`${n} earliest turn${n === 1 ? "" : "s"} beyond the model's memory`);
  }
  if (done.finish_reason === "cancelled") parts.unshift("stopped");
  if (done.finish_reason === "length") parts.unshift("cut at the token limit");
  return parts.join(" · ");
}

async function openChat(id) {
  if (id === state.current && state.ws) return;
  let conv;
  try {
    conv = await api("GET", `/api/conversations/${id}`);
  } catch (e) {
    showError(e.message);
    return newChat();
  }
  state.current = id;
  history.replaceState(null, "", `#${id}`);
  $("chat-title").textContent = conv.title || "Untitled chat";
  clearMessages();
  for (const m of conv.messages) {
    if (m.role === "system") continue;
    let meta = "";
    if (m.finish_reason === "cancelled") meta = "stopped";
    else if (m.finish_reason === "error") meta = "no reply (error)";
    else if (m.finish_reason === "length") meta = "cut at the token limit";
    const { row } = addMessage(m.role, m.content, meta);
    if (m.finish_reason === "error") row.classList.add("failed");
  }
  renderList();
  setGenerating(false);
  connect(id);
}

// --- socket --------------------------------------------------------------------------
function closeSocket() {
  if (state.ws) {
    state.ws.onclose = null;
    state.ws.close();
  }
  state.ws = null;
  state.wsFor = null;
}

function connect(id) {
  closeSocket();
  const proto = location.protocol === "https:" ? "wss" : "ws";
  const ws = new WebSocket(`${proto}://${location.host}/ws/chat/${id}`);
  state.ws = ws;
  state.wsFor = id;
  setConn("connecting", "connecting…");
  ws.onopen = () => {
    state.retry = 0;
    setConn("live", "connected");
  };
  ws.onmessage = (ev) => onFrame(JSON.parse(ev.data));
  ws.onclose = (ev) => onClose(ws, id, ev);
  return new Promise((resolve) => {
    ws.addEventListener("open", () => resolve(ws), { once: true });
    ws.addEventListener("close", () => resolve(null), { once: true });
  });
}

function onClose(ws, id, ev) {
  if (state.ws !== ws) return;
  state.ws = null;
  finishReply("connection lost");
  const reasons = {
    4401: "Not signed in: reload the page.",
    4403: "This chat belongs to someone else.",
    4404: "This chat does not exist any more.",
    4409: "This chat was opened in another tab. Select it in the list to continue here.",
  };
  if (reasons[ev.code]) {
    setConn("closed", ev.code === 4409 ? "opened elsewhere" : "closed");
    showError(reasons[ev.code]);
    if (ev.code === 4404) loadList().catch(() => {});
    return;
  }
  setConn("closed", "reconnecting…");
  const delay = Math.min(10000, 500 * 2 ** state.retry++);
  setTimeout(() => {
    if (state.current === id && !state.ws) connect(id);
  }, delay);
}

function onFrame(frame) {
  if (frame.type === "token") {
    if (!state.reply) state.reply = startReply();
    state.reply.text += frame.text;
    state.reply.bubble.textContent = state.reply.text;
    state.reply.row.classList.remove("pending");
    scrollDown();
  } else if (frame.type === "done") {
    const r = state.reply || startReply();
    r.meta.textContent = describe(frame);
    if (!r.text) r.bubble.textContent = frame.finish_reason === "cancelled" ? "" : "(empty reply)";
    finishReply();
    loadList().catch(() => {});
  } else if (frame.type === "error") {
    showError(frame.message);
    if (state.reply && frame.code !== "busy") finishReply("no reply (error)", true);
  }
}

function startReply() {
  const { row, bubble, meta } = addMessage("assistant", "");
  row.classList.add("pending");
  return { row, bubble, meta, text: "" };
}

function finishReply(metaText, failed) {
  if (state.reply) {
    state.reply.row.classList.remove("pending", "streaming");
    if (metaText && !state.reply.meta.textContent) state.reply.meta.textContent = metaText;
    if (failed) state.reply.row.classList.add("failed");
  }
  state.reply = null;
  setGenerating(false);
}

function setGenerating(on) {
  $("send").hidden = on;
  $("stop").hidden = !on;
  document.body.classList.toggle("generating", on);
}

// --- sending -------------------------------------------------------------------------
async function send(text) {
  if (!state.current) {
    let conv;
    try {
      conv = await api("POST", "/api/conversations", { title: text.slice(0, 60).trim() });
    } catch (e) {
      return showError(e.message);
    }
    state.current = conv.id;
    history.replaceState(null, "", `#${conv.id}`);
    $("chat-title").textContent = conv.title || "Untitled chat";
    await loadList();
  }
  if (!state.ws || state.ws.readyState !== WebSocket.OPEN) {
    if (!(await connect(state.current))) return showError("Could not connect to the chat.");
  }
  addMessage("user", text);
  state.reply = startReply();
  state.reply.row.classList.add("streaming");
  setGenerating(true);
  state.ws.send(JSON.stringify({ type: "message", content: text }));
}

function grow() {
  const t = $("input");
  t.style.height = "auto";
  t.style.height = Math.min(t.scrollHeight, 220) + "px";
}

function init() {
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    const text = $("input").value;
    if (!text.trim() || state.reply) return;
    $("input").value = "";
    grow();
    send(text);
  });
  $("input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("input").addEventListener("input", () => {
    grow();
    const now = Date.now();
    if (state.ws && state.ws.readyState === WebSocket.OPEN && now - state.lastTyping > 3000) {
      state.lastTyping = now;
      state.ws.send(JSON.stringify({ type: "typing" }));
    }
  });
  $("stop").addEventListener("click", () => {
    if (state.ws && state.ws.readyState === WebSocket.OPEN) state.ws.send(JSON.stringify({ type: "cancel" }));
  });
  $("new-chat").addEventListener("click", newChat);
  loadList()
    .then(() => {
      const id = location.hash.slice(1);
      if (id) openChat(id);
    })
    .catch((e) => showError(e.message));
}

init();
