// Chat page: messages rendered (replies as sanitized Markdown, markdown.js), sending,
// stop, edit and resend, regenerate, keyboard shortcuts; the page's state and start. The
// socket and the streamed reply are socket.js's, the conversation list and the title
// conversations.js's. Users' text is only ever set as textContent.
"use strict";

const $ = (id) => document.getElementById(id);
const TYPING_EVERY_MS = 3000; // at most one `typing` frame per this interval
const state = {
  conversations: [],
  current: null, // conversation id
  ws: null,
  reply: null, // {row, bubble, meta, text} of the reply being streamed
  interrupted: null, // the reply whose socket dropped: a `resume` frame carries it on
  retry: 0,
  dropped: false, // the socket went away unasked: resync the history when it is back
  lastTyping: 0,
  renderTimer: null,
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

// --- messages ------------------------------------------------------------------------
function clearMessages() {
  const box = $("messages");
  box.replaceChildren($("empty") || el("div"));
  $("empty").hidden = false;
}

function setBubble(bubble, role, text) {
  if (role === "assistant") bubble.replaceChildren(renderMarkdown(text));
  else bubble.textContent = text;
}

function addMessage(role, text, metaText, seq) {
  $("empty").hidden = true;
  const row = el("div", `msg ${role}`);
  if (seq !== undefined) row.dataset.seq = seq;
  const bubble = el("div", role === "assistant" ? "bubble markdown" : "bubble");
  setBubble(bubble, role, text);
  row.append(bubble);
  const foot = el("div", "foot");
  const meta = el("div", "meta", metaText || "");
  const actions = el("div", "actions");
  if (role === "user") actions.append(action("Edit", "edit", () => startEdit(row, text)));
  if (role === "assistant") actions.append(action("Regenerate", "regen", regenerate));
  foot.append(meta, actions);
  row.append(foot);
  $("messages").append(row);
  scrollDown();
  updateActions();
  return { row, bubble, meta };
}

function action(label, cls, onClick) {
  const b = el("button", `act ${cls}`, label);
  b.type = "button";
  b.addEventListener("click", onClick);
  return b;
}

// Edit needs a stored seq; only the last reply can be regenerated; nothing while streaming.
function updateActions() {
  const rows = [...document.querySelectorAll("#messages .msg")];
  const lastReply = rows.filter((r) => r.classList.contains("assistant")).pop();
  for (const row of rows) {
    const edit = row.querySelector(".act.edit");
    if (edit) edit.hidden = state.reply !== null || row.dataset.seq === undefined;
    const regen = row.querySelector(".act.regen");
    if (regen) regen.hidden = state.reply !== null || row !== lastReply;
  }
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

function storedMeta(m) {
  if (m.finish_reason === "cancelled") return "stopped";
  if (m.finish_reason === "error") return "no reply (error)";
  if (m.finish_reason === "length") return "cut at the token limit";
  return "";
}

function renderHistory(messages) {
  clearMessages();
  for (const m of messages) {
    if (m.role === "system") continue;
    const { row } = addMessage(m.role, m.content, storedMeta(m), m.seq);
    if (m.finish_reason === "error") row.classList.add("failed");
  }
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
  state.reply = null;
  state.interrupted = null;
  history.replaceState(null, "", `#${id}`);
  setTitle(conv.title || "Untitled chat");
  $("rename").hidden = false;
  renderHistory(conv.messages);
  renderList();
  setGenerating(false);
  connect(id);
}

// The stored history, when it may differ from what the page shows (after a turn, an
// error, a reconnect). A turn still committing (its question stored, its reply not yet) is
// waited for a few times.
async function resync(id = state.current, tries = 10, force = false) {
  let conv;
  try {
    conv = await api("GET", `/api/conversations/${id}`);
  } catch {
    return;
  }
  if (id !== state.current || state.reply) return;
  const msgs = conv.messages.filter((m) => m.role !== "system");
  const rows = [...document.querySelectorAll("#messages .msg")];
  const same =
    rows.length === msgs.length && rows.every((r, i) => r.classList.contains(msgs[i].role));
  if (same && !force) rows.forEach((r, i) => (r.dataset.seq = msgs[i].seq));
  else renderHistory(msgs);
  updateActions();
  const last = msgs[msgs.length - 1];
  if (last && last.role === "user" && tries > 0) setTimeout(() => resync(id, tries - 1, force), 400);
}

// --- editing a sent message ------------------------------------------------------------
function startEdit(row, text) {
  if (state.reply || row.classList.contains("editing")) return;
  row.classList.add("editing");
  const bubble = row.querySelector(".bubble");
  const box = el("textarea", "edit-box");
  box.value = text;
  box.setAttribute("aria-label", "Edit message");
  const save = el("button", "btn primary small-btn", "Save & send");
  save.type = "button";
  const cancel = el("button", "btn small-btn", "Cancel");
  cancel.type = "button";
  const bar = el("div", "edit-bar");
  bar.append(cancel, save);
  const editor = el("div", "editor");
  editor.append(box, bar);
  bubble.hidden = true;
  row.insertBefore(editor, bubble);
  const close = () => {
    editor.remove();
    bubble.hidden = false;
    row.classList.remove("editing");
  };
  cancel.addEventListener("click", close);
  save.addEventListener("click", () => {
    const content = box.value;
    if (!content.trim()) return;
    close();
    sendEdit(row, content);
  });
  box.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      save.click();
    } else if (e.key === "Escape") {
      e.stopPropagation();
      close();
    }
  });
  box.focus();
}

async function sendEdit(row, content) {
  const seq = Number(row.dataset.seq);
  if (!(await ensureSocket())) return;
  // Everything from the edited message on goes; the server cuts its copy back the same way.
  while (row.nextSibling) row.nextSibling.remove();
  row.remove();
  addMessage("user", content);
  beginReply({ type: "edit", seq, content });
}

function regenerate() {
  if (state.reply || !state.current) return;
  ensureSocket().then((ok) => {
    if (!ok) return;
    const rows = [...document.querySelectorAll("#messages .msg")];
    const last = rows[rows.length - 1];
    if (last && last.classList.contains("assistant")) last.remove();
    beginReply({ type: "regenerate" });
  });
}

function setGenerating(on) {
  $("send").hidden = on;
  $("stop").hidden = !on;
  document.body.classList.toggle("generating", on);
}

function stop() {
  if (state.reply && state.ws && state.ws.readyState === WebSocket.OPEN) {
    state.ws.send(JSON.stringify({ type: "cancel" }));
  }
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
    setTitle(conv.title || "Untitled chat");
    $("rename").hidden = false;
    await loadList();
  }
  if (!(await ensureSocket())) return;
  addMessage("user", text);
  beginReply({ type: "message", content: text });
}

function grow() {
  const t = $("input");
  t.style.height = "auto";
  t.style.height = Math.min(t.scrollHeight, 220) + "px";
}

// `typing` frames while the user writes, throttled: the server may bring the chat's cache
// back meanwhile. Putting the cursor in the message box (or coming back to a tab where it
// is) says the same a few seconds earlier than the first key.
function typing() {
  const now = Date.now();
  if (state.ws && state.ws.readyState === WebSocket.OPEN && now - state.lastTyping > TYPING_EVERY_MS) {
    state.lastTyping = now;
    state.ws.send(JSON.stringify({ type: "typing" }));
  }
}

// --- phone layout: the chat list slides in ----------------------------------------------
function openNav() {
  document.body.classList.add("nav-open");
  $("scrim").hidden = false;
  $("menu").setAttribute("aria-expanded", "true");
}

function closeNav() {
  document.body.classList.remove("nav-open");
  $("scrim").hidden = true;
  $("menu").setAttribute("aria-expanded", "false");
}

function onKey(e) {
  const mod = e.ctrlKey || e.metaKey;
  if (mod && e.shiftKey && e.code === "KeyO") {
    e.preventDefault();
    newChat();
  } else if (mod && !e.shiftKey && e.code === "KeyK") {
    e.preventDefault();
    $("search").focus();
    $("search").select();
  } else if (e.key === "Escape") {
    if (!$("title-edit").hidden) endRename(false);
    else if (state.reply) stop();
    else if (document.body.classList.contains("nav-open")) closeNav();
  }
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
    typing();
  });
  $("input").addEventListener("focus", typing);
  window.addEventListener("focus", () => {
    if (document.activeElement === $("input")) typing();
  });
  $("stop").addEventListener("click", stop);
  $("new-chat").addEventListener("click", newChat);
  $("search").addEventListener("input", renderList);
  $("rename").addEventListener("click", startRename);
  $("chat-title").addEventListener("dblclick", startRename);
  $("title-edit").addEventListener("keydown", (e) => {
    if (e.key === "Enter") endRename(true);
  });
  $("title-edit").addEventListener("blur", () => endRename(true));
  $("menu").addEventListener("click", () =>
    document.body.classList.contains("nav-open") ? closeNav() : openNav()
  );
  $("scrim").addEventListener("click", closeNav);
  document.addEventListener("keydown", onKey);
  window.addEventListener("hashchange", () => {
    const id = location.hash.slice(1);
    if (id && id !== state.current) openChat(id);
  });
  loadList()
    .then(() => {
      const id = location.hash.slice(1);
      if (id) openChat(id);
    })
    .catch((e) => showError(e.message));
}

init();
