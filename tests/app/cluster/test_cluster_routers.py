"""`pensieve cluster --router vllm-router`: vLLM's KV-aware router in front of the replicas,
reading their KV events. Chats through it are answered with their context reused, replies
equal a single server's (float32, greedy), and a replica SIGKILLed mid-run loses no turn: the
router retries on the other replica, which takes the conversation over."""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

import httpx
import openai
import pytest

from tests import services
from tests.app_fixtures import ADMIN, auth

MODEL = "smollm2-135m-instruct"


@dataclass
class RoutedCluster(services.LocalCluster):
    router: str = "vllm-router"

    def command(self) -> list[str]:
        return [*super().command(), "--router", self.router]

    def replica(self, i: int) -> str:
        return f"http://127.0.0.1:{self.port + 1 + i}"

    def listing(self) -> dict:
        """The cluster as the first replica lists it (the router proxies only /v1)."""
        r = httpx.get(self.replica(0) + "/api/admin/cluster", headers=auth(ADMIN), timeout=5)
        r.raise_for_status()
        return r.json()

    def answers(self, healthy: bool = False) -> bool:
        try:
            alive = sum(r["alive"] for r in self.listing()["replicas"])
        except httpx.HTTPError:
            return False
        return alive == self.replicas and services.port_open("127.0.0.1", self.port)


def ask(base: str, key: str, messages: list[dict]):
    c = openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=120)
    return c.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_vllm_router_in_front_of_the_cluster(tmp_path):
    db, url = services.new_database()
    env = {"PENSIEVE_DEVICE": "cpu", "PENSIEVE_DTYPE": "float32"}
    env |= {"PENSIEVE_TURNS_PER_MINUTE": "100000", "PENSIEVE_MAX_TOKENS_DEFAULT": "8"}
    cluster = RoutedCluster(
        url, tmp_path / "cluster.log", env=env, admin_token=ADMIN, replicas=2,
        args=["--gpu-cache-chunks", "64", "--cpu-cache-chunks", "64"],
    )  # fmt: skip
    try:
        cluster.start(timeout=600)
        key = cluster.user("alice")
        chats = [
            [{"role": "user", "content": f"Chat {i}: tell me about rivers and stones. " * 6}]
            for i in range(6)
        ]
        returning = cached = 0
        for turn in range(3):
            if turn == 2:  # one replica dies mid-run
                victim = cluster.listing()["replicas"][1]["pid"]
                os.kill(victim, signal.SIGKILL)
            for i, messages in enumerate(chats):
                reply = ask(cluster.url, key, messages)
                assert reply.choices[0].message.content, (i, turn)
                if turn == 1:
                    returning += 1
                    cached += (reply.usage.prompt_tokens_details.cached_tokens or 0) > 0
                messages += [
                    {"role": "assistant", "content": reply.choices[0].message.content},
                    {"role": "user", "content": f"And then? ({turn})"},
                ]
        assert cached == returning, (cached, returning)  # every returning turn at its KV
        # greedy replies through the router equal one replica's own
        alone = ask(cluster.replica(0), key, [{"role": "user", "content": "Name a river."}])
        routed = ask(cluster.url, key, [{"role": "user", "content": "Name a river."}])
        assert routed.choices[0].message.content == alone.choices[0].message.content
        cluster.proc.send_signal(signal.SIGINT)
        assert cluster.proc.wait(60) == 0
    finally:
        cluster.kill()
        services.drop_database(db)
