"""The Dynamo worker's conversation finder (app/dynamo_worker/prefixes.py): a prompt finds
the conversation whose stream it shares most of, by full chunks, then token by token."""

from __future__ import annotations

from app.dynamo_worker.prefixes import Match, Streams


def test_a_prompt_finds_the_conversation_it_extends():
    s = Streams(chunk_size=4)
    s.put("a", list(range(10)))
    s.put("b", [*range(4), 99, 98, 97, 96, 95])
    assert s.match([*range(10), 50, 51]) == Match("a", 10, 10)  # extends a's whole stream
    assert s.match([*range(6), 7]) == Match("a", 6, 10)  # shares part of a: a fork
    assert s.match([*range(4), 99, 98, 97, 96, 1]) == Match("b", 8, 9)
    assert s.match([1, 2, 3, 4, 5]) is None  # no full chunk in common
    assert s.match([0, 1, 2]) is None  # shorter than a chunk


def test_a_forgotten_or_rewritten_stream_is_no_longer_found():
    s = Streams(chunk_size=4)
    s.put("a", list(range(8)))
    s.put("a", [*range(4), 9, 9, 9, 9])
    assert s.match([*range(8), 1]) == Match("a", 4, 8)
    s.forget("a")
    assert s.match([*range(8), 1]) is None and not s.by_key
