"""Warm before ready: a fresh server runs one tiny turn before it says it is ready, and
that turn leaves no trace (app/turns/warm.py, engine/warm.py)."""

from __future__ import annotations

import dataclasses

import httpx
import pytest

from engine.snapshot import EngineCounters
from tests.app_fixtures import server_on

pytestmark = pytest.mark.timeout(600)


def test_a_fresh_server_is_warm_and_shows_no_warm_up(tmp_path):
    env = {"PENSIEVE_DISK_CACHE_DIR": str(tmp_path / "kv")}
    with server_on("sqlite", tmp_path, env) as server:
        health = httpx.get(server.url + "/healthz").json()
        assert health["status"] == "ok"
        assert health["warm_up_s"] is not None and health["warm_up_s"] > 0
        snap = server.cache()
        assert snap["conversations"] == []
        zero = dataclasses.asdict(EngineCounters())
        assert snap["counters"] == zero
        assert snap["turns"]["count"] == 0
        for tier in ("gpu", "cpu", "disk"):
            assert snap["pools"][tier]["used"] == 0, (tier, snap["pools"][tier])
