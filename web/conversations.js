// Chat page: the conversation list (search, open, delete, new chat) and the open chat's
// title (rename). Loaded before chat.js, whose page state and helpers (state, $, el, api,
// showError) these functions use when they run. Titles are only ever set as textContent.
"use strict";

// --- conversation list ---------------------------------------------------------------
function renderList() {
  const nav = $("conversations");
  const query = $("search").value.trim().toLowerCase();
  const shown = state.conversations.filter(
    (c) => !query || (c.title || "Untitled chat").toLowerCase().includes(query)
  );
  nav.replaceChildren(...shown.map(listItem));
  if (!shown.length) nav.append(el("p", "muted small none", query ? "No chat matches." : "No chats yet."));
}

function listItem(c) {
  const item = el("div", "conv" + (c.id === state.current ? " active" : ""));
  item.dataset.id = c.id;
  const title = el("button", "conv-title", c.title || "Untitled chat");
  title.type = "button";
  title.title = c.title || "Untitled chat";
  title.addEventListener("click", () => {
    closeNav();
    openChat(c.id);
  });
  const del = el("button", "conv-del", "×");
  del.type = "button";
  del.title = "Delete chat";
  del.setAttribute("aria-label", "Delete chat");
  del.addEventListener("click", (e) => {
    e.stopPropagation();
    // A second click within a few seconds confirms.
    if (!item.classList.contains("confirm")) {
      item.classList.add("confirm");
      del.textContent = "Delete?";
      setTimeout(() => {
        item.classList.remove("confirm");
        del.textContent = "×";
      }, 4000);
      return;
    }
    deleteChat(c.id);
  });
  item.append(title, del);
  return item;
}

async function loadList() {
  const data = await api("GET", "/api/conversations");
  state.conversations = data.conversations;
  renderList();
}

async function deleteChat(id) {
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
  setTitle("New chat");
  $("rename").hidden = true;
  clearMessages();
  setConn("idle", "not connected");
  setGenerating(false);
  renderList();
  closeNav();
  $("input").focus();
}

// --- title and rename ----------------------------------------------------------------
function setTitle(text) {
  $("chat-title").textContent = text;
  document.title = `${text} · Pensieve`;
}

function startRename() {
  if (!state.current) return;
  const input = $("title-edit");
  input.value = $("chat-title").textContent;
  $("chat-title").hidden = true;
  $("rename").hidden = true;
  input.hidden = false;
  input.focus();
  input.select();
}

async function endRename(save) {
  const input = $("title-edit");
  if (input.hidden) return;
  input.hidden = true;
  $("chat-title").hidden = false;
  $("rename").hidden = !state.current;
  const title = input.value.trim();
  if (!save || !title || title === $("chat-title").textContent || !state.current) return;
  try {
    const conv = await api("PATCH", `/api/conversations/${state.current}`, { title });
    setTitle(conv.title);
    await loadList();
  } catch (e) {
    showError(e.message);
  }
}
