"""The system scenarios of bench.soak (faults and hostile clients against a server) and
bench.cluster (replicas, one killed): their parts, and a small run of each end to end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.soak import fault_schedule, scan_log

ROOT = Path(__file__).resolve().parents[2]

LOG = """\
2026-01-01 10:00:00,000 WARNING store.activity: redis activity clock unreachable
ERROR:    Exception in ASGI application
Traceback (most recent call last):
  File "app/chat.py", line 1, in close
    await ws.close()
starlette.websockets.WebSocketDisconnect: 1006
2026-01-01 10:00:01,000 ERROR pensieve.chat: turn of 1a2b failed
Traceback (most recent call last):
  File "store/history.py", line 9, in messages
    rows = await s.execute(q)
ConnectionRefusedError: [Errno 111] Connect call failed
During handling of the above exception, another exception occurred:
Traceback (most recent call last):
  File "app/chat.py", line 2, in run_turn
sqlalchemy.exc.InterfaceError: connection is closed
ERROR:    Application shutdown failed. Exiting.
"""


def test_scan_log_counts_each_error_event_once():
    r = scan_log(LOG)
    # The ASGI record, the logged turn failure (one chained traceback), the failed shutdown.
    assert r["asgi_exceptions"] == 3
    assert r["patterns"]["Traceback (most recent call last)"] == 3
    assert r["exceptions"]["starlette.websockets.WebSocketDisconnect: 1006"] == 1
    assert r["error_records"] == 3
    assert scan_log("2026-01-01 10:00:00,000 WARNING x: Redis is down\n")["asgi_exceptions"] == 0


def test_fault_windows_are_in_order_and_inside_the_run():
    windows = fault_schedule(["redis", "postgres-fast", "postgres-immediate"], 100.0)
    assert [w[0] for w in windows] == ["redis", "postgres-fast", "postgres-immediate"]
    ends = [t for _, start, end in windows for t in (start, end)]
    assert ends == sorted(ends) and ends[0] > 0 and ends[-1] < 100
    assert fault_schedule([], 100.0) == []


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_small_soak_loses_nothing(tmp_path):
    """A few chats, a short connect/abort storm and one Redis stop, on a server with its own
    PostgreSQL and Redis: every reply the client saw is stored and every chat still works."""
    out = tmp_path / "soak.json"
    cmd = [sys.executable, "-m", "bench.soak", "--conversations", "4", "--workers", "3",
           "--duration", "12", "--storm", "60", "--storm-chats", "4", "--storm-concurrency", "16",
           "--faults", "redis", "--out", str(out), "--no-plot",
           "--server-log", str(tmp_path / "server.log")]  # fmt: skip
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        proc.terminate()  # SIGTERM: the harness stops the server and services it started
        stdout, stderr = proc.communicate(timeout=60)
    assert out.exists(), stdout[-2000:] + stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["conversations"] == 4 and r["turns_ok"] > 0
    assert r["storm_connects"] > 0
    assert sum(r["aborts"].values()) + sum(r["storm_connect_failures"].values()) == 60
    assert [w["fault"] for w in r["fault_windows"]] == ["redis"]
    assert "end_s" in r["fault_windows"][0] and not r["fault_errors"]
    assert r["lost_messages"] == 0 and r["mismatched_messages"] == 0
    assert r["usable_chats"] == 4, r["unusable_reasons"]
    assert r["inconsistent_chats"] == 0, r["inconsistent_samples"]
    assert r["storm_chat_deletes"] == {"204": 2}
    assert r["asgi_exceptions"] == 0, r["exceptions"]
    assert r["shutdown"]["clean"], r["shutdown"]
    assert proc.returncode == 0, stdout[-2000:]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_small_cluster_load_loses_nothing_when_a_replica_dies(tmp_path):
    """bench.cluster end to end at a small size: two replicas behind HAProxy, one killed
    mid-run and restarted; every turn is answered and stored in the right chat."""
    cmd = [sys.executable, "-m", "bench.cluster", "--replicas", "2", "--chats", "4",
           "--turns", "2", "--max-tokens", "4", "--think", "1", "--model", "dummy:tiny",
           "--out", "cluster_test", "--out-dir", str(tmp_path)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=360)
    out = tmp_path / "cluster_test.json"
    assert out.exists(), proc.stdout[-2000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["check"]["ok"], r["check"]
    assert r["turns_answered"] == 4 * 2
    assert proc.returncode == 0
