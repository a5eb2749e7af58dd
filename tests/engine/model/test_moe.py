"""The mixture-of-experts layer (engine/model/moe.py): its gating against transformers' router,
its two paths (one matmul per expert, grouped) against a per-token reference, and on CUDA the
grouped path (bfloat16) against the loop and transformers, and under CUDA graphs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kernels
from engine import Engine, EngineConfig, SamplingParams, Turn
from engine.model.decoder import Decoder
from engine.model.loader import load
from engine.model.moe import MoE, experts_forward, gated, graph_safe, pick, route
from engine.model.shapes import DUMMY_SHAPES
from tests.devices import cuda, gpu


@pytest.mark.parametrize("normalize", [True, False])
def test_route_is_transformers_router(normalize):
    """Softmax in float32 over all experts, the top k, renormalised or not."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    config = Qwen3MoeConfig(
        hidden_size=32, num_experts=8, num_experts_per_tok=3, norm_topk_prob=normalize
    )
    router = Qwen3MoeTopKRouter(config)
    torch.manual_seed(0)
    torch.nn.init.normal_(router.weight)
    x = torch.randn(20, 32)
    _, want_w, want_e = router(x)
    weights, experts = route(F.linear(x, router.weight), 3, normalize)
    assert torch.equal(experts, want_e)
    torch.testing.assert_close(weights, want_w)
    sums = weights.sum(-1)
    assert torch.allclose(sums, torch.ones(20)) == normalize
    assert (weights[:, :-1] >= weights[:, 1:]).all()  # largest first


def test_gpt_oss_route_is_transformers_router():
    """gpt-oss: the router's logits with their bias, the top k of them, then a softmax over
    those k (not over every expert)."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter

    router = GptOssTopKRouter(
        GptOssConfig(hidden_size=32, num_local_experts=8, num_experts_per_tok=3)
    )
    torch.manual_seed(0)
    torch.nn.init.normal_(router.weight)
    torch.nn.init.normal_(router.bias)
    x = torch.randn(20, 32)
    _, want_w, want_e = router(x)
    weights, experts = route(F.linear(x, router.weight, router.bias), 3, False, "topk_softmax")
    assert torch.equal(experts, want_e)
    torch.testing.assert_close(weights, want_w)
    other, _ = route(F.linear(x, router.weight, router.bias), 3, False)
    assert (other - weights).abs().max() > 1e-2  # softmax over all experts first: not it


@pytest.mark.parametrize("path", ["loop"])
def test_gpt_oss_moe_is_transformers_mlp(path):
    """gpt-oss's experts (biases, interleaved gate/up de-interleaved when loaded, the clamped
    SwiGLU) against transformers' `GptOssMLP` on the same weights, with inputs large enough
    that the clamp acts: without it the output differs."""
    from dataclasses import replace

    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    from engine.model.families.checkpoint import to_own

    config = GptOssConfig(
        hidden_size=32, intermediate_size=16, num_local_experts=6, num_experts_per_tok=2
    )
    hf = GptOssMLP(config)
    torch.manual_seed(0)
    for p in hf.parameters():
        torch.nn.init.normal_(p)
    args = replace(
        DUMMY_SHAPES["gpt-oss-20b"],
        dim=32,
        moe_intermediate_size=16,
        intermediate_size=16,
        n_experts=6,
        top_k=2,
        n_layers=1,
    )
    state = {f"model.layers.0.mlp.{k}": v for k, v in hf.state_dict().items()}
    own = {
        k.removeprefix("layers.0.moe."): v
        for k, v in to_own(args, _with_the_rest(args, state)).items()
        if k.startswith("layers.0.moe.")
    }
    moe = MoE(args)
    moe.load_state_dict(own)
    moe.path = path
    x = torch.randn(9, 32)
    with torch.no_grad():
        want, _ = hf(x[None])
        got = moe(x)
        torch.testing.assert_close(got, want[0], rtol=1e-4, atol=1e-4)
        moe.glu = gated(F.silu)
        assert (moe(x) - want[0]).abs().max() > 1e-2
        from engine.model.moe import clamped_swiglu

        moe.glu = clamped_swiglu(1.702, 1e9)  # the same SwiGLU, unclamped
        assert (moe(x) - want[0]).abs().max() > 1e-2


def _with_the_rest(args, state: dict) -> dict:
    """`state` (one layer's MLP) completed with the other tensors a checkpoint of `args` has."""
    from engine.model.families.checkpoint import to_hf

    with torch.device("meta"):
        names = to_hf(args, Decoder(args).state_dict())
    return {k: state.get(k, torch.zeros(v.shape)) for k, v in names.items()}


def per_token(x, weights, experts, w13, w2) -> torch.Tensor:
    """The definition, token by token and expert by expert."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t].tolist(), experts[t].tolist(), strict=True):
            gate, up = (w13[e] @ x[t]).chunk(2)
            out[t] += w * (w2[e] @ (F.silu(gate) * up))
    return out


def grouped_runs_here() -> bool:
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        torch._grouped_mm(torch.ones(2, 8), torch.ones(1, 8, 8), offs=torch.tensor([2]).int())
    except (RuntimeError, NotImplementedError):
        return False
    return True


PATHS = [
    "loop",
    pytest.param(
        "grouped",
        marks=pytest.mark.skipif(not grouped_runs_here(), reason="no CPU torch._grouped_mm"),
    ),
]


@pytest.mark.parametrize("path", PATHS)
def test_experts_grouped_by_expert_equal_the_definition(path):
    """17 tokens, 2 of 6 experts each; expert 5 gets no token (its run is empty)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(17, 16, generator=g)
    w13 = torch.randn(6, 2 * 8, 16, generator=g) / 4
    w2 = torch.randn(6, 16, 8, generator=g) / 3
    logits = torch.randn(17, 6, generator=g)
    logits[:, 5] = -1e4
    weights, experts = route(logits, 2, True)
    got = experts_forward(x, weights, experts, w13, w2, gated(F.silu), path)
    torch.testing.assert_close(got, per_token(x, weights, experts, w13, w2), rtol=1e-5, atol=1e-5)


def test_the_cpu_runs_experts_one_by_one_and_graphs_need_no_host_sync():
    assert pick("cpu", torch.float32) == pick("cpu", torch.bfloat16) == "loop"
    assert graph_safe(0, torch.device("cpu"), torch.float32)  # a dense model
    assert not graph_safe(8, torch.device("cpu"), torch.float32)


# ---- CUDA ------------------------------------------------------------------------------------


def logits_of(model: Decoder, ids: list[int], device: str) -> torch.Tensor:
    """The decoder's logits at every position of one prompt, over a pool of its own."""
    a, block, dtype = model.args, 32, model.embed.weight.dtype
    n = -(-len(ids) // block)
    shape = (n, block, a.n_kv_heads, a.head_dim)
    pools = [
        (
            torch.zeros(shape, device=device, dtype=dtype),
            torch.zeros(shape, device=device, dtype=dtype),
        )
        for _ in range(a.n_layers)
    ]
    meta = kernels.AttentionMetadata.build([len(ids)], [0], [list(range(n))], device)
    rows = torch.arange(len(ids), device=device)
    return model(torch.tensor(ids, device=device), rows, pools, meta, rows, rows)


@gpu
@cuda
def test_cuda_grouped_experts_equal_the_loop_and_transformers(tmp_path):
    """bfloat16 on CUDA: `torch._grouped_mm` is the path; its logits are the loop's (up to
    bfloat16 rounding) and close to transformers' in float32 on the same weights."""
    from tests.engine.model.test_model_families import hf_config, hf_from, save_checkpoint

    assert pick("cuda", torch.bfloat16) == "grouped", "torch._grouped_mm does not run here"
    path = save_checkpoint(tmp_path / "m", hf_config("qwen3_moe"), bundled_tokenizer=False)
    model = load(str(path), torch.device("cuda"), torch.bfloat16).model
    ids = list(range(1000, 1100))
    grouped = logits_of(model, ids, "cuda")
    for layer in model.layers:
        if layer.moe is not None:
            layer.moe.path = "loop"
    loop = logits_of(model, ids, "cuda")
    assert (grouped - loop).abs().max() <= 0.05 * loop.abs().max()
    with torch.no_grad():
        want = hf_from(path).to("cuda")(input_ids=torch.tensor([ids], device="cuda")).logits[0]
    assert (grouped - want).abs().max() <= 0.05 * want.abs().max()  # greedy ties would flip


@gpu
@cuda
@torch.no_grad()
def test_cuda_graphs_capture_grouped_experts(tmp_path):
    """bfloat16: the grouped experts have no host sync, so a CUDA graph captures them and
    its replays are the eager results; an engine of dummy:tiny-moe decodes from its graphs."""
    moe = MoE(DUMMY_SHAPES["tiny-moe"]).to("cuda", torch.bfloat16)
    for p in moe.parameters():
        p.normal_(0.0, p.shape[-1] ** -0.5)
    x = torch.randn(16, 256, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up off the capture, as torch asks
        moe(x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe(x)
    for seed in (1, 2):
        x.copy_(torch.randn(x.shape, generator=torch.Generator().manual_seed(seed)))
        graph.replay()
        assert torch.equal(out, moe(x))

    kw = dict(model="dummy:tiny-moe", device="cuda", dtype="bfloat16", gpu_cache_chunks=32)
    engine = Engine(EngineConfig(**kw, max_running=8, cache_dir=str(tmp_path)))
    assert engine.runner.graphs is not None
    sp = SamplingParams(max_tokens=16, ignore_eos=True)
    prompts = [list(range(100 + i, 140 + 3 * i)) for i in range(4)]
    results = engine.run([Turn(f"c{i}", p, sp) for i, p in enumerate(prompts)])
    assert [len(r.token_ids) for r in results] == [16] * 4
    assert engine.runner.graphs.replays > 0


def test_tensor_parallel_refuses_experts():
    """Experts are not split across ranks: refused before any rank starts."""
    with pytest.raises(ValueError, match="experts are not split across ranks"):
        Engine(EngineConfig(model="dummy:tiny-moe", device="cpu", tensor_parallel=2))


def test_qwen3_30b_a3b_shape_is_transformers_on_the_meta_device():
    """The decode report's MoE shape allocates nothing here: transformers' parameter count
    (30.5B) for the same config."""
    from transformers import AutoConfig, AutoModelForCausalLM

    args = DUMMY_SHAPES["qwen3-30b-a3b"]
    config = args.to_hf()
    with torch.device("meta"):
        ours = Decoder(args)
        hf = AutoModelForCausalLM.from_config(
            AutoConfig.for_model(config.pop("model_type"), **config)
        )
    n = sum(p.numel() for p in ours.parameters())
    assert n == sum(p.numel() for p in hf.parameters())
    assert abs(n / 1e9 - 30.53) < 0.01, n
