"""The admin page with thousands of conversations in the engine: a real `pensieve serve`
(dummy:tiny, pools large enough to hold them all) is given N one-turn conversations over
/v1, then the page runs in headless Chromium (Debian's chromium) and we measure each live
render (snapshot to DOM), a sort click, paging, and the long tasks the main thread had.

    python -m bench.admin_page --conversations 2000

Writes bench/results/admin_page_<N>.json and .png."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from bench.lib.common import RESULTS, environment, write_json
from bench.lib.harness import Server

ADMIN = "bench-admin-token"
CHROMIUM = os.environ.get("PENSIEVE_CHROMIUM", "/usr/bin/chromium")


def server(tmp: Path, chunks: int) -> Server:
    """dummy:tiny with pools of `chunks` and no quotas, on SQLite in `tmp`."""
    return Server(
        f"sqlite+aiosqlite:///{tmp}/pensieve.db",
        tmp / "server.log",
        env={
            "PENSIEVE_MODEL": "dummy:tiny",
            "PENSIEVE_DEVICE": "cpu",
            "PENSIEVE_GPU_CACHE_CHUNKS": str(chunks),
            "PENSIEVE_CPU_CACHE_CHUNKS": str(chunks),
            "PENSIEVE_TURNS_PER_MINUTE": "1000000",
            "PENSIEVE_MAX_CHATS_PER_OWNER": "1000000",
        },
        admin_token=ADMIN,
    )


async def fill(url: str, token: str, n: int, concurrency: int = 8) -> float:
    """N one-turn conversations over /v1; seconds taken."""
    t0 = time.perf_counter()
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=300) as client:

        async def one(i: int) -> None:
            async with sem:
                r = await client.post(
                    url + "/v1/chat/completions",
                    json={
                        "model": "dummy:tiny",
                        "messages": [
                            {"role": "user", "content": f"conversation {i} " + "x " * (i % 40)}
                        ],
                        "max_tokens": 1 + i % 8,
                    },
                    headers={"Authorization": f"Bearer {token}"},
                )
                r.raise_for_status()

        await asyncio.gather(*(one(i) for i in range(n)))
    return time.perf_counter() - t0


def measure(url: str, n: int, seconds: float) -> dict:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM, args=["--headless", "--no-sandbox", "--disable-gpu"]
        )
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        page.goto(url + "/admin#token=" + ADMIN)
        t0 = time.perf_counter()
        page.wait_for_function(
            f"() => snapshot && snapshot.conversations.length >= {n}", timeout=120_000
        )
        first_render_s = time.perf_counter() - t0
        page.evaluate(
            """() => {
              window.longTasks = [];
              new PerformanceObserver((l) => l.getEntries().forEach((e) => longTasks.push(e.duration)))
                .observe({type: 'longtask', buffered: false});
            }"""
        )
        page.wait_for_timeout(seconds * 1000)
        renders = page.evaluate("renderTimes.slice()")
        clicks = []
        for key in ["tokens", "idle_s", "gpu", "retention", "title", "tokens"]:
            clicks.append(
                page.evaluate(
                    """(key) => {
                      const t0 = performance.now();
                      document.querySelector(`#conv-head th[data-key=${key}]`).click();
                      return performance.now() - t0;
                    }""",
                    key,
                )
            )
        paging = [
            page.evaluate(
                "() => { const t0 = performance.now(); document.getElementById('next').click(); return performance.now() - t0; }"
            )
            for _ in range(5)
        ]
        rows = page.locator(".conv-row").count()
        long_tasks = page.evaluate("longTasks.slice()")
        snapshot_bytes = len(
            httpx.get(
                url + "/api/admin/cache", headers={"Authorization": f"Bearer {ADMIN}"}
            ).content
        )
        browser.close()
    return {
        "first_render_s": round(first_render_s, 2),
        "render_ms": renders,
        "sort_click_ms": clicks,
        "page_click_ms": paging,
        "rows_in_dom": rows,
        "long_tasks_ms": long_tasks,
        "watch_s": seconds,
        "snapshot_bytes": snapshot_bytes,
    }


def plot(result: dict, path: Path) -> None:
    from bench.lib.plots import plt, save_fig

    fig, ax = plt.subplots(figsize=(7, 3.6))
    r = result["page"]
    ax.plot(r["render_ms"], marker="o", ms=3, label="live render (poll → DOM)")
    ax.axhline(50, color="grey", ls="--", lw=1, label="50 ms (one long task)")
    ax.set_xlabel("poll (1 per second)")
    ax.set_ylabel("ms")
    ax.set_title(
        f"Admin page with {result['conversations']} conversations in the engine "
        f"({result['environment']['git_commit'][:8]})",
        fontsize=9,
    )
    ax.legend(fontsize=8)
    save_fig(fig, path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, default=2000)
    ap.add_argument("--watch", type=float, default=20.0, help="seconds of live polling measured")
    args = ap.parse_args()
    n = args.conversations
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        srv = server(tmp, chunks=2 * n + 256).start(healthy=True)
        try:
            token = srv.user("bench")
            fill_s = asyncio.run(fill(srv.url, token, n))
            page = measure(srv.url, n, args.watch)
        finally:
            srv.stop()
    renders = page["render_ms"]
    result = {
        "benchmark": "admin_page",
        "conversations": n,
        "fill_s": round(fill_s, 1),
        "summary": {
            "render_ms_median": round(statistics.median(renders), 1),
            "render_ms_max": round(max(renders), 1),
            "sort_click_ms_max": round(max(page["sort_click_ms"]), 1),
            "page_click_ms_max": round(max(page["page_click_ms"]), 1),
            "long_tasks": len(page["long_tasks_ms"]),
            "rows_in_dom": page["rows_in_dom"],
        },
        "page": page,
        "environment": environment("cpu"),
    }
    out = write_json(RESULTS / f"admin_page_{n}.json", result, indent=2)
    plot(result, out.with_suffix(".png"))
    print(json.dumps(result["summary"], indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
