"""bench/int4_weights.py's parts, small: the weights' size counts a tied tensor once, and a
decode step over pools of its own gives one row of logits per row."""

from __future__ import annotations

import torch

from bench.int4_weights import decode_step, weight_bytes
from engine.model.decoder import Decoder
from engine.model.shapes import DUMMY_SHAPES


def test_weight_bytes_counts_the_tied_embedding_once():
    model = Decoder(DUMMY_SHAPES["tiny"]).to(torch.bfloat16)
    unique = {p.data_ptr(): p.nbytes for p in model.parameters()}
    assert weight_bytes(model) == sum(unique.values())


def test_a_decode_step_gives_each_row_its_logits():
    model = Decoder(DUMMY_SHAPES["tiny"]).to(torch.bfloat16).eval()
    logits = decode_step(model, rows=3, context=40)()
    assert logits.shape == (3, model.args.vocab_size)
    assert torch.isfinite(logits).all()
