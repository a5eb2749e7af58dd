"""The chat and admin pages in headless Chromium, against a real server and the bundled model.

One server and one browser for the module; the tests run in order and build on each other
(the page's chats, the owner whose token the tests also use over the API)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from bench.lib.harness import ROOT
from tests.app_fixtures import ADMIN, Server, auth, connect, say

pytestmark = pytest.mark.timeout(300)

CHROMIUM = os.environ.get("PENSIEVE_CHROMIUM", "/usr/bin/chromium")
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
# Screenshots land in tmp; with PENSIEVE_SCREENSHOTS=1 they also refresh docs/*.png.
SAVE_DOCS = os.environ.get("PENSIEVE_SCREENSHOTS") == "1"
DESKTOP = {"width": 1280, "height": 800}
PHONE = {"width": 390, "height": 844}
EVIL = '<script>window.pwned = 1</script><img src=x onerror="window.pwned = 2"><b>bold?</b>'

# Text that must never run, whether a user typed it or a model wrote it (and it is rendered
# as Markdown). Each tries to set window.pwned or open a dialog.
XSS = [
    "<script>window.pwned = 'script'</script>",
    "<img src=x onerror=\"window.pwned = 'img'\">",
    "<svg onload=\"window.pwned = 'svg'\"><circle r=5></circle></svg>",
    "<svg><script>window.pwned = 'svg-script'</script></svg>",
    "<iframe src=\"javascript:window.parent.pwned = 'iframe'\"></iframe>",
    "<iframe srcdoc=\"<script>parent.pwned = 'srcdoc'</script>\"></iframe>",
    "[click me](javascript:window.pwned='md-link')",
    "[click me](JaVaScRiPt:alert(1))",
    "<a href=\"javascript:alert('a')\">html link</a>",
    "[data](data:text/html;base64,PHNjcmlwdD5wYXJlbnQucHduZWQ9MTwvc2NyaXB0Pg==)",
    "![pixel](data:image/svg+xml;base64,PHN2ZyBvbmxvYWQ9YWxlcnQoMSk+)",
    "![x](x\" onerror=\"window.pwned='md-img')",
    "<details open ontoggle=\"window.pwned = 'details'\">x</details>",
    '<div style="background:url(javascript:alert(1))" onmouseover="window.pwned=\'div\'">hover</div>',
    "<math><mtext><table><mglyph><style><img src=x onerror=\"window.pwned='mxss'\">",
    '<form action="javascript:alert(1)"><button>go</button></form>',
    '<object data="javascript:alert(1)"></object><embed src="javascript:alert(1)">',
    "<body onload=\"window.pwned='body'\">",
    "**bold <img src=x onerror=\"window.pwned='inline'\"> text**",
    "```html\n<script>window.pwned = 'fence'</script>\n```",
    "`<img src=x onerror=\"window.pwned='code'\">`",
    "| a | b |\n|---|---|\n| <img src=x onerror=\"window.pwned='cell'\"> | [x](javascript:alert(1)) |",
    "<scr<script>ipt>window.pwned='split'</script>",
    "[unclosed link](javascript:alert(1)",
    "**unclosed bold <b onclick=\"window.pwned='b'\">x",
    "> quote <a href='javascript:alert(1)' onclick=alert(1)>q</a>",
    '<a href="&#106;avascript:alert(1)">entity</a>',
    "<noscript><p title=\"</noscript><img src=x onerror=window.pwned='noscript'>\">",
    '<meta http-equiv="refresh" content="0;url=javascript:alert(1)">',
    '<base href="javascript:alert(1)//"><a href="x">based</a>',
]
UNSAFE = (
    "script, iframe, object, embed, svg, math, img, form, style, meta, base, "
    "[onerror], [onload], [onclick], [onmouseover], [ontoggle], [style], "
    "a[href^='javascript' i], a[href^='data' i], a[href*='&#']"
)


def markdown_text(code: str) -> str:
    return f"Here is code:\n\n```python\n{code}\n```\n\n- one\n- two\n\n| a | b |\n|---|---|\n| 1 | 2 |\n"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("web")
    env = {
        "PENSIEVE_GPU_CACHE_CHUNKS": "16",
        "PENSIEVE_CPU_CACHE_CHUNKS": "16",
        "PENSIEVE_MAX_TOKENS_DEFAULT": "80",
        "PENSIEVE_TURNS_PER_MINUTE": "1000",
    }
    srv = Server(f"sqlite+aiosqlite:///{tmp}/pensieve.db", tmp / "server.log", env=env).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def owner(server) -> str:
    """The token of the owner the browser is signed in as."""
    return server.user("browser")


@pytest.fixture(scope="module")
def browser(server):
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: apt-get install chromium (make browser)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield browser
        browser.close()


def new_page(browser, server, owner, **context_options):
    """A page of a new browser context signed in as `owner`, that records page errors,
    dialogs and the frames its sockets send."""
    context = browser.new_context(**{"viewport": DESKTOP, **context_options})
    context.add_cookies([{"name": "pensieve_token", "value": owner, "url": server.url}])
    page = context.new_page()
    page.errors, page.dialogs, page.sent, page.received = [], [], [], []
    page.on("pageerror", lambda e: page.errors.append(str(e)))
    page.on("console", lambda m: m.type == "error" and page.errors.append(m.text))

    def dialog(d):
        page.dialogs.append(d.message)
        d.dismiss()

    page.on("dialog", dialog)
    page.on("websocket", lambda ws: ws.on("framesent", lambda f: page.sent.append(f)))
    page.on("websocket", lambda ws: ws.on("framereceived", lambda f: page.received.append(f)))
    page.set_default_timeout(45_000)
    return page


@pytest.fixture(scope="module")
def page(browser, server, owner):
    page = new_page(browser, server, owner, permissions=["clipboard-read", "clipboard-write"])
    yield page
    page.context.close()


def shot(page, tmp_path, name: str, full_page: bool = False) -> None:
    path = tmp_path / f"{name}.png"
    page.screenshot(path=str(path), full_page=full_page)
    if SAVE_DOCS:
        (ROOT / "docs").mkdir(exist_ok=True)
        shutil.copy(path, ROOT / "docs" / f"{name}.png")


def send(page, text: str) -> None:
    page.fill("#input", text)
    page.press("#input", "Enter")


def last(page, role: str):
    return page.locator(f".msg.{role}").last


def wait_done(page):
    """The last reply is finished (its meta line says how many tokens it had)."""
    last(page, "assistant").locator(".meta").filter(has_text="tokens").wait_for()
    page.wait_for_function("() => state.reply === null")


def clean(page) -> None:
    assert page.errors == [], page.errors
    assert page.dialogs == [], page.dialogs
    assert page.evaluate("window.pwned") is None


# The raw text of the streamed reply, each time the page re-renders it.
WATCH = """() => {
  window.seen = [];
  new MutationObserver(() => {
    if (state.reply && state.reply.text) window.seen.push(state.reply.text);
  }).observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true});
}"""


CHATS: list[str] = []  # ids of the chats the page made, oldest first


def test_message_streams_and_user_content_is_text(server, page, owner):
    page.goto(server.url + "/")
    page.evaluate(WATCH)
    send(page, EVIL + " Say hello.")
    wait_done(page)
    CHATS.append(page.evaluate("location.hash.slice(1)"))
    seen = page.evaluate("window.seen")
    stored = server.chat(owner, CHATS[0])["messages"]
    assert len(set(seen)) >= 2, seen  # rendered while it streamed, not once at the end
    assert all(b.startswith(a) for a, b in zip(seen, seen[1:], strict=False))
    # The user's markup is shown as text: no element made, no script run.
    user = last(page, "user").locator(".bubble")
    assert user.text_content() == EVIL + " Say hello."
    assert user.locator("*").count() == 0
    assert stored[0]["content"] == EVIL + " Say hello."
    clean(page)


def test_escape_stops_the_reply(server, page):
    send(page, "Write a very long story about a dragon and a knight, with many chapters.")
    page.wait_for_function("() => state.reply && state.reply.text.length > 0")
    page.keyboard.press("Escape")
    last(page, "assistant").locator(".meta").filter(has_text="stopped").wait_for()
    assert page.locator("#send").is_visible() and not page.locator("#stop").is_visible()


def test_stop_button_and_reload_shows_history(server, page):
    send(page, "Tell me a long tale about the sea.")
    page.wait_for_function("() => state.reply && state.reply.text.length > 0")
    page.click("#stop")
    last(page, "assistant").locator(".meta").filter(has_text="stopped").wait_for()
    page.wait_for_function("() => state.reply === null")
    before = [b.text_content() for b in page.locator(".msg .bubble").all()]
    assert len(before) == 6
    page.reload()
    page.wait_for_function("() => document.querySelectorAll('.msg .bubble').length === 6")
    after = [b.text_content() for b in page.locator(".msg .bubble").all()]
    assert after == before
    assert last(page, "assistant").locator(".meta").text_content() == "stopped"
    assert page.locator(".conv.active").count() == 1
    page.locator("#conn[data-state=live]").wait_for()
    clean(page)


def test_markdown_code_lists_tables_and_copy(server, page):
    code = 'def greet(name):\n    return f"hi {name}"'
    page.evaluate(
        """(text) => {
          const row = document.createElement('div');
          row.className = 'msg assistant probe';
          const bubble = document.createElement('div');
          bubble.className = 'bubble markdown';
          bubble.append(renderMarkdown(text));
          row.append(bubble);
          document.getElementById('messages').append(row);
        }""",
        markdown_text(code),
    )
    probe = page.locator(".probe .bubble")
    assert probe.locator(".code-block pre code.hljs").text_content().rstrip("\n") == code
    assert probe.locator(".code-block .hljs-keyword").count() >= 2  # def, return: highlighted
    assert probe.locator("ul > li").count() == 2
    assert probe.locator("table th").count() == 2 and probe.locator("table td").count() == 2
    probe.locator(".code-block .copy").click()
    probe.locator(".code-block .copy").filter(has_text="Copied").wait_for()
    assert page.evaluate("navigator.clipboard.readText()").rstrip("\n") == code
    page.evaluate("document.querySelector('.probe').remove()")
    # HTML inside Markdown is shown as the text it is.
    shown = page.evaluate(
        "(t) => { const d = document.createElement('div'); d.append(renderMarkdown(t)); return [d.textContent, d.querySelectorAll('b, i').length]; }",
        "Use <b>bold</b> and *em*",
    )
    assert shown == ["Use <b>bold</b> and em", 0] or shown[0].startswith("Use <b>bold</b> and em")
    clean(page)


def test_model_reply_is_rendered_as_markdown(server, page, tmp_path):
    """A real reply asked for code: its fence becomes a highlighted block with a copy button."""
    page.click("#new-chat")
    send(page, "Write a Python function that adds two numbers. Reply with a code block.")
    wait_done(page)
    CHATS.append(page.evaluate("location.hash.slice(1)"))
    reply = last(page, "assistant").locator(".bubble")
    stored = server.chat(page_owner(page), CHATS[-1])["messages"][-1]["content"]
    if "```" in stored:
        assert reply.locator(".code-block pre code").count() >= 1
        assert reply.locator(".code-block .copy").count() >= 1
    assert "```" not in reply.text_content()  # fences never show as text
    send(page, "Now list three uses of it as a Markdown list.")
    wait_done(page)
    shot(page, tmp_path, "chat")
    clean(page)


def page_owner(page) -> str:
    return next(c["value"] for c in page.context.cookies() if c["name"] == "pensieve_token")


def test_edit_resends_and_cuts_the_chat_back(server, page):
    """Edit the first message of the current chat: the rows after it go, the reply to the
    edited text streams, and the server's history (and cache) is cut back the same way."""
    owner = page_owner(page)
    cid = CHATS[-1]
    assert page.locator(".msg").count() == 4
    first = page.locator(".msg.user").first
    first.hover()
    first.locator(".act.edit").click()
    first.locator(".edit-box").fill("What is 2 + 2? Answer briefly.")
    first.locator(".edit-bar .btn.primary").click()
    wait_done(page)
    assert page.locator(".msg").count() == 2
    msgs = server.chat(owner, cid)["messages"]
    assert [m["role"] for m in msgs] == ["user", "assistant"]
    assert msgs[0]["content"] == "What is 2 + 2? Answer briefly."
    page.wait_for_function("() => document.querySelector('.msg.user').dataset.seq === '0'")
    conv = next(c for c in server.cache()["conversations"] if c["id"] == cid)
    assert conv["tokens"] == sum(m["tokens"] for m in msgs)  # the engine holds what SQL holds
    clean(page)


def test_regenerate_replaces_the_last_reply(server, page):
    owner, cid = page_owner(page), CHATS[-1]
    before = server.chat(owner, cid)["messages"]
    reply = last(page, "assistant")
    reply.hover()
    reply.locator(".act.regen").click()
    page.wait_for_function(
        "() => state.reply === null && document.querySelectorAll('.msg').length === 2"
    )
    wait_done(page)
    after = server.chat(owner, cid)["messages"]
    assert [m["role"] for m in after] == ["user", "assistant"]
    assert after[0]["content"] == before[0]["content"]
    assert after[1]["created"] > before[1]["created"]
    assert after[1]["content"] == before[1]["content"]  # greedy: the same answer again
    clean(page)


def test_typing_frames_are_throttled(server, page):
    page.sent.clear()
    page.locator("#input").press_sequentially("hello there", delay=40)
    typing = [f for f in page.sent if json.loads(f).get("type") == "typing"]
    assert len(typing) == 1
    page.wait_for_timeout(3100)
    page.locator("#input").press_sequentially(" again", delay=20)
    typing = [f for f in page.sent if json.loads(f).get("type") == "typing"]
    assert len(typing) == 2
    page.fill("#input", "")


def test_focusing_the_message_box_sends_typing(server, page):
    def typing() -> int:
        return sum(json.loads(f).get("type") == "typing" for f in page.sent)

    page.locator("#search").focus()
    page.wait_for_timeout(3100)  # past the throttle of the test before
    page.sent.clear()
    page.locator("#input").focus()  # the cursor in the box: a message is coming
    for _ in range(40):
        if typing():
            break
        page.wait_for_timeout(50)
    assert typing() == 1
    page.locator("#search").focus()
    page.locator("#input").focus()  # again within the interval: throttled
    page.wait_for_timeout(300)
    assert typing() == 1
    page.locator("#search").fill("")


def test_shortcuts(server, page):
    page.locator("#input").focus()
    page.keyboard.type("line one")
    page.keyboard.press("Shift+Enter")
    page.keyboard.type("line two")
    assert page.input_value("#input") == "line one\nline two"
    assert page.locator(".msg").count() == 2  # nothing was sent
    page.fill("#input", "")
    page.keyboard.press("Control+K")
    assert page.evaluate("document.activeElement.id") == "search"
    page.keyboard.press("Control+Shift+O")
    page.wait_for_function("() => location.hash === '' && !document.querySelector('.msg')")
    assert page.locator("#chat-title").text_content() == "New chat"
    assert page.evaluate("document.activeElement.id") == "input"
    shortcuts = page.locator(".shortcuts")
    assert "Ctrl+Shift+O" in shortcuts.text_content().replace(" ", "")
    clean(page)


def test_rename_search_and_delete(server, page):
    owner = page_owner(page)
    cid = CHATS[-1]
    page.locator(f".conv[data-id='{cid}'] .conv-title").click()
    page.wait_for_function(f"() => location.hash === '#{cid}' && state.ws")
    page.click("#rename")
    page.fill("#title-edit", "Arithmetic <b>notes</b>")
    page.press("#title-edit", "Enter")
    page.locator(f".conv[data-id='{cid}'] .conv-title").filter(has_text="Arithmetic").wait_for()
    assert server.chat(owner, cid)["title"] == "Arithmetic <b>notes</b>"
    assert page.locator("#chat-title").text_content() == "Arithmetic <b>notes</b>"
    assert page.locator("#chat-title b, .conv-title b").count() == 0
    # Search filters the list.
    total = page.locator(".conv").count()
    assert total >= 2
    page.fill("#search", "arithm")
    page.wait_for_function("() => document.querySelectorAll('.conv').length === 1")
    page.fill("#search", "no chat has this title")
    page.locator("#conversations .none").wait_for()
    page.fill("#search", "")
    page.wait_for_function(f"() => document.querySelectorAll('.conv').length === {total}")
    # Delete takes two clicks.
    victim = server.new_chat(owner, title="to delete")
    page.reload()
    item = page.locator(f".conv[data-id='{victim}']")
    item.hover()
    item.locator(".conv-del").click()
    assert (
        httpx.get(f"{server.url}/api/conversations/{victim}", headers=auth(owner)).status_code
        == 200
    )
    item.locator(".conv-del").click()
    page.wait_for_function(f"() => !document.querySelector(\".conv[data-id='{victim}']\")")
    assert (
        httpx.get(f"{server.url}/api/conversations/{victim}", headers=auth(owner)).status_code
        == 404
    )
    clean(page)


def test_reconnect_resumes_the_reply(server, page):
    """The socket drops mid-reply: the page reconnects by itself, the server hands the
    running reply to the new socket (a `resume` frame, then the rest), and the reply goes
    on in the same bubble to its end, as stored; the chat goes on."""
    owner, cid = page_owner(page), CHATS[-1]
    page.sent.clear()
    send(page, "Write a long poem about autumn leaves.")
    page.wait_for_function("() => state.reply && state.reply.text.length > 20")
    page.received.clear()
    page.evaluate("state.ws.close()")  # as a network drop: the page did not ask for it
    page.locator("#conn[data-state=live]").wait_for()
    wait_done(page)
    stored = server.chat(owner, cid)["messages"][-1]
    assert stored["role"] == "assistant" and stored["finish_reason"] != "cancelled"
    # The page asked once; the new socket got the text so far, then the rest.
    frames = [json.loads(f) for f in page.received]
    kinds = [f["type"] for f in frames]
    assert kinds.count("resume") == 1 and kinds[-1] == "done", kinds
    after = frames[kinds.index("resume") :]
    assert (
        after[0]["text"] + "".join(f["text"] for f in after if f["type"] == "token")
        == (stored["content"])
    )
    turns = [json.loads(f)["type"] for f in page.sent]
    assert turns.count("message") == 1 and "regenerate" not in turns
    # Shown whole, in one bubble, not marked as interrupted.
    assert page.locator(".msg.assistant").count() == page.locator(".msg.user").count()
    bubble = last(page, "assistant")
    assert "interrupted" not in bubble.locator(".meta").text_content()
    rendered = page.evaluate("(t) => renderMarkdown(t).textContent", stored["content"])
    assert bubble.locator(".bubble").text_content() == rendered
    send(page, "Thanks.")
    wait_done(page)
    clean(page)


def test_xss_corpus_never_runs(server, page, owner):
    """The corpus through the page's Markdown renderer, and as stored user messages and
    model replies of a chat the page opens."""
    page.evaluate(
        """(corpus) => {
          for (const text of corpus) {
            const bubble = document.createElement('div');
            bubble.className = 'bubble markdown xss';
            bubble.append(renderMarkdown(text));
            document.getElementById('messages').append(bubble);
          }
        }""",
        XSS,
    )
    rendered = page.locator(".xss")
    assert rendered.count() == len(XSS)
    assert page.locator(f".xss :is({UNSAFE})").count() == 0
    for link in page.locator(".xss a").all():  # the links that remain go nowhere harmful
        href = link.get_attribute("href") or ""
        assert not href.strip().lower().startswith(("javascript", "data", "vbscript")), href
    # Whatever handlers survived would fire on these (links aside: they would navigate).
    page.evaluate(
        """() => document.querySelectorAll('.xss *').forEach((e) => {
          e.dispatchEvent(new MouseEvent('mouseover', {bubbles: true}));
          if (e.tagName !== 'A') e.click();
        })"""
    )
    # Chats whose stored history holds the corpus, from both sides, via the OpenAI API (a
    # few items a chat: the model's window is small here).
    for n, start in enumerate(range(0, len(XSS), 5)):
        items = XSS[start : start + 5]
        messages = [{"role": "user", "content": f"corpus part {n}"}]
        messages.append({"role": "assistant", "content": "ok"})
        for text in items:
            messages += [{"role": "user", "content": text}, {"role": "assistant", "content": text}]
        messages.append({"role": "user", "content": "ok"})
        r = httpx.post(
            server.url + "/v1/chat/completions",
            json={"model": "smollm2-135m-instruct", "messages": messages, "max_tokens": 1},
            headers=auth(owner),
            timeout=120,
        )
        assert r.status_code == 200, r.text
        chats = httpx.get(server.url + "/api/conversations", headers=auth(owner)).json()
        cid = next(c["id"] for c in chats["conversations"] if c["title"] == f"corpus part {n}")
        page.goto(f"{server.url}/#{cid}")
        page.wait_for_function(
            f"() => state.current === '{cid}' && document.querySelectorAll('.msg').length === {2 * len(items) + 4}"
        )
        users = page.locator(".msg.user .bubble").all()
        assert [u.text_content() for u in users[1:-1]] == items  # shown as typed
        assert page.locator(".msg.user .bubble *").count() == 0
        assert page.locator(f".msg.assistant .bubble :is({UNSAFE})").count() == 0
        page.evaluate(
            """() => document.querySelectorAll('.msg.assistant .bubble *').forEach((e) => {
              e.dispatchEvent(new MouseEvent('mouseover', {bubbles: true}));
              if (e.tagName !== 'A') e.click();
            })"""
        )
    page.wait_for_timeout(500)
    clean(page)


def test_dark_mode_and_phone_layout(server, browser, owner, tmp_path):
    cid = CHATS[-1]
    looks = {}
    for name, scheme, viewport in [
        ("chat-dark", "dark", DESKTOP),
        ("chat-phone", "light", PHONE),
        ("chat-phone-dark", "dark", PHONE),
    ]:
        phone = viewport is PHONE
        page = new_page(
            browser,
            server,
            owner,
            viewport=viewport,
            color_scheme=scheme,
            is_mobile=phone,
            has_touch=phone,
        )
        page.goto(f"{server.url}/#{cid}")
        page.locator(".msg.assistant .bubble").first.wait_for()
        looks[name] = page.evaluate("getComputedStyle(document.documentElement).backgroundColor")
        if phone:
            # The chat list is off screen until the menu opens it; nothing overflows sideways.
            assert page.locator("#menu").is_visible()
            assert page.locator("#sidebar").bounding_box()["x"] < 0
            assert page.evaluate("document.documentElement.scrollWidth") <= PHONE["width"]
            box = page.locator("#composer").bounding_box()
            assert box["x"] >= 0 and box["x"] + box["width"] <= PHONE["width"]
            shot(page, tmp_path, name)
            page.click("#menu")
            page.wait_for_function(
                "() => document.getElementById('sidebar').getBoundingClientRect().x >= 0"
            )
            page.locator("#scrim").click(position={"x": 370, "y": 400})
            page.wait_for_function(
                "() => document.getElementById('sidebar').getBoundingClientRect().right <= 0"
            )
        else:
            assert not page.locator("#menu").is_visible()
            shot(page, tmp_path, name)
        clean(page)
        page.context.close()
    assert looks["chat-dark"] == looks["chat-phone-dark"] != looks["chat-phone"]


def test_admin_shows_chunks_move_between_tiers(server, page, tmp_path):
    cid = CHATS[0]  # the idlest chat: its chunks leave the GPU first
    page.goto(server.url + "/admin#token=" + ADMIN)  # a fragment never reaches the server
    page.wait_for_url(server.url + "/admin")  # the token left the address bar for a cookie
    row = page.locator(f".conv-row[data-id='{cid}']")
    row.locator(".chunk").first.wait_for()

    async def other_chats():
        token = server.user("load")
        for i in range(4):
            other = server.new_chat(token)
            async with connect(server, other, token) as ws:
                await say(ws, f"Tell me a fact about the number {i}.", max_tokens=40)
                await say(ws, "Another one.", max_tokens=8)  # its context comes from the cache

    # Playwright's sync API owns this thread's event loop: drive the chats from another.
    with ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, other_chats()).result(timeout=240)
    # The idle chat's chunks left the GPU tier; the page shows it without a reload.
    page.wait_for_function(
        f"""() => document.querySelectorAll(".conv-row[data-id='{cid}'] .chunk.cpu, .conv-row[data-id='{cid}'] .chunk.dropped").length > 0""",
        timeout=30_000,
    )
    assert page.locator(".pool[data-tier=gpu] .gauge-fill").count() == 1
    # The chats' rendered prompts agree on their first chunk (the template's system part):
    # it is stored once, and marked so.
    page.locator(".conv-row .chunk.shared").first.wait_for(timeout=30_000)
    assert "shared" in page.locator(".legend").text_content()
    # The charts have points: pool use every poll, token rates and TTFT from the turns.
    page.wait_for_function("() => charts.pools.data[0].length >= 3")
    has = page.evaluate(
        """() => ({
          pools: charts.pools.data[1].some((v) => v > 0),
          cached: charts.tokens.data[1].some((v) => v > 0),
          ttft: charts.ttft.data[1].some((v) => v > 0),
          prefetched: charts.tokens.series[4].label,
        })"""
    )
    assert has == {"pools": True, "cached": True, "ttft": True, "prefetched": "prefetched"}
    assert page.locator(".uplot").count() == 3
    shot(page, tmp_path, "admin", full_page=True)
    clean(page)


def test_admin_table_sorts_pages_and_stays_responsive(server, page):
    """Enough conversations for three pages: the table sorts by any column, pages, filters,
    and each render of the whole page stays short."""
    token = server.user("many")

    async def many(n: int):
        async with httpx.AsyncClient(timeout=120) as client:
            sem = asyncio.Semaphore(4)

            async def one(i: int):
                async with sem:
                    r = await client.post(
                        server.url + "/v1/chat/completions",
                        json={
                            "model": "smollm2-135m-instruct",
                            "messages": [{"role": "user", "content": f"#{i}"}],
                            "max_tokens": 1,
                        },
                        headers=auth(token),
                    )
                    assert r.status_code == 200, r.text

            await asyncio.gather(*(one(i) for i in range(n)))

    with ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, many(110)).result(timeout=240)
    total = len(server.cache()["conversations"])
    assert total > 110
    page.wait_for_function(f"() => snapshot && snapshot.conversations.length === {total}")
    assert page.locator(".conv-row").count() == 50  # one page of rows, however many there are
    assert page.locator("#page-info").text_content().startswith("page 1 of 3")

    def column(i: int) -> list[str]:
        return page.locator(f"#convs tr td:nth-child({i})").all_text_contents()

    page.click("#conv-head th[data-key=tokens]")
    tokens = [int(t) for t in column(3)]
    assert tokens == sorted(tokens, reverse=True) and tokens[0] > tokens[-1]
    assert page.locator("#conv-head th[data-key=tokens]").get_attribute("aria-sort") == "descending"
    page.click("#conv-head th[data-key=tokens]")
    tokens = [int(t) for t in column(3)]
    assert tokens == sorted(tokens)
    page.click("#conv-head th[data-key=idle_s]")
    idle = page.evaluate(
        "() => [...document.querySelectorAll('#convs tr')].map((r) => snapshot.conversations.find((c) => c.id === r.dataset.id).idle_s)"
    )
    assert idle == sorted(idle)
    page.click("#next")
    page.click("#next")
    assert page.locator("#page-info").text_content().startswith("page 3 of 3")
    assert 0 < page.locator(".conv-row").count() <= 50
    page.fill("#filter", "#10")  # titles #10, #100..#109
    page.wait_for_function("() => document.querySelectorAll('.conv-row').length === 11")
    page.fill("#filter", "")
    page.wait_for_timeout(2500)
    times = page.evaluate("renderTimes.slice(-3)")
    assert max(times) < 250, times
    clean(page)


def test_admin_asks_for_a_token(server, page):
    page.context.clear_cookies()
    page.goto(server.url + "/admin")
    page.locator("#login").wait_for()
    page.fill("#token", "wrong")
    page.click("#login button")
    page.locator("#login-error").filter(has_text="not accepted").wait_for()
    page.fill("#token", ADMIN)
    page.click("#login button")
    page.locator(".pool").first.wait_for()
