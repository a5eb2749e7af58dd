"""A GGUF's linears beyond Q4_0 / Q4_1 (engine/model/gguf_weights.py): Q4_K read as 4-bit codes
dequantizes exactly as gguf does; other types are refused by name; Gemma 3 270M's Q4_K_M GGUF
(the extra `gemma`: skipped without it) served with its 4-bit linears as loaded gives the
dequantized model's greedy tokens."""

from __future__ import annotations

import functools
import importlib.util

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import kernels
from engine.model import gemma270m
from engine.model.families.checkpoint import iter_own
from engine.model.gguf_weights import _PARTS, KEPT_DENSE, Q4Weight, _blocks, read_q4
from engine.model.int4 import Int4Linear, swap_int4
from engine.model.loader import Checkpoint, bundle_gguf, load, model_args, model_dir

gguf = pytest.importorskip("gguf")

installed = pytest.mark.skipif(
    importlib.util.find_spec(gemma270m.PACKAGE) is None,
    reason="the optional extra 'gemma' (Gemma 3 270M) is not installed",
)
GEMMA = gemma270m.NAME


def q4_k_blocks(rows: int, cols: int, seed: int) -> np.ndarray:
    """Random Q4_K super-blocks uint8 [rows, cols / 256 * 144] with finite d and dmin."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, cols // 256, 144), dtype=np.uint8)
    scale = rng.uniform(1e-4, 1e-2, (rows, cols // 256, 2)).astype(np.float16)
    raw[..., :4] = scale.view(np.uint8).reshape(rows, cols // 256, 4)
    return raw.reshape(rows, -1)


def test_q4_k_dequantizes_exactly_as_gguf():
    """Bit for bit in float32: scale d * sc and minimum -dmin * m are exact products, and the
    dequantization rounds twice (product, then sum) as gguf's numpy one does."""
    raw = q4_k_blocks(48, 512, seed=0)
    w = _blocks(raw, "Q4_K")
    assert w.codes.shape == (48, 512) and w.codes.max() <= 15 and w.scales.shape == (48, 16)
    ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_K)
    assert torch.equal(w.dequantize(), torch.from_numpy(ref))
    x = torch.randn(8, 512, generator=torch.Generator().manual_seed(0))
    got = Int4Linear(w, None, torch.float32)(x)
    torch.testing.assert_close(got, F.linear(x, w.dequantize()), rtol=1e-4, atol=1e-4)


def test_an_unsupported_type_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="no 4-bit weights of GGUF type Q5_0"):
        _blocks(np.zeros((4, 22), np.uint8), "Q5_0")
    path = tmp_path / "q3.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    q3 = gguf.GGMLQuantizationType.Q3_K
    nbytes = gguf.GGML_QUANT_SIZES[q3][1]
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((8, nbytes), np.uint8), raw_dtype=q3)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"blk\.0\.attn_q\.weight is Q3_K: weights='gguf'"):
        read_q4(path, model_args("dummy:tiny"))


def greedy(model, ids: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """`steps` greedy tokens, one a step over a KV pool of the sequence's own, and the
    logits at every position of the prompt."""
    a, block = model.args, 32
    n = -(-(len(ids) + steps) // block)
    shape = (n, block, a.n_kv_heads, a.head_dim)
    pools = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(a.n_layers)]
    table = [list(range(n))]
    rows = torch.arange(len(ids))
    meta = kernels.AttentionMetadata.build([len(ids)], [0], table, "cpu")
    with torch.no_grad():
        first = model(torch.tensor(ids), rows, pools, meta, rows, rows)
        out = [int(first[-1].argmax())]
        for p in range(len(ids), len(ids) + steps - 1):
            meta = kernels.AttentionMetadata.build([1], [p], table, "cpu")
            at = torch.tensor([p])
            logits = model(torch.tensor(out[-1:]), at, pools, meta, at, torch.tensor([0]))
            out.append(int(logits[-1].argmax()))
    return out, first


@functools.cache
def gemma_reader():
    return gguf.GGUFReader(bundle_gguf(GEMMA))  # ~10-20 s: open it once


@functools.cache
def gemma_q4() -> dict[str, Q4Weight]:
    return read_q4(gemma_reader(), model_args(GEMMA))


@installed
def test_gemma_linears_as_loaded_equal_the_converted_checkpoint():
    """Q4_K_M is mixed: wo is Q4_K in every layer, w2 Q4_K in half the layers (Q6_K in the
    others); wqkv (Q5_0, v Q8_0 in half) and w13 (Q5_0) stay dequantized. Every 4-bit linear
    dequantizes exactly to the checkpoint's; and the GGUF's parts of two layers' every linear,
    dequantized by gguf in the decoder's row order with no permutation (llama.cpp permutes
    only Llama's q and k), are the checkpoint's: the names map, Gemma's q and k as written."""
    args = model_args(GEMMA)
    own = dict(iter_own(args, Checkpoint(model_dir(GEMMA))))
    weights = gemma_q4()
    wo = {f"layers.{i}.wo.weight" for i in range(args.n_layers)}
    assert wo <= weights.keys() and len(weights) == args.n_layers + args.n_layers // 2
    for name, w in weights.items():
        assert name.split(".")[2] in ("wo", "w2"), name
        assert torch.equal(w.dequantize(), own[name]), name
    parts: dict[str, dict[int, torch.Tensor]] = {}
    kinds = set()
    for t in gemma_reader().tensors:
        layer, _, rest = t.name.removeprefix("blk.").partition(".")
        part = rest.removesuffix(".weight")
        if not t.name.startswith("blk.") or int(layer) > 1 or part not in _PARTS:
            continue
        kinds.add(t.tensor_type.name)
        linear, order = _PARTS[part]
        dense = gguf.quants.dequantize(t.data, t.tensor_type)
        parts.setdefault(f"layers.{layer}.{linear}.weight", {})[order] = torch.from_numpy(dense)
    assert len(parts) == 8 and kinds == {"Q4_K", "Q5_0", "Q6_K", "Q8_0"}
    assert kinds - {"Q4_K"} <= set(KEPT_DENSE)
    for name, ps in parts.items():
        assert torch.equal(torch.cat([ps[i] for i in sorted(ps)]), own[name]), name


@installed
def test_gemma_with_its_4bit_linears_gives_the_dequantized_models_greedy_tokens():
    """float32: the dequantized model and the same model with its 27 Q4_K linears swapped for
    Int4Linear give the same 12 greedy tokens on two prompts, and logits within 2e-3."""
    loaded = load(GEMMA, torch.device("cpu"), torch.float32)
    model, tok = loaded.model, loaded.tokenizer
    prompts = [
        tok.encode(
            tok.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
            ),
            add_special_tokens=False,
        )
        for q in ("What is the capital of France?", "Write a haiku about the sea.")
    ]

    dense = [greedy(model, p, 12) for p in prompts]
    assert swap_int4(model, gemma_q4(), torch.float32) == 27
    int4 = [greedy(model, p, 12) for p in prompts]
    for (d_ids, d_logits), (q_ids, q_logits) in zip(dense, int4, strict=True):
        assert d_ids == q_ids
        assert (d_logits - q_logits).abs().max() <= 2e-3
