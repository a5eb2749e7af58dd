// Chat page: the chat's socket (connect, reconnect after a drop, the server's frames) and
// the reply it streams into the page (throttled Markdown renders, resume after a
// reconnect). Loaded before chat.js, whose page state and helpers (state, $, addMessage,
// resync, ...) these functions use when they run.
"use strict";

function closeSocket() {
  if (state.ws) {
    state.ws.onclose = null;
    state.ws.close();
  }
  state.ws = null;
}

function connect(id) {
  closeSocket();
  const proto = location.protocol === "https:" ? "wss" : "ws";
  const ws = new WebSocket(`${proto}://${location.host}/ws/chat/${id}`);
  state.ws = ws;
  setConn("connecting", "connecting…");
  ws.onopen = () => {
    state.retry = 0;
    setConn("live", "connected");
    if (state.dropped) {
      state.dropped = false;
      resync(id, 10, true); // the partial reply the server kept, or one that ended meanwhile
    }
  };
  ws.onmessage = (ev) => onFrame(JSON.parse(ev.data));
  ws.onclose = (ev) => onClose(ws, id, ev);
  return new Promise((resolve) => {
    ws.addEventListener("open", () => resolve(ws), { once: true });
    ws.addEventListener("close", () => resolve(null), { once: true });
  });
}

async function ensureSocket() {
  if (state.ws && state.ws.readyState === WebSocket.OPEN) return true;
  if (await connect(state.current)) return true;
  showError("Could not connect to the chat.");
  return false;
}

function onClose(ws, id, ev) {
  if (state.ws !== ws) return;
  state.ws = null;
  const streaming = state.reply !== null;
  // The server keeps the reply going for a while: a `resume` frame on the next connection
  // carries it on in this same bubble.
  state.interrupted = finishReply(streaming ? "interrupted: connection lost" : undefined);
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
  state.dropped = true;
  setConn("closed", "reconnecting…");
  const delay = Math.min(10000, 300 * 2 ** state.retry++);
  setTimeout(() => {
    if (state.current === id && !state.ws) connect(id);
  }, delay);
}

function onFrame(frame) {
  if (frame.type === "token") {
    if (!state.reply) state.reply = startReply();
    state.reply.text += frame.text;
    state.reply.row.classList.remove("pending");
    scheduleRender();
  } else if (frame.type === "resume") {
    resumeReply(frame.text);
  } else if (frame.type === "done") {
    const r = state.reply || startReply();
    renderReply(r);
    r.meta.textContent = describe(frame);
    if (!r.text) r.bubble.textContent = frame.finish_reason === "cancelled" ? "" : "(empty reply)";
    finishReply();
    resync();
    loadList().catch(() => {});
  } else if (frame.type === "error") {
    showError(frame.message);
    if (state.reply) {
      finishReply("no reply (error)", true);
      resync(); // what the server kept: a refused edit or message leaves the chat as it was
    }
  }
}

// Re-rendering Markdown on every token would be quadratic in busy streams: at most every
// 50 ms, and once more at the end.
function scheduleRender() {
  if (state.renderTimer) return;
  state.renderTimer = setTimeout(() => {
    state.renderTimer = null;
    if (state.reply) renderReply(state.reply);
  }, 50);
}

function renderReply(r) {
  const box = $("messages");
  const atBottom = box.scrollHeight - box.scrollTop - box.clientHeight < 40;
  setBubble(r.bubble, "assistant", r.text);
  if (atBottom) scrollDown();
}

function startReply() {
  const { row, bubble, meta } = addMessage("assistant", "");
  row.classList.add("pending");
  return { row, bubble, meta, text: "" };
}

// A reconnect while the reply was still generating: the server sends the text so far, then
// the rest as tokens. The interrupted bubble goes on if the page still shows it (a resync
// may have redrawn the chat meanwhile: then a new one).
function resumeReply(text) {
  const old = state.interrupted;
  state.interrupted = null;
  const r = old && old.row.isConnected ? old : startReply();
  r.text = text;
  r.meta.textContent = "";
  r.row.classList.remove("failed", "pending");
  r.row.classList.add("streaming");
  state.reply = r;
  renderReply(r);
  setGenerating(true);
  updateActions();
}

function beginReply(frame) {
  state.reply = startReply();
  state.reply.row.classList.add("streaming");
  setGenerating(true);
  updateActions();
  state.ws.send(JSON.stringify(frame));
}

function finishReply(metaText, failed) {
  const r = state.reply;
  state.interrupted = null;
  state.reply = null;
  clearTimeout(state.renderTimer);
  state.renderTimer = null;
  if (r) {
    renderReply(r);
    r.row.classList.remove("pending", "streaming");
    if (metaText && !r.meta.textContent) r.meta.textContent = metaText;
    if (failed) r.row.classList.add("failed");
  }
  setGenerating(false);
  updateActions();
  return r;
}
