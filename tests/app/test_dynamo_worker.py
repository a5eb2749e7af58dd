"""Pensieve behind NVIDIA Dynamo's frontend (docs/dynamo.md): `python -m dynamo.frontend
--router-mode kv` in front of two `python -m app.dynamo_worker` processes sends every
returning turn to the worker that holds its conversation (its cached tokens say so: the
other worker has never seen it), and the greedy replies are a single Pensieve server's."""

from __future__ import annotations

import importlib.util
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from app.dynamo_worker import fleet as dynamo
from tests.app.openai.test_app_openai import ask, client
from tests.app_fixtures import Server

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("dynamo.frontend") is None
        or importlib.util.find_spec("msgspec") is None,
        reason="needs ai-dynamo (pip install --no-deps ai-dynamo==1.6.1 msgspec)",
    ),
]

MODEL = "smollm2-135m-instruct"
WORDS = ["river", "stone", "cloud", "lantern", "meadow", "copper", "violin", "harbor"]
MAX_TOKENS = 16
CPU = {"device": "cpu", "dtype": "float32", "gpu_cache_chunks": 200, "cpu_cache_chunks": 200}


def first_message(i: int) -> str:
    """Distinct from the first chunk on: no two conversations share a full chunk."""
    return f"Story {i}: " + " ".join(WORDS[(i + k) % len(WORDS)] for k in range(60))


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dynamo")
    with dynamo.running(tmp, 2, MODEL, timeout_s=300, **CPU) as url:
        yield url, [tmp / f"w{i}.log" for i in range(2)]
    for i in range(2):
        assert "Traceback" not in (tmp / f"w{i}.log").read_text(errors="replace")


def chat(url: str, messages: list[dict]) -> dict:
    body = {"model": MODEL, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def turns_served(log: Path) -> int:
    return log.read_text(errors="replace").count("pensieve.dynamo turn ")


def test_returning_turns_go_to_their_worker_and_replies_are_greedy(fleet, tmp_path):
    url, logs = fleet
    chats = [[{"role": "user", "content": first_message(i)}] for i in range(6)]
    replies: list[list[str]] = [[] for _ in chats]
    previous = [0] * len(chats)  # each chat's prompt tokens last turn
    for turn in range(3):
        # first turns at once: the router spreads them by load; later turns by their KV
        with ThreadPoolExecutor(6 if turn == 0 else 1) as pool:
            answers = list(pool.map(lambda m: chat(url, m), chats))
        for i, (messages, a) in enumerate(zip(chats, answers, strict=True)):
            cached = a["usage"]["prompt_tokens_details"]["cached_tokens"]
            if turn == 0:
                assert cached == 0, a["usage"]
            else:  # the whole previous turn found in memory: the worker that holds it
                assert cached >= previous[i], (i, turn, a["usage"])
            text = a["choices"][0]["message"]["content"]
            replies[i].append(text)
            messages += [
                {"role": "assistant", "content": text},
                {"role": "user", "content": f"Go on, part {turn + 2}."},
            ]
        previous = [a["usage"]["prompt_tokens"] for a in answers]
    served = [turns_served(log) for log in logs]
    assert sum(served) == 18 and min(served) >= 3, served  # both workers hold conversations

    # the same messages, turn by turn, to one Pensieve server: the same greedy replies
    pools = {"PENSIEVE_GPU_CACHE_CHUNKS": "200", "PENSIEVE_CPU_CACHE_CHUNKS": "200"}  # the workers'
    srv = Server(f"sqlite+aiosqlite:///{tmp_path}/one.db", tmp_path / "one.log", env=pools)
    srv.start()
    try:
        c = client(srv, srv.user("alice"))
        for i, messages in enumerate(chats):
            for turn in range(3):
                asked = messages[: 2 * turn + 1]
                got, _ = ask(c, asked, max_tokens=MAX_TOKENS)
                assert got.choices[0].message.content == replies[i][turn], (i, turn)
    finally:
        srv.stop()
