"""The SQL history store on SQLite and PostgreSQL: migrations, token streams, ownership."""

from __future__ import annotations

import asyncio
import os
import sqlite3
import subprocess
import sys
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import event, func, inspect, select, text

from bench.lib import harness
from store import HistoryConflict, HistoryError, HistoryStore, db, hash_token, migrate
from store.models import Base, Conversation, ConversationRetention, Message

TABLES = {"users", "conversations", "messages", "responses", "retention"}
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request) -> str:
    return request.getfixturevalue("sqlite_url" if request.param == "sqlite" else "pg_url")


@pytest.fixture
async def store(db_url: str) -> AsyncIterator[HistoryStore]:
    await migrate.upgrade_async(db_url)
    async with HistoryStore(db_url) as s:
        yield s


async def _chat(store: HistoryStore, name: str = "ada") -> str:
    user, _ = await store.create_user(name)
    conv = await store.create_conversation(user.id, title="t", system_prompt="be brief")
    return conv.id


def head() -> str:
    return ScriptDirectory.from_config(migrate.config()).get_current_head()


def _schema(conn) -> tuple[set[str], list]:
    diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    return set(inspect(conn).get_table_names()), diff


async def test_migrations_up_and_down(db_url: str) -> None:
    # Called on the running loop on purpose: the server does the same at start.
    migrate.upgrade(db_url)
    assert migrate.current(db_url) == head()
    s = HistoryStore(db_url)
    try:
        async with s.engine.connect() as conn:
            tables, diff = await conn.run_sync(_schema)
        assert tables >= TABLES
        assert diff == [], f"migration and models disagree: {diff}"

        migrate.downgrade(db_url)
        assert migrate.current(db_url) is None
        async with s.engine.connect() as conn:
            tables, _ = await conn.run_sync(_schema)
        assert not TABLES & tables

        migrate.upgrade(db_url)  # and back up, on the same database
        assert migrate.current(db_url) == head()
    finally:
        await s.close()


async def test_round_trip_and_exact_reads(store: HistoryStore) -> None:
    cid = await _chat(store)
    parts = [[1, 2, 3, 4, 5], [], [6, 7], list(range(100, 117)), [8]]
    roles = ["system", "user", "assistant", "user", "assistant"]
    for i, (role, ids) in enumerate(zip(roles, parts, strict=True)):
        reason = "stop" if role == "assistant" else None
        m = await store.append_message(cid, role, f"m{i}", ids, finish_reason=reason)
        assert (m.seq, m.token_count) == (i, len(ids))

    whole = [t for p in parts for t in p]
    assert await store.stream(cid) == whole
    assert await store.token_count(cid) == len(whole)
    msgs = await store.messages(cid)
    assert [m.content for m in msgs] == [f"m{i}" for i in range(5)]
    assert [m.token_ids for m in msgs] == parts
    assert [m.finish_reason for m in msgs] == [None, None, "stop", None, "stop"]
    starts = [sum(map(len, parts[:i])) for i in range(5)]
    assert [m.token_start for m in msgs] == starts
    assert msgs[0].created.tzinfo is not None

    reader = store.token_history(timeout=10)

    def read_all() -> dict[tuple[int, int], list[int]]:
        n = len(whole)
        return {(a, b): reader.read(cid, a, b) for a in range(n + 1) for b in range(a, n + 1)}

    # The engine reads from a worker thread while the loop keeps running.
    got = await asyncio.to_thread(read_all)
    assert all(v == whole[a:b] for (a, b), v in got.items())

    with pytest.raises(HistoryError, match="does not cover|ends before"):
        await asyncio.to_thread(reader.read, cid, 3, len(whole) + 1)
    with pytest.raises(HistoryError):
        await asyncio.to_thread(reader.read, "nope", 0, 1)
    with pytest.raises(ValueError, match="bad token range"):
        await asyncio.to_thread(reader.read, cid, 5, 2)
    with pytest.raises(RuntimeError, match="worker thread"):
        reader.read(cid, 0, 1)  # on the loop itself it would deadlock


async def test_concurrent_appends_get_distinct_seq(store: HistoryStore, db_url: str) -> None:
    cid = await _chat(store)
    async with HistoryStore(db_url) as other:  # a second server on the same database
        jobs = [
            (store if i % 2 else other).append_message(cid, "user", str(i), [i] * (i % 4 + 1))
            for i in range(24)
        ]
        made = await asyncio.gather(*jobs)
    msgs = await store.messages(cid)
    assert sorted(m.seq for m in made) == list(range(24))
    assert [m.seq for m in msgs] == list(range(24))
    pos = 0
    for m in msgs:  # contiguous, in seq order, each at the stream length before it
        assert m.token_start == pos
        pos += m.token_count
    assert await store.stream(cid) == [t for m in msgs for t in m.token_ids]


async def test_owner_scoping(store: HistoryStore) -> None:
    ada, _ = await store.create_user("ada")
    bob, _ = await store.create_user("bob")
    a1 = await store.create_conversation(ada.id, title="a1")
    a2 = await store.create_conversation(ada.id, title="a2")
    b1 = await store.create_conversation(bob.id, title="b1")
    await store.append_message(a1.id, "user", "hi", [1])  # a1 becomes the latest

    assert [c.id for c in await store.list_conversations(ada.id)] == [a1.id, a2.id]
    assert [c.id for c in await store.list_conversations(bob.id)] == [b1.id]
    assert await store.get_conversation(a1.id, owner_id=bob.id) is None
    assert (await store.get_conversation(a1.id, owner_id=ada.id)).title == "a1"
    assert not await store.delete_conversation(a1.id, owner_id=bob.id)
    assert await store.get_conversation(a1.id) is not None
    with pytest.raises(HistoryError, match="unknown user"):
        await store.create_conversation("ghost")


async def test_delete_cascades_to_messages(store: HistoryStore) -> None:
    cid = await _chat(store)
    keep = await _chat(store, "bob")
    for i in range(3):
        await store.append_message(cid, "user", "x", [i])
    await store.append_message(keep, "user", "y", [9])
    assert await store.delete_conversation(cid)
    assert not await store.delete_conversation(cid)
    async with store.sessions() as s:  # the database itself, not the store's view of it
        left = await s.scalar(select(func.count()).select_from(Message))
        rows = await s.scalar(
            select(func.count()).select_from(Message).where(Message.conversation_id == cid)
        )
    assert (left, rows) == (1, 0)
    assert await store.stream(keep) == [9]


async def test_retention_is_stored_replaced_read_by_replica_and_cascades(
    store: HistoryStore,
) -> None:
    now = datetime.now(UTC)
    a, b, c, d = [await _chat(store, name) for name in ("a", "b", "c", "d")]

    def row(cid: str, until: datetime | None, replica=None, priority=50, done=False):
        return ConversationRetention(conversation_id=cid, owner_id="o", replica=replica,
                                     ttl_s=600.0 if until else None, pinned_until=until,
                                     pinned_bytes=1 << 33, priority=priority, done=done,
                                     updated=now)  # fmt: skip

    await store.save_retention(row(a, now - timedelta(seconds=1)))  # expired: nothing held
    await store.save_retention(row(a, now + timedelta(seconds=60)))  # replaced: in force
    await store.save_retention(row(b, None, priority=90))  # a priority alone
    await store.save_retention(row(c, None, done=True))  # a finished session
    await store.save_retention(row(d, now + timedelta(seconds=60), replica="r2:8000"))
    live = {r.conversation_id: r for r in await store.live_retention(None, now)}
    assert set(live) == {a, b, c}  # d is another replica's
    assert live[a].pinned_until == now + timedelta(seconds=60) and live[a].pinned_bytes == 1 << 33
    assert [r.conversation_id for r in await store.live_retention("r2:8000", now)] == [d]
    await store.save_retention(row(b, None))  # neutral again: nothing held
    await store.clear_retention(c)
    await store.delete_conversation(a)  # deleted: its retention goes with it
    assert await store.live_retention(None, now) == []


async def test_failed_append_leaves_nothing(store: HistoryStore) -> None:
    cid = await _chat(store)
    await store.append_message(cid, "user", "first", [1, 2])
    before = await store.get_conversation(cid)

    def fail_insert(conn, cursor, statement, params, context, executemany) -> None:
        if statement.lstrip().upper().startswith("INSERT INTO MESSAGES"):
            raise RuntimeError("disk on fire")

    # The failure comes after the conversation row was already updated in the transaction.
    event.listen(store.engine.sync_engine, "before_cursor_execute", fail_insert)
    try:
        with pytest.raises(RuntimeError, match="disk on fire"):
            await store.append_message(cid, "assistant", "lost", [3, 4])
    finally:
        event.remove(store.engine.sync_engine, "before_cursor_execute", fail_insert)

    assert await store.stream(cid) == [1, 2]
    assert (await store.get_conversation(cid)).updated == before.updated
    m = await store.append_message(cid, "assistant", "ok", [3, 4])
    assert (m.seq, m.token_start) == (1, 2)


async def test_users_and_tokens(store: HistoryStore) -> None:
    user, token = await store.create_user("  ada ")
    assert user.name == "ada" and len(token) >= 32
    assert (await store.user_by_token(token)).id == user.id
    assert await store.user_by_token(token + "x") is None
    assert await store.user_by_token("") is None
    async with store.engine.connect() as conn:
        rows = (await conn.execute(text("SELECT id, name, token_hash FROM users"))).all()
    assert rows == [(user.id, "ada", hash_token(token))]
    assert token not in str(rows)
    with pytest.raises(ValueError, match="user name"):
        await store.create_user("  ")


async def test_bad_input_is_refused(store: HistoryStore) -> None:
    cid = await _chat(store)
    with pytest.raises(ValueError, match="role"):
        await store.append_message(cid, "robot", "x", [1])
    with pytest.raises(ValueError, match="token ids"):
        await store.append_message(cid, "user", "x", [1, "2"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="token ids"):
        await store.append_message(cid, "user", "x", [1, -2])
    with pytest.raises(ValueError, match="finish_reason"):
        await store.append_message(cid, "assistant", "x", [1], finish_reason="bored")
    with pytest.raises(HistoryError, match="unknown conversation"):
        await store.append_message("nope", "user", "x", [1])
    assert await store.messages(cid) == []
    async with store.sessions() as s:
        assert await s.scalar(select(func.count()).select_from(Conversation)) == 1


def test_bad_urls_are_refused() -> None:
    with pytest.raises(ValueError, match="unsupported database"):
        HistoryStore("mysql://x@localhost/db")
    with pytest.raises(ValueError, match="not async"):
        HistoryStore("postgresql+psycopg2://x@localhost/db")
    with pytest.raises(ValueError, match="in-memory"):
        migrate.upgrade("sqlite+aiosqlite://")


async def test_expected_start_guards_the_stream(store: HistoryStore) -> None:
    cid = await _chat(store)
    await store.append_message(cid, "user", "a", [1, 2, 3], expected_start=0)
    with pytest.raises(HistoryConflict, match="has 3 tokens"):
        await store.append_message(cid, "assistant", "b", [4], expected_start=2)
    m = await store.append_message(cid, "assistant", "b", [4], expected_start=3)
    assert (m.seq, m.token_start) == (1, 3)
    assert await store.stream(cid) == [1, 2, 3, 4]


async def test_set_title(store: HistoryStore) -> None:
    cid = await _chat(store)
    await store.set_title(cid, "renamed")
    assert (await store.get_conversation(cid)).title == "renamed"
    with pytest.raises(HistoryError):
        await store.set_title("nope", "x")
    with pytest.raises(ValueError, match="title"):
        await store.set_title(cid, "x" * 201)


def _alembic_start(*args: str, cwd: Path, url: str) -> subprocess.Popen:
    env = os.environ | {"PENSIEVE_DATABASE_URL": url, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "alembic", "-c", str(ROOT / "alembic.ini"), *args]
    return subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _alembic(*args: str, cwd: Path, url: str) -> str:
    proc = _alembic_start(*args, cwd=cwd, url=url)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    return out


def test_alembic_command_line_and_servers_starting_together(db_url: str, tmp_path: Path) -> None:
    # Two servers starting at once on one database: they migrate in turn, neither fails.
    procs = [_alembic_start("upgrade", "head", cwd=tmp_path, url=db_url) for _ in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert sum("-> 0002" in out for out in outs) == 1  # one migrated, the other saw head
    assert migrate.current(db_url) == head()
    assert "0001 ->" in _alembic("downgrade", "base", cwd=tmp_path, url=db_url)
    assert migrate.current(db_url) is None


def test_default_url_is_sqlite_under_data(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PENSIEVE_DATABASE_URL", raising=False)
    migrate.upgrade()
    assert (tmp_path / "data" / "pensieve.db").is_file()
    assert migrate.current() == head()


class _BusyCursor:
    """Answers "database is locked" a few times, as SQLite does while another process
    switches a fresh database into WAL, then succeeds."""

    def __init__(self, busy: int, error: str = "database is locked") -> None:
        self.busy, self.error, self.calls = busy, error, 0

    def execute(self, sql: str) -> None:
        self.calls += 1
        if self.calls <= self.busy:
            raise sqlite3.OperationalError(self.error)


def test_wal_switch_waits_for_a_busy_database_and_raises_other_errors() -> None:
    cur = _BusyCursor(busy=3)
    db._enter_wal(cur)
    assert cur.calls == 4
    with pytest.raises(sqlite3.OperationalError, match="disk I/O"):
        db._enter_wal(_BusyCursor(busy=1, error="disk I/O error"))


async def test_unreachable_database_is_a_clear_error() -> None:
    s = HistoryStore(f"postgresql+asyncpg://postgres@127.0.0.1:{harness.free_port()}/nowhere")
    with pytest.raises(RuntimeError, match="cannot reach the database"):
        await s.start()
    await s.close()


async def test_truncate_cuts_the_stream_and_keeps_the_text(store: HistoryStore) -> None:
    cid = await _chat(store)
    for role, ids in [("user", [1, 2, 3]), ("assistant", [4, 5, 6]), ("user", [7, 8])]:
        await store.append_message(cid, role, role, ids)
    with pytest.raises(HistoryError, match="cannot cut"):
        await store.truncate(cid, 9)
    await store.truncate(cid, 8)  # a no-op at the exact length
    await store.truncate(cid, 4)
    assert await store.stream(cid) == [1, 2, 3, 4]
    msgs = await store.messages(cid)
    assert [(m.content, m.token_start, m.token_ids) for m in msgs] == [
        ("user", 0, [1, 2, 3]),
        ("assistant", 3, [4]),
        ("user", 4, []),
    ]
    m = await store.append_message(cid, "user", "again", [9], expected_start=4)
    assert (m.seq, m.token_start) == (3, 4)
    assert await asyncio.to_thread(store.token_history().read, cid, 2, 5) == [3, 4, 9]
    with pytest.raises(HistoryError):
        await store.truncate("nope", 0)


async def test_context_window_starts_at_the_last_marked_message(store: HistoryStore) -> None:
    cid = await _chat(store)
    for role, ids in [("user", [1, 2, 3]), ("assistant", [4, 5]), ("user", [6])]:
        await store.append_message(cid, role, role, ids)
    await store.append_message(cid, "assistant", "r", [7], expected_start=6)
    # A new window: its first message holds the whole new prompt, from position 0.
    with pytest.raises(HistoryConflict):
        await store.append_message(
            cid, "user", "w", [1, 9, 9], starts_context=True, expected_start=5
        )
    m = await store.append_message(
        cid, "user", "w", [1, 9, 9], starts_context=True, expected_start=7
    )
    assert (m.seq, m.token_start, m.starts_context) == (4, 0, True)
    r = await store.append_message(cid, "assistant", "x", [8, 8], expected_start=3)
    assert (r.seq, r.token_start, r.starts_context) == (5, 3, False)
    assert await store.stream(cid) == [1, 9, 9, 8, 8]
    assert await store.token_count(cid) == 5
    assert len(await store.messages(cid)) == 6  # the earlier turns stay in the history
    reader = store.token_history(timeout=10)
    assert await asyncio.to_thread(reader.read, cid, 0, 5) == [1, 9, 9, 8, 8]
    assert await asyncio.to_thread(reader.read, cid, 2, 4) == [9, 8]
    with pytest.raises(HistoryError):
        await asyncio.to_thread(reader.read, cid, 0, 6)
    await store.truncate(cid, 4)  # cuts inside the window only
    assert await store.stream(cid) == [1, 9, 9, 8]
    assert [m.token_ids for m in await store.messages(cid)][:4] == [[1, 2, 3], [4, 5], [6], [7]]
    # A second window replaces the first.
    await store.append_message(cid, "user", "v", [2, 2], starts_context=True, expected_start=4)
    assert await store.stream(cid) == [2, 2]


async def test_delete_last_message_takes_back_only_the_last(store: HistoryStore) -> None:
    cid = await _chat(store)
    a = await store.append_message(cid, "user", "a", [1])
    b = await store.append_message(cid, "user", "b", [2, 3], starts_context=True)
    assert not await store.delete_last_message(cid, a.id)
    assert await store.delete_last_message(cid, b.id)
    assert [m.content for m in await store.messages(cid)] == ["a"]
    assert await store.stream(cid) == [1]  # the window it opened is gone with it


async def test_upgrade_from_0001_keeps_messages(db_url: str) -> None:
    await asyncio.to_thread(migrate.upgrade, db_url, "0001")
    s = HistoryStore(db_url)
    await s.start()
    try:
        async with s.engine.begin() as conn:
            await conn.execute(
                text(
                    "INSERT INTO users (id, name, token_hash, created) "
                    "VALUES ('u', 'ada', 'h', CURRENT_TIMESTAMP)"
                )
            )
            await conn.execute(
                text(
                    "INSERT INTO conversations (id, owner_id, title, created, updated) "
                    "VALUES ('c', 'u', '', CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)"
                )
            )
            await conn.execute(
                text(
                    "INSERT INTO messages (conversation_id, seq, role, content, token_ids, "
                    "token_start, token_count, created) "
                    "VALUES ('c', 0, 'user', 'hi', '[1, 2]', 0, 2, CURRENT_TIMESTAMP)"
                )
            )
        await asyncio.to_thread(migrate.upgrade, db_url)
        assert migrate.current(db_url) == head()
        [m] = await s.messages("c")
        assert (m.content, m.token_ids, m.starts_context) == ("hi", [1, 2], False)
        assert await s.stream("c") == [1, 2]
    finally:
        await s.close()


async def test_prefix_lookup_is_per_owner_and_rewind_cuts(store: HistoryStore) -> None:
    ada, _ = await store.create_user("ada")
    bob, _ = await store.create_user("bob")
    mine = await store.create_conversation(ada.id, session_key="tab")
    theirs = await store.create_conversation(bob.id)
    for cid in (mine.id, theirs.id):
        await store.append_message(cid, "user", "hi", [1, 2])
        await store.append_message(cid, "assistant", "yo", [3], prefix_hash="h1")
    await store.append_message(mine.id, "user", "more", [4], starts_context=True)
    await store.append_message(mine.id, "assistant", "ok", [5], prefix_hash="h2")
    found = await store.find_prefixes(ada.id, ["h1", "h2", "nope"])
    assert sorted((m.conversation_id, m.seq, m.prefix_hash, m.last_seq) for m in found) == [
        (mine.id, 1, "h1", 3),
        (mine.id, 3, "h2", 3),
    ]
    assert (await store.conversation_by_key(ada.id, "tab")).id == mine.id
    assert await store.conversation_by_key(bob.id, "tab") is None
    # Cutting back past a window's opener reports it; the older window is the stream again.
    assert await store.rewind(mine.id, 2, "be brief") is True
    assert [m.content for m in await store.messages(mine.id)] == ["hi", "yo"]
    assert await store.stream(mine.id) == [1, 2, 3]
    assert (await store.get_conversation(mine.id)).system_prompt == "be brief"
    assert await store.rewind(mine.id, 2, "be brief") is False
    assert len(await store.messages(theirs.id)) == 2


async def test_fork_and_responses(store: HistoryStore) -> None:
    """A fork copies messages up to one (tokens, positions, windows); a response names its
    reply, gives item ids, is per owner, and goes with its conversation."""
    from store import ApiResponse

    cid = await _chat(store)
    conv = await store.get_conversation(cid)
    roles = ["user", "assistant", "user", "assistant"]
    msgs = [
        await store.append_message(cid, r, f"m{i}", [i] * 3, starts_context=i == 2)
        for i, r in enumerate(roles)
    ]
    child = await store.fork_conversation(cid, msgs[2].id, conv.system_prompt)
    assert child.owner_id == conv.owner_id and child.id != cid
    copied = await store.messages(child.id)
    assert [(m.seq, m.role, m.token_ids, m.token_start, m.starts_context) for m in copied] == [
        (m.seq, m.role, m.token_ids, m.token_start, m.starts_context) for m in msgs[:3]
    ]
    assert await store.stream(child.id) == [2, 2, 2]
    assert await store.last_message_id(child.id) == copied[-1].id
    assert await store.fork_conversation(cid, copied[0].id, None) is None  # not its message

    resp = ApiResponse(
        id="resp_1", owner_id=conv.owner_id, conversation_id=cid, message_id=msgs[3].id,
        body={"id": "resp_1"}, input_items=[{"id": "msg_a"}],
    )  # fmt: skip
    await store.add_response(resp, "msg_b", ["msg_a"])
    assert [m.item_id for m in await store.messages(cid)] == [None, None, "msg_a", "msg_b"]
    other, _ = await store.create_user("eve")
    assert await store.get_response("resp_1", other.id) is None
    got = await store.get_response("resp_1", conv.owner_id)
    assert got.body == {"id": "resp_1"} and got.message_id == msgs[3].id
    assert not await store.delete_response("resp_1", other.id)
    await store.delete_conversation(cid)
    assert await store.get_response("resp_1", conv.owner_id) is None
