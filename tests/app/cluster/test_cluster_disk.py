"""Failover on a shared disk tier: a conversation whose home replica dies goes on on another
replica, which reads the context the first one wrote instead of recomputing it. (A graceful
stop writes everything on the way out: tests/app/test_app_disk.py covers that path.)"""

from __future__ import annotations

import asyncio

import pytest

from tests.app.cluster.test_cluster import reconnect_and_say
from tests.app.test_app_disk import oracle
from tests.app_fixtures import connect, say
from tests.cluster_fixtures import REPLICA_ENV, start_cluster

pytestmark = pytest.mark.timeout(600)


def test_failover_reads_what_the_old_home_wrote(tmp_path):
    cluster = start_cluster(tmp_path, n=2, env={"PENSIEVE_DISK_CACHE_DIR": str(tmp_path / "kv")})
    try:
        asyncio.run(scenario(cluster))
    finally:
        cluster.stop()


async def scenario(cluster) -> None:
    token = cluster.servers[0].user("traveller")
    cid = cluster.servers[0].new_chat(token)
    async with connect(cluster.front, cid, token) as ws:
        first = await say(ws, "Remember the number seven and the colour blue. " * 6,
                          max_tokens=8)  # fmt: skip
    assert first.errors == []
    home = cluster.server_of(cluster.home(cid))
    await asyncio.sleep(2)  # idle, it writes its memory meanwhile
    home.kill()  # then dies
    after = await reconnect_and_say(cluster, token, cid, "What did I ask?")
    assert after.errors == []
    usage = after.done["usage"]
    assert usage["disk_tokens"] > 0 and usage["recomputed_tokens"] < usage["disk_tokens"]
    await oracle(cluster.servers[0].database_url, cid, after.text, REPLICA_ENV["PENSIEVE_MODEL"])
