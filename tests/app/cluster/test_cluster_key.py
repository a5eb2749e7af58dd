"""HAProxy picks a /v1 request's replica by its body's `session_id` or `prompt_cache_key`: the same key
lands on the same replica (where its conversation and KV are), keys spread over replicas.
Real HAProxy in front of two small HTTP servers that answer with their name."""

from __future__ import annotations

import json
import socket
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from app.cluster import haproxy


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def named_server(name: str) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            n = int(self.headers.get("content-length") or 0)
            self.rfile.read(n)
            body = name.encode()
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = _answer

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture
def front(tmp_path):
    servers = [named_server(n) for n in ("r1", "r2")]
    backends = [haproxy.Backend(f"r{i + 1}", f"127.0.0.1:{s.server_address[1]}")
                for i, s in enumerate(servers)]  # fmt: skip
    port = free_port()
    path = tmp_path / "haproxy.cfg"
    path.write_text(haproxy.config(backends, f"127.0.0.1:{port}", check_s=0.2, rise=1))
    proc = subprocess.Popen(haproxy.command(str(path)), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 10
        while True:  # both replicas up: round robin reaches each
            try:
                seen = {httpx.get(url + "/healthz").text for _ in range(6)}
                if seen == {"r1", "r2"}:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "haproxy did not come up"
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)
        for s in servers:
            s.shutdown()


def post(url: str, body: dict, **headers) -> str:
    r = httpx.post(url + "/v1/chat/completions", content=json.dumps(body), headers=headers)
    return r.text


def test_the_same_prompt_cache_key_lands_on_the_same_replica(front):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    homes = {}
    for k in range(12):
        key = f"agent-{k}"
        picked = {post(front, {**body, "prompt_cache_key": key}) for _ in range(4)}
        assert len(picked) == 1, (key, picked)  # one replica per key, every time
        homes[key] = picked.pop()
    assert set(homes.values()) == {"r1", "r2"}  # and keys spread over the replicas
    # The X-Session-ID header, where given, decides (the key is then not looked at).
    by_header = {post(front, {**body, "prompt_cache_key": f"agent-{k}"}, **{"x-session-id": "s"})
                 for k in range(6)}  # fmt: skip
    assert len(by_header) == 1
    # The body's session_id (vLLM's and Dynamo's name) wins over the key, as the server reads
    for k in range(6):
        named = {post(front, {**body, "session_id": f"agent-{k}", "prompt_cache_key": f"x{j}"})
                 for j in range(4)}  # fmt: skip
        assert named == {homes[f"agent-{k}"]}
