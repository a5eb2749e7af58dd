"""bench/window_memory.py: the KV bytes of a Gemma 3 conversation, by hand and from an engine."""

from __future__ import annotations

from bench.window_memory import held
from engine.model.shapes import DUMMY_SHAPES


def test_gemma_3_1b_at_8k_tokens():
    h = held("gemma-3-1b", DUMMY_SHAPES["gemma-3-1b"], 8192)
    per_token_layer = 2 * 1 * 256 * 2  # K and V, 1 KV head of 256 dims, bfloat16
    assert (h.sliding_layers, h.global_layers, h.window) == (22, 4, 512)
    assert h.all_layers_bytes == 26 * 8192 * per_token_layer
    # Positions 7681..8191 lie in chunks 240..255: 16 chunks a sliding layer still reads.
    assert h.window_only_bytes == (4 * 8192 + 22 * 16 * 32) * per_token_layer


def test_a_conversation_inside_the_window_saves_nothing():
    h = held("gemma-3-1b", DUMMY_SHAPES["gemma-3-1b"], 500)
    assert h.all_layers_bytes == h.window_only_bytes and h.ratio == 1.0


def test_the_engine_holds_what_the_arithmetic_says():
    """A simulated engine's pages for one 8k-token Gemma 3 1B conversation: within 10% of
    the arithmetic (a padded page and one chunk more at most), 4-5x fewer bytes than keeping
    every layer (whose bytes the engine holds exactly)."""
    from bench.window_memory import row

    r = row("dummy:gemma-3-1b", 8192, "sim:h100", 2)
    assert 1.0 <= r["window_vs_arithmetic"] <= 1.1, r
    assert r["engine_every_layer_bytes"] == r["arithmetic_every_layer_bytes"]
    assert r["engine_ratio"] > 4, r
