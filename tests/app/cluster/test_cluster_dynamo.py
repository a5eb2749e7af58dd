"""`pensieve cluster --router dynamo`: Dynamo's frontend and KV router in front of two
Pensieve Dynamo workers. Returning turns find their KV, and a worker SIGKILLed mid-run loses
no turn: the frontend routes around it and the launcher starts it again."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import signal
import subprocess
import sys

import httpx
import pytest

from bench.lib.harness import free_port, wait_until

MODEL = "smollm2-135m-instruct"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(900),
    pytest.mark.skipif(
        importlib.util.find_spec("dynamo.frontend") is None,
        reason="needs ai-dynamo (docs/dynamo.md)",
    ),
]


def ask(url: str, messages: list[dict]) -> dict:
    body = {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def test_dynamo_cluster_survives_a_killed_worker(tmp_path):
    port = free_port()
    log = tmp_path / "cluster.log"
    env = {**os.environ, "PENSIEVE_DEVICE": "cpu", "PENSIEVE_DTYPE": "float32"}
    cmd = [sys.executable, "-m", "app.cli", "cluster", "--router", "dynamo", "--replicas", "2"]
    cmd += ["--port", str(port), "--gpu-cache-chunks", "64", "--cpu-cache-chunks", "64"]
    with log.open("ab") as out:
        proc = subprocess.Popen(  # its own group: a failed test kills the workers too
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"

    def pids() -> list[int]:
        m = re.search(r"dynamo workers \(pids ([\d, ]+)\)", log.read_text(errors="replace"))
        return [int(p) for p in m.group(1).split(", ")] if m else []

    try:
        assert wait_until(lambda: proc.poll() is None and len(pids()) == 2, 600, every=1.0), log
        chats = [
            [{"role": "user", "content": f"Chat {i}: tell me about rivers and stones. " * 6}]
            for i in range(6)
        ]
        returning = cached = 0
        for turn in range(3):
            if turn == 2:  # one worker dies mid-run
                os.kill(pids()[1], signal.SIGKILL)
            for i, messages in enumerate(chats):
                reply = ask(url, messages)
                text = reply["choices"][0]["message"]["content"]
                assert text, (i, turn)
                if turn == 1:
                    returning += 1
                    cached += reply["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
                messages += [
                    {"role": "assistant", "content": text},
                    {"role": "user", "content": f"And then? ({turn})"},
                ]
        assert cached == returning, (cached, returning)  # every returning turn at its KV
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
