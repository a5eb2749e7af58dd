"""A non-editable install (as a deployment makes) finds its pages and migrations."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import httpx
import pytest

from bench.lib import harness
from bench.lib.harness import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_installed_package_serves_pages_and_migrates(tmp_path):
    # Build from a copy, so the checkout gets no build/ folder.
    src = tmp_path / "src"
    junk = (".venv", ".git", "data", "build", "*.egg-info", "__pycache__", ".*cache", "docs")
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(*junk, "results", "samples"))
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation"]
        + ["--target", str(target), str(src)],
        check=True,
        timeout=300,
    )
    shutil.rmtree(src)  # nothing may be found beside a source tree
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PENSIEVE_")}
    env.update(
        PYTHONPATH=str(target),
        PENSIEVE_DATABASE_URL=f"sqlite+aiosqlite:///{run_dir}/pensieve.db",
        PENSIEVE_ADMIN_TOKEN="t",
    )

    def python(code: str) -> str:
        out = subprocess.run(
            [sys.executable, "-c", code], cwd=run_dir, env=env, capture_output=True, text=True
        )
        assert out.returncode == 0, out.stderr
        return out.stdout

    where = python("import app, store.migrate as m; print(app.__file__); print(m.scripts_dir())")
    assert all(line.startswith(str(target)) for line in where.split()), where
    python("from store.migrate import upgrade, current; upgrade(); assert current() is not None")

    srv = harness.Server(
        env["PENSIEVE_DATABASE_URL"],
        tmp_path / "server.log",
        env={"PYTHONPATH": str(target)},
        # small pools: one sized from memory takes seconds to allocate
        args=["--model", "dummy:tiny", "--device", "cpu"]
        + ["--gpu-cache-chunks", "16", "--cpu-cache-chunks", "0"],
        admin_token="t",
        cwd=run_dir,
    )
    try:
        srv.start(timeout=120, healthy=True)
        url = srv.url
        page = httpx.get(f"{url}/")
        assert page.status_code == 200 and "/static/chat.js" in page.text
        script = httpx.get(f"{url}/static/chat.js")
        assert script.status_code == 200
        assert script.text == (ROOT / "web" / "chat.js").read_text()
        # The vendored libraries ship too, licenses included.
        for name in ("vendor/marked.js", "vendor/purify.min.js", "vendor/uPlot.min.js",
                     "vendor/LICENSE.dompurify", "markdown.js", "conversations.js",
                     "socket.js"):  # fmt: skip
            asset = httpx.get(f"{url}/static/{name}")
            assert asset.status_code == 200, name
            assert asset.content == (ROOT / "web" / name).read_bytes(), name
    finally:
        srv.stop()
