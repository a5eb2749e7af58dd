"""The chat and admin pages in headless Chromium, against a real server and the bundled model."""

from __future__ import annotations

import asyncio
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.app_fixtures import ADMIN, ROOT, Server, connect, say

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
EVIL = '<script>window.pwned = 1</script><img src=x onerror="window.pwned = 2"><b>bold?</b>'


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("web")
    env = {
        "PENSIEVE_GPU_CACHE_CHUNKS": "16",
        "PENSIEVE_CPU_CACHE_CHUNKS": "16",
        "PENSIEVE_MAX_TOKENS_DEFAULT": "120",
    }
    srv = Server(f"sqlite+aiosqlite:///{tmp}/pensieve.db", tmp / "server.log", env=env).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def page(server, tmp_path_factory):
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: apt-get install chromium (make browser)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        context = browser.new_context(viewport={"width": 1280, "height": 800})
        page = context.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.errors = errors
        page.set_default_timeout(60_000)
        yield page
        browser.close()


def shot(page, tmp_path, name: str) -> None:
    path = tmp_path / f"{name}.png"
    page.screenshot(path=str(path))
    if SAVE_DOCS:
        (ROOT / "docs").mkdir(exist_ok=True)
        shutil.copy(path, ROOT / "docs" / f"{name}.png")


def send(page, text: str) -> None:
    page.fill("#input", text)
    page.press("#input", "Enter")


def last(page, role: str):
    return page.locator(f".msg.{role}").last


WATCH = """() => {
  window.seen = [];
  new MutationObserver(() => {
    const b = document.querySelector('.msg.assistant:last-child .bubble');
    if (b && b.textContent) window.seen.push(b.textContent);
  }).observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true});
}"""


CHATS: list[str] = []  # ids of the chats the page made, oldest first


def test_message_streams_and_content_is_text(server, page):
    page.goto(server.url + "/")
    page.evaluate(WATCH)
    send(page, EVIL + " Say hello.")
    reply = last(page, "assistant")
    reply.locator(".meta").filter(has_text="tokens").wait_for()
    CHATS.append(page.evaluate("location.hash.slice(1)"))
    final = reply.locator(".bubble").text_content()
    seen = page.evaluate("window.seen")
    partial = {s for s in seen if s and s != final}
    assert final and len(partial) >= 1, seen  # tokens arrived before the reply was complete
    assert all(final.startswith(s) for s in seen)
    # The user's markup is shown as text: no element made, no script run.
    user = last(page, "user").locator(".bubble")
    assert user.text_content() == EVIL + " Say hello."
    assert user.locator("script, img, b").count() == 0
    assert page.evaluate("window.pwned") is None
    assert page.errors == []


def test_stop_button_stops_the_reply(server, page):
    send(page, "Write a very long story about a dragon and a knight, with many chapters.")
    reply = last(page, "assistant")
    page.wait_for_function(
        "() => document.querySelector('.msg.assistant:last-child .bubble').textContent.length > 0"
    )
    page.click("#stop")
    reply.locator(".meta").filter(has_text="stopped").wait_for()
    assert page.locator("#send").is_visible() and not page.locator("#stop").is_visible()


def test_reload_shows_history(server, page, tmp_path):
    before = [b.text_content() for b in page.locator(".msg .bubble").all()]
    assert len(before) == 4
    page.reload()
    page.wait_for_function("() => document.querySelectorAll('.msg .bubble').length === 4")
    after = [b.text_content() for b in page.locator(".msg .bubble").all()]
    assert after == before
    assert last(page, "assistant").locator(".meta").text_content() == "stopped"
    assert page.locator(".conv.active").count() == 1
    page.locator("#conn[data-state=live]").wait_for()
    # A second chat for the picture, with a plain question.
    page.click("#new-chat")
    send(page, "What is the capital of France?")
    last(page, "assistant").locator(".meta").filter(has_text="tokens").wait_for()
    send(page, "And what is it famous for?")
    last(page, "assistant").locator(".meta").filter(has_text="tokens").wait_for()
    shot(page, tmp_path, "chat")
    assert page.errors == []


def test_admin_shows_chunks_move_between_tiers(server, page, tmp_path):
    cid = CHATS[0]  # the idlest chat: its chunks leave the GPU first
    page.goto(server.url + "/admin#token=" + ADMIN)  # a fragment never reaches the server
    page.wait_for_url(server.url + "/admin")  # the token left the address bar for a cookie
    row = page.locator(f".conv-row[data-id='{cid}']")
    row.locator(".chunk").first.wait_for()
    assert row.locator(".chunk.gpu").count() >= 1

    async def other_chats():
        token = server.user("load")
        for i in range(4):
            other = server.new_chat(token)
            async with connect(server, other, token) as ws:
                await say(ws, f"Tell me a fact about the number {i}.", max_tokens=40)

    # Playwright's sync API owns this thread's event loop: drive the chats from another.
    with ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, other_chats()).result(timeout=240)
    # The idle chat's chunks left the GPU tier; the page shows it without a reload.
    page.wait_for_function(
        f"""() => document.querySelectorAll(".conv-row[data-id='{cid}'] .chunk.cpu, .conv-row[data-id='{cid}'] .chunk.dropped").length > 0""",
        timeout=30_000,
    )
    assert page.locator(".pool[data-tier=gpu] .gauge-fill").count() == 1
    # The chats' rendered prompts agree on their first chunk (the template's system part
    # and "Tell me a fact about the number"): it is stored once, and marked so.
    page.locator(".conv-row .chunk.shared").first.wait_for(timeout=30_000)
    assert "shared" in page.locator(".legend").text_content()
    shot(page, tmp_path, "admin")


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
