"""Model families against Hugging Face transformers: small random-weight checkpoints of Llama,
Qwen2 (non-zero q/k/v biases), Mistral, OPT, Qwen3 (q/k norms, head_dim from the config),
SmolLM3 (layers without RoPE), Phi-3 (fused checkpoints, partial rotary dims, LongRoPE),
Gemma 3 (sliding and global layers, each with its RoPE base) and Qwen3-MoE, built and saved
by transformers as safetensors dirs with the bundled tokenizer; every family that has a
sliding window slides in them (Qwen2, Qwen3, SmolLM3, Gemma 3: some layers; Mistral, Phi-3,
Qwen3-MoE: all), shorter than the conversations; strict refusals; hub ids."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import kernels
from engine import Engine, EngineConfig, SamplingParams, Turn
from engine.model.decoder import Decoder
from engine.model.families.base import UnsupportedModel
from engine.model.families.checkpoint import to_hf
from engine.model.loader import convert_bundled, load
from engine.model.shapes import BUNDLED_VOCAB, DUMMY_SHAPES, ModelArgs
from tests.devices import cuda, gpu
from tests.engine.test_engine_equality import check_against_hf
from tests.oracle import hf_greedy

FAMILIES = [
    "llama",
    "qwen2",
    "mistral",
    "opt",
    "qwen3",
    "smollm3",
    "phi3",
    "gemma3_text",
    "qwen3_moe",
    "gpt_oss",
]
CPU = torch.device("cpu")
SMALL = {
    "vocab_size": BUNDLED_VOCAB,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 1024,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}


def hf_config(family: str, **kw):
    import transformers as tf

    if family == "opt":
        return tf.OPTConfig(**SMALL, ffn_dim=128, word_embed_proj_dim=64, **kw)
    classes = {
        "llama": tf.LlamaConfig,
        "qwen2": tf.Qwen2Config,
        "mistral": tf.MistralConfig,
        "qwen3": tf.Qwen3Config,
        "smollm3": tf.SmolLM3Config,
        "phi3": tf.Phi3Config,
        "gemma3_text": tf.Gemma3TextConfig,
        "qwen3_moe": tf.Qwen3MoeConfig,
        "gpt_oss": tf.GptOssConfig,
    }
    # Sliding windows off the 32-token chunks; conversations run to ~260 tokens, past them.
    extra = {
        # Layer 1 slides (from max_window_layers on), layer 0 attends to everything.
        "qwen2": {
            "tie_word_embeddings": True,
            "use_sliding_window": True,
            "sliding_window": 40,
            "max_window_layers": 1,
        },
        "mistral": {"sliding_window": 48},  # every layer
        # head_dim not hidden_size / heads (16): read from the config. layer_types slides
        # layer 0 and not layer 1, which max_window_layers cannot say.
        "qwen3": {
            "head_dim": 32,
            "use_sliding_window": True,
            "sliding_window": 48,
            "layer_types": ["sliding_attention", "full_attention"],
        },
        # Layers 1 and 3 without RoPE (transformers' flags: 1 = rotates); they slide.
        "smollm3": {
            "num_hidden_layers": 4,
            "no_rope_layers": [1, 0, 1, 0],
            "use_sliding_window": True,
            "sliding_window": 44,
        },
        # Phi-4-mini's kind: 3/4 of each head rotated, LongRoPE (short factors up to 512);
        # every layer slides over 52 keys.
        "phi3": {
            "sliding_window": 52,
            "partial_rotary_factor": 0.75,
            "original_max_position_embeddings": 512,
            "rope_scaling": {
                "rope_type": "longrope",
                "short_factor": [1.0 + 0.15 * i for i in range(6)],
                "long_factor": [3.0 + i for i in range(6)],
            },
            "tie_word_embeddings": True,
        },
        # Gemma 3: layer 2 global (linear RoPE scaling), the others slide over 24 keys with
        # their own RoPE base; a query scale that is not head_dim's.
        "gemma3_text": {
            "num_hidden_layers": 4,
            "head_dim": 32,
            "sliding_window": 24,
            "query_pre_attn_scalar": 24,
            "layer_types": ["sliding_attention"] * 2 + ["full_attention", "sliding_attention"],
            "rope_parameters": {
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
        },
        # 8 experts, 2 a token, renormalised; layer 1 dense (MoE's defaults are a 30B shape).
        # Every layer slides: its model reads no max_window_layers (as the hub's configs set).
        "qwen3_moe": {
            "num_hidden_layers": 3,
            "use_sliding_window": True,
            "sliding_window": 56,
            "max_window_layers": 1,
            "head_dim": 32,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "norm_topk_prob": True,
            "moe_intermediate_size": 32,
            "mlp_only_layers": [1],
        },
        # gpt-oss: layers 0 and 2 slide over 48 keys, layer 1 attends to all; sinks; YaRN
        # (x4 over 256 original positions: interpolated low frequencies, an attention
        # factor); 8 experts, 2 a token, with biases and the clamped SwiGLU
        "gpt_oss": {
            "num_hidden_layers": 3,
            "head_dim": 32,
            "sliding_window": 48,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "intermediate_size": 32,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 256,
            },
        },
    }
    shape = {"num_key_value_heads": 2, "intermediate_size": 128}
    return classes[family](**SMALL | shape | extra.get(family, {}) | kw)


def save_checkpoint(path: Path, config, seed: int = 0, bundled_tokenizer: bool = True) -> Path:
    """Random weights (biases non-zero, norms near 1) saved by transformers, with the
    bundled tokenizer beside them (or a one-word one, where the bundled model's package is
    missing: a bare GPU machine)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, p.shape[-1] ** -0.5)
            elif "norm" in name and name.endswith(".weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.2)
    model.save_pretrained(path)
    if bundled_tokenizer:
        AutoTokenizer.from_pretrained(convert_bundled(None)).save_pretrained(path)
    else:
        one_word_tokenizer().save_pretrained(path)
    return path


def one_word_tokenizer():
    """A tokenizer made here, for token-id tests: it knows two words."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(WordLevel({"<unk>": 0, "</s>": 2}, unk_token="<unk>"))
    return PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>", eos_token="</s>")


def hf_from(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    made: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in made:
            made[family] = save_checkpoint(tmp_path_factory.mktemp(family), hf_config(family))
        return made[family]

    return get


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equality_through_swaps_and_drops(family, checkpoint, tmp_path):
    """3 turns x 4 conversations; 9 GPU chunks hold any one conversation but not two."""
    path = checkpoint(family)
    engine = Engine(
        EngineConfig(
            model=str(path),
            device="cpu",
            gpu_cache_chunks=9,
            cpu_cache_chunks=4,
            max_batch_tokens=64,
            cache_dir=str(tmp_path),
        )
    )
    assert engine.args.family == family
    hf = hf_from(path)
    counters = check_against_hf(
        engine, hf, max_tokens=24, seed=1, min_len=40, max_len=64, ignore_eos=True
    )
    assert counters["swapped_in_tokens"] > 0, counters
    assert counters["recomputed_tokens"] > 0, counters


@pytest.mark.timeout(240)
@pytest.mark.parametrize("family", ["phi3", "gemma3_text"])
def test_two_ranks_equal_transformers(checkpoint, tmp_path, family):
    """Tensor parallelism (gloo, 2 ranks) on new families: Phi-3's fused q/k/v and gate/up
    tensors split by heads, partial rotary dims per head, the tied head split by vocabulary
    rows; Gemma 3's sliding layers per rank, its four norms a layer. (q/k norms act on whole
    heads: replicated, like every norm.) 5 GPU chunks do not hold one conversation: swaps
    and recomputes (Phi-3: chunks gone before the window instead)."""
    path = checkpoint(family)
    engine = Engine(
        EngineConfig(
            model=str(path),
            device="cpu",
            tensor_parallel=2,
            gpu_cache_chunks=5,
            cpu_cache_chunks=2,
            max_batch_tokens=64,
            cache_dir=str(tmp_path),
        )
    )
    try:
        assert engine.backend.tp.world == 2
        counters = check_against_hf(
            engine,
            hf_from(path),
            n_convs=2,
            max_tokens=8,
            seed=1,
            min_len=40,
            max_len=64,
            ignore_eos=True,
        )
        # Phi-3's every layer slides: its chunks before the window are gone, not recomputed
        gone = any(t.gone for t in engine.cache.held())
        assert counters["swapped_in_tokens"] > 0, counters
        assert counters["recomputed_tokens"] > 0 or (family == "phi3" and gone), counters
    finally:
        engine.close()


def own_logits(model: Decoder, ids: list[int]) -> torch.Tensor:
    """The decoder's logits at every position of one prompt, over a pool of its own."""
    a, block = model.args, 32
    n = -(-len(ids) // block)
    shape = (n, block, a.n_kv_heads, a.head_dim)
    pools = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(a.n_layers)]
    meta = kernels.AttentionMetadata.build([len(ids)], [0], [list(range(n))], "cpu")
    rows = torch.arange(len(ids))
    return model(torch.tensor(ids), rows, pools, meta, rows, rows)


def without(model: Decoder, **change) -> Decoder:
    """The same weights under changed args (a feature turned off)."""
    other = Decoder(replace(model.args, **change))
    other.load_state_dict(model.state_dict())
    return other.eval()


@pytest.mark.parametrize(
    "family, change",
    [
        ("qwen3", "qk_norm"),
        ("smollm3", {"no_rope_layers": ()}),
        ("phi3", "partial_rotary_factor"),
        ("phi3", "short_factor"),
        ("phi3", "attention_factor"),
        ("qwen2", {"sliding_window": None}),
        ("qwen2", {"full_layers": ()}),
        ("qwen3", {"sliding_window": None}),
        ("qwen3", {"full_layers": ()}),
        ("smollm3", {"sliding_window": None}),
        ("smollm3", {"full_layers": ()}),
        ("phi3", {"sliding_window": None}),
        ("mistral", {"sliding_window": None}),
        ("qwen3_moe", {"sliding_window": None}),
        ("qwen3_moe", {"full_layers": (0,)}),  # as max_window_layers would say: not read
        ("gemma3_text", {"sliding_window": None}),
        ("gemma3_text", {"rope_local_theta": None}),
        ("gemma3_text", {"rope_scaling": None}),
        ("gemma3_text", {"query_pre_attn_scalar": None}),
        ("gemma3_text", {"full_layers": ()}),
        ("qwen3_moe", {"norm_topk_prob": False}),
        ("gpt_oss", "sinks"),
        ("gpt_oss", {"sliding_window": None}),
        ("gpt_oss", {"full_layers": ()}),
        ("gpt_oss", {"rope_scaling": None}),
        ("gpt_oss", "attention_factor"),
        ("gpt_oss", "truncate"),
        ("gpt_oss", {"routing": "softmax_topk"}),
    ],
)
def test_what_each_family_adds_is_exact_and_matters(family, change, checkpoint):
    """Logits equal transformers' at every position of a 200-token prompt, and turning off
    what the family adds changes them: the equality checks above can fail."""
    path = checkpoint(family)
    model = load(str(path), CPU, torch.float32).model
    ids = list(range(1000, 1200))
    with torch.no_grad():
        want = hf_from(path)(input_ids=torch.tensor([ids])).logits[0]
    got = own_logits(model, ids)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    a = model.args
    if change == "qk_norm":
        for layer in model.layers:
            layer.q_norm = layer.k_norm = torch.nn.Identity()
        off = model
    elif change == "sinks":
        for layer in model.layers:
            layer.sinks = None
        off = model
    elif family == "gpt_oss" and isinstance(change, str):  # YaRN's attention factor, truncate
        off = without(model, rope_scaling=a.rope_scaling | {change: change == "truncate" or 1.0})
    elif isinstance(change, dict):
        off = without(model, **change)
    else:  # phi3's rotary dims and LongRoPE
        scaling = dict(a.rope_scaling)
        if change == "partial_rotary_factor":  # whole heads, their extra pairs unscaled
            scaling["short_factor"] = scaling["short_factor"] + [1.0, 1.0]
            off = without(model, rope_scaling=scaling, partial_rotary_factor=1.0)
        else:
            scaling[change] = 1.0 if change == "attention_factor" else [1.0] * 6
            off = without(model, rope_scaling=scaling)
    assert (own_logits(off, ids) - want).abs().max() > 1e-2


def test_qwen3_moe_unnormalised_routing_equals_transformers(tmp_path):
    """norm_topk_prob off (the top-k softmax weights as they are), through swaps and drops."""
    path = save_checkpoint(tmp_path / "raw", hf_config("qwen3_moe", norm_topk_prob=False))
    test_greedy_equality_through_swaps_and_drops("qwen3_moe", lambda _: path, tmp_path)


def test_qwen3_moe_reads_fused_experts_and_its_config_aliases(checkpoint, tmp_path):
    """Experts fused as transformers 5 holds them ([E, 2I, H] gate/up, [E, H, I] down) load
    the same weights as one tensor per expert (the hub's names, what transformers saves);
    `num_local_experts` (transformers' alias) reads as `num_experts`; dense layers follow
    `mlp_only_layers` and `decoder_sparse_step`; training-only keys are accepted."""
    src = checkpoint("qwen3_moe")

    def fuse(state: dict) -> dict:
        out = {k: v for k, v in state.items() if ".experts." not in k}
        for i in (0, 2):
            p = f"model.layers.{i}.mlp.experts."
            each = [
                [state[f"{p}{e}.{w}_proj.weight"] for w in ("gate", "up", "down")] for e in range(8)
            ]
            out[p + "gate_up_proj"] = torch.stack([torch.cat(x[:2]) for x in each])
            out[p + "down_proj"] = torch.stack([x[2] for x in each])
        return out

    fused = _rewrite(src, tmp_path / "fused", tensors=fuse)
    a, b = load(str(src), CPU, torch.float32).model, load(str(fused), CPU, torch.float32).model
    assert a.args == b.args and a.args.dense_layers == (1,) and b.layers[1].moe is None
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(x, y), name

    config = hf_config("qwen3_moe").to_dict()
    config["num_experts"] = config.pop("num_local_experts", config.get("num_experts"))
    config |= {"output_router_logits": True, "router_aux_loss_coef": 0.5}
    args = ModelArgs.from_hf(config | {"mlp_only_layers": [], "decoder_sparse_step": 2})
    assert args.n_experts == 8 and args.dense_layers == (0, 2)
    assert ModelArgs.from_hf(args.to_hf()) == args


def _gpt_oss_experts_quantized(state: dict) -> tuple[dict, dict]:
    """(a checkpoint whose experts are MXFP4 blocks and scales, as the hub ships gpt-oss;
    the same checkpoint with those experts dequantized, in transformers' layout)."""
    from engine.model.mxfp4 import dequantize_mxfp4, quantize_mxfp4

    packed, plain = dict(state), dict(state)
    for name in [k for k in state if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = quantize_mxfp4(state[name].transpose(1, 2))  # [E, out, in] on the hub
        del packed[name]
        packed[name + "_blocks"], packed[name + "_scales"] = blocks, scales
        plain[name] = dequantize_mxfp4(blocks, scales).transpose(1, 2).contiguous()
    return packed, plain


def test_gpt_oss_mxfp4_experts_load_dequantized(checkpoint, tmp_path):
    """A checkpoint with MXFP4 experts (`*_blocks`, `*_scales`, a `quantization_config`) loads
    the weights of the same checkpoint with those experts dequantized; the round trip is not
    the identity (4-bit values), so the comparison can fail; half a pair is refused."""
    src = checkpoint("gpt_oss")
    quant = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    packed = _rewrite(
        src,
        tmp_path / "mxfp4",
        config=lambda c: c | {"quantization_config": quant},
        tensors=lambda s: _gpt_oss_experts_quantized(s)[0],
    )
    plain = _rewrite(src, tmp_path / "plain", tensors=lambda s: _gpt_oss_experts_quantized(s)[1])
    a, b = load(str(packed), CPU, torch.float32).model, load(str(plain), CPU, torch.float32).model
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(x, y), name
    orig = load(str(src), CPU, torch.float32).model
    assert not torch.equal(orig.layers[0].moe.w13, a.layers[0].moe.w13)
    torch.testing.assert_close(orig.layers[0].sinks, a.layers[0].sinks)

    half = "model.layers.1.mlp.experts.down_proj_scales"
    broken = _rewrite(
        packed, tmp_path / "half", tensors=lambda s: {k: v for k, v in s.items() if k != half}
    )
    with pytest.raises(
        UnsupportedModel, match=r"lacks tensors: model\.layers\.1\.mlp\.experts\.down"
    ):
        load(str(broken), CPU, torch.float32)


def test_gpt_oss_published_config_reads_as_transformers_does():
    """gpt-oss-20b's config.json as published (rope_scaling and rope_theta at the top, an
    MXFP4 quantization_config): the dummy shape, YaRN's frequencies and attention factor as
    transformers computes them (truncate false), and back through `to_hf`."""
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from engine.model.decoder import rope_attention_factor, rope_inv_freq

    config = {
        "architectures": ["GptOssForCausalLM"],
        "attention_bias": True,
        "attention_dropout": 0.0,
        "eos_token_id": 200002,
        "experts_per_token": 4,
        "head_dim": 64,
        "hidden_act": "silu",
        "hidden_size": 2880,
        "initial_context_length": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 2880,
        "layer_types": ["sliding_attention", "full_attention"] * 12,
        "max_position_embeddings": 131072,
        "model_type": "gpt_oss",
        "num_attention_heads": 64,
        "num_experts_per_tok": 4,
        "num_hidden_layers": 24,
        "num_key_value_heads": 8,
        "num_local_experts": 32,
        "output_router_logits": False,
        "pad_token_id": 199999,
        "quantization_config": {
            "modules_to_not_convert": [
                "model.layers.*.self_attn",
                "model.layers.*.mlp.router",
                "model.embed_tokens",
                "lm_head",
            ],
            "quant_method": "mxfp4",
        },
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "factor": 32.0,
            "original_max_position_embeddings": 4096,
            "rope_type": "yarn",
            "truncate": False,
        },
        "rope_theta": 150000,
        "router_aux_loss_coef": 0.9,
        "sliding_window": 128,
        "swiglu_limit": 7.0,
        "tie_word_embeddings": False,
        "use_cache": True,
        "vocab_size": 201088,
    }
    args = ModelArgs.from_hf(config)
    assert args == DUMMY_SHAPES["gpt-oss-20b"] and args.max_context == 131072
    assert args.window(0) == 128 and args.window(1) is None
    assert ModelArgs.from_hf(args.to_hf()) == args
    hf = GptOssConfig(**{k: v for k, v in config.items() if k != "model_type"})
    inv, factor = ROPE_INIT_FUNCTIONS["yarn"](hf, None)
    assert torch.equal(rope_inv_freq(args), inv)
    assert rope_attention_factor(args) == factor > 1.0


def test_qwen2_biases_are_loaded_and_matter(checkpoint):
    """The check above can fail: without its q/k/v biases the model answers otherwise."""
    path = checkpoint("qwen2")
    loaded = load(str(path), CPU, torch.float32)
    assert loaded.args.qkv_bias and not loaded.args.o_bias and loaded.args.tie_embeddings
    bias = loaded.model.layers[0].wqkv.bias
    assert bias is not None and bias.abs().min() > 0
    hf = hf_from(path)
    prompt = list(range(300, 340))
    with_bias = hf_greedy(hf, prompt, 12, set())
    with torch.no_grad():
        for layer in hf.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.zero_()
    assert hf_greedy(hf, prompt, 12, set()) != with_bias


WINDOWED = ["qwen2", "mistral", "qwen3", "smollm3", "phi3", "gemma3_text", "qwen3_moe", "gpt_oss"]


@pytest.mark.parametrize("family", WINDOWED)
def test_sliding_windows_do_not_cap_the_context(family, checkpoint, tmp_path):
    """Each layer attends within its own window, so the context runs to max_position (Phi-3
    here: LongRoPE's original 512): one turn decodes from inside the window to past it
    (Gemma 3's: five times), equal to transformers."""
    path = checkpoint(family)
    engine = Engine(
        EngineConfig(model=str(path), device="cpu", gpu_cache_chunks=16, cache_dir=str(tmp_path))
    )
    assert engine.args.spec.exact_window and engine.args.sliding_window < 60
    assert engine.max_context == (512 if family == "phi3" else 1024)
    prompt = list(range(100, 110))
    r = engine.run([Turn("w", prompt, SamplingParams(max_tokens=140, ignore_eos=True))])[0]
    assert r.token_ids == hf_greedy(hf_from(path), prompt, 140, set())


@pytest.mark.timeout(300)
def test_compiled_cpu_forward_keeps_each_layers_window(checkpoint, tmp_path):
    """The compiled CPU forward's attention op carries each layer's window and sinks: gpt-oss
    (sliding and full layers alternating, sinks in each) past its window equals transformers
    there too, from the one graph compiled at start (its experts one opaque op, its steps'
    slots and tables one per page group). (Gemma 3's windows take the same op argument; its
    eager path is tested above.)"""
    from torch._dynamo.utils import counters

    path = checkpoint("gpt_oss")
    before = counters["stats"]["unique_graphs"]
    engine = Engine(
        EngineConfig(
            model=str(path),
            device="cpu",
            compile_cpu=True,
            gpu_cache_chunks=16,
            cache_dir=str(tmp_path),
        )
    )
    assert engine.runner.compiled is not None
    prompt = list(range(200, 240))
    r = engine.run([Turn("c", prompt, SamplingParams(max_tokens=40, ignore_eos=True))])[0]
    assert r.token_ids == hf_greedy(hf_from(path), prompt, 40, set())
    assert counters["stats"]["unique_graphs"] == before + 1, "a step recompiled the forward"


def test_gemma3_fused_path_keeps_the_sandwich_norms(checkpoint):
    """The fused path's residual bookkeeping (CUDA's) with Gemma's norms after each branch:
    Gemma 3 calls none of the fused kernels (its norms, q/k norms and GELU are its own), so
    the path runs here and gives the plain path's logits."""
    model = load(str(checkpoint("gemma3_text")), CPU, torch.float32).model
    ids = list(range(500, 580))
    plain = own_logits(model, ids)
    model.fused = True
    torch.testing.assert_close(own_logits(model, ids), plain, rtol=1e-5, atol=1e-5)
    with torch.device("meta"):  # as a GPU load builds it
        assert Decoder(DUMMY_SHAPES["gemma-3-1b"]).embed_scale[torch.bfloat16] == 34.0


def hf_windows(family: str, config: dict) -> list[int | None]:
    """Each layer's sliding window as transformers' model (built on the meta device) attends:
    the attention module's own where it keeps one per layer (Qwen2, Qwen3, SmolLM3,
    Qwen3-MoE), the config's for every layer where the mask takes it from there (Phi-3)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = AutoConfig.for_model(family, **config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf)
    windows = [
        getattr(x.self_attn, "sliding_window", hf.sliding_window) for x in model.model.layers
    ]
    types = getattr(hf, "layer_types", None)
    if types is not None and hasattr(model.model, "has_sliding_layers"):  # masks by type
        assert [w is not None for w in windows] == [t == "sliding_attention" for t in types]
    return windows


SHAPE = {"hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 64, "vocab_size": 64}
TOKENS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}


@pytest.mark.parametrize(
    "family, config",
    [
        # Qwen2.5-7B-Instruct's keys (the older layout: no layer_types): no window
        ("qwen2", {"use_sliding_window": False, "sliding_window": 131072, "max_window_layers": 2}),
        # the older layout with a window: the layers from max_window_layers on slide
        ("qwen2", {"use_sliding_window": True, "sliding_window": 40, "max_window_layers": 1}),
        ("qwen3", {"use_sliding_window": True, "sliding_window": 40}),  # default 28: none
        # transformers 5's layout: layer_types says which layers slide, max_window_layers not
        (
            "qwen3",
            {
                "use_sliding_window": True,
                "sliding_window": 40,
                "max_window_layers": 1,
                "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            },
        ),
        # Qwen3-8B's keys: no window
        ("qwen3", {"use_sliding_window": False, "sliding_window": None, "max_window_layers": 3}),
        # every layer, whatever max_window_layers says; none without use_sliding_window
        ("qwen3_moe", {"use_sliding_window": True, "sliding_window": 40, "max_window_layers": 1}),
        ("qwen3_moe", {"use_sliding_window": False, "sliding_window": 40}),
        # SmolLM3-3B's keys: no window
        ("smollm3", {"use_sliding_window": False, "sliding_window": None}),
        # no layer_types: the layers without RoPE slide (the 3rd here: interval 3)
        (
            "smollm3",
            {"use_sliding_window": True, "sliding_window": 40, "no_rope_layer_interval": 3},
        ),
        (
            "smollm3",
            {
                "use_sliding_window": True,
                "sliding_window": 40,
                "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
            },
        ),
        # Phi-3-mini-4k: every layer slides over 2047 keys, the context runs to 4096
        ("phi3", {"sliding_window": 2047, "max_position_embeddings": 4096}),
        ("phi3", {"sliding_window": None}),
    ],
)
def test_windows_are_read_as_transformers_places_them(family, config):
    """Which layers slide, from either key layout (transformers 5's `layer_types`, or
    `max_window_layers` / the layers without RoPE), equal to each layer's window in
    transformers' model; the context is never capped by a window."""
    config = SHAPE | TOKENS | {"num_hidden_layers": 3} | config
    if family == "qwen3_moe":
        config |= {"num_experts": 2, "num_experts_per_tok": 1, "moe_intermediate_size": 16}
    args = ModelArgs.from_hf({"model_type": family} | config)
    want = hf_windows(family, config)
    assert [args.window(i) for i in range(args.n_layers)] == want
    assert args.max_context == args.max_position
    assert ModelArgs.from_hf(args.to_hf()) == args
    written = {k: v for k, v in args.to_hf().items() if k != "model_type"}
    assert hf_windows(family, written | TOKENS) == want


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), reason="needs TRITON_INTERPRET=1"
)
def test_gpt_oss_triton_path_equals_the_plain_one(checkpoint):
    """CUDA's path run by the Triton interpreter: fused norms, RoPE (YaRN's cos and sin,
    scaled) fused with the KV write, Triton attention with sinks and windows, a prompt past
    the window and then decode steps: the plain PyTorch path's logits."""
    model = load(str(checkpoint("gpt_oss")), CPU, torch.float32).model
    a, block, n = model.args, 32, 70
    ids = torch.tensor(list(range(500, 500 + n + 2)))
    table = list(range(-(-(n + 2) // block)))

    def run(backend: str) -> torch.Tensor:
        shape = (len(table), block, a.n_kv_heads, a.head_dim)
        pools = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(a.n_layers)]
        rows = torch.arange(n)
        meta = kernels.AttentionMetadata.build([n], [0], [table], "cpu")
        out = [model(ids[:n], rows, pools, meta, rows, rows, backend=backend)]
        for p in (n, n + 1):
            at = torch.tensor([p])
            meta = kernels.AttentionMetadata.build([1], [p], [table], "cpu")
            out.append(
                model(ids[p : p + 1], at, pools, meta, at, torch.tensor([0]), backend=backend)
            )
        return torch.cat(out)

    model.fused = False
    want = run("torch")
    model.fused = True
    torch.testing.assert_close(run("triton"), want, rtol=1e-4, atol=1e-4)


def test_gemma3_final_softcapping_is_exact(tmp_path):
    """final_logit_softcapping (None in Gemma 3's configs, set in Gemma 2's) is applied."""
    path = save_checkpoint(tmp_path / "g", hf_config("gemma3_text", final_logit_softcapping=2.0))
    model = load(str(path), CPU, torch.float32).model
    ids = list(range(1000, 1060))
    with torch.no_grad():
        want = hf_from(path)(input_ids=torch.tensor([ids])).logits[0]
    assert want.abs().max() <= 2.0
    torch.testing.assert_close(own_logits(model, ids), want, rtol=1e-4, atol=1e-4)


def test_gemma3_published_config_reads_as_transformers_does():
    """Gemma 3 4B's text config as published (the older keys: sliding_window_pattern,
    rope_local_base_freq, rope_scaling): the same layer types, RoPE bases and scaling as
    transformers reads, the attention scale from query_pre_attn_scalar."""
    from transformers import Gemma3TextConfig

    config = {
        "model_type": "gemma3_text",
        "vocab_size": 262208,
        "hidden_size": 2560,
        "intermediate_size": 10240,
        "num_hidden_layers": 34,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 131072,
        "query_pre_attn_scalar": 256,
        "rms_norm_eps": 1e-6,
        "rope_local_base_freq": 10000.0,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "rope_theta": 1000000.0,
        "sliding_window": 1024,
        "sliding_window_pattern": 6,
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
    }
    args = ModelArgs.from_hf(config)
    hf = Gemma3TextConfig(**{k: v for k, v in config.items() if k != "model_type"})
    full = [i for i, t in enumerate(hf.layer_types) if t == "full_attention"]
    assert args.full_layers == tuple(full) == (5, 11, 17, 23, 29)
    assert args.rope_theta == hf.rope_parameters["full_attention"]["rope_theta"]
    assert args.rope_local_theta == hf.rope_parameters["sliding_attention"]["rope_theta"]
    assert args.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert args.attn_scale == 256**-0.5 and args.tie_embeddings
    assert args == DUMMY_SHAPES["gemma-3-4b"] and args.max_context == 131072
    assert args.window(4) == 1024 and args.window(5) is None


def _rewrite(src: Path, dst: Path, config=None, tensors=None) -> Path:
    """A copy of checkpoint `src` with its config or tensors changed."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    if config is not None:
        data = json.loads((src / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps(config(data)))
    if tensors is not None:
        state = load_file(str(src / "model.safetensors"))
        save_file(tensors(state), str(dst / "model.safetensors"))
    return dst


def test_unknown_model_type_is_refused(checkpoint, tmp_path):
    path = _rewrite(
        checkpoint("llama"), tmp_path / "x", config=lambda c: c | {"model_type": "gpt2"}
    )
    with pytest.raises(UnsupportedModel, match="model_type 'gpt2' is not supported"):
        load(str(path), CPU, torch.float32)


def test_unused_tensors_are_refused_not_dropped(checkpoint, tmp_path):
    """Qwen2 weights under a llama config: the q/k/v biases would go unused, so: refused."""
    as_llama = _rewrite(
        checkpoint("qwen2"),
        tmp_path / "a",
        config=lambda c: c | {"model_type": "llama", "architectures": ["LlamaForCausalLM"]},
    )
    with pytest.raises(UnsupportedModel, match=r"does not use.*self_attn\.k_proj\.bias"):
        load(str(as_llama), CPU, torch.float32)

    extra = _rewrite(
        checkpoint("opt"), tmp_path / "b", tensors=lambda s: s | {"score.weight": torch.ones(2, 64)}
    )
    with pytest.raises(UnsupportedModel, match="does not use.*score.weight"):
        load(str(extra), CPU, torch.float32)

    up = "model.layers.1.mlp.up_proj.weight"
    lacking = _rewrite(
        checkpoint("llama"),
        tmp_path / "c",
        tensors=lambda s: {k: v for k, v in s.items() if k != up},
    )
    with pytest.raises(UnsupportedModel, match=f"lacks tensors: {up}"):
        load(str(lacking), CPU, torch.float32)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"word_embed_proj_dim": 32}, "word_embed_proj_dim 32 != hidden_size 64"),
        ({"do_layer_norm_before": False}, "do_layer_norm_before=false"),
        ({"activation_function": "swish"}, "activation 'swish'"),
    ],
)
def test_unsupported_opt_variants_are_refused(change, message):
    config = hf_config("opt").to_dict() | change
    with pytest.raises(UnsupportedModel, match=message):
        ModelArgs.from_hf(config)


def test_phi4_mini_config_reads_as_transformers_does():
    """Phi-4-mini's config.json as published (the older key layout): 96 of 128 dims rotated,
    LongRoPE's short factors and attention factor as transformers computes them, and the
    context stops at the original 4096 positions."""
    from transformers import Phi3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from engine.model.decoder import rope_attention_factor, rope_inv_freq

    factors = [1.0 + 0.05 * i for i in range(48)]
    config = {
        "model_type": "phi3",
        "vocab_size": 200064,
        "hidden_size": 3072,
        "intermediate_size": 8192,
        "num_hidden_layers": 32,
        "num_attention_heads": 24,
        "num_key_value_heads": 8,
        "partial_rotary_factor": 0.75,
        "max_position_embeddings": 131072,
        "original_max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "rope_scaling": {"type": "longrope", "short_factor": factors, "long_factor": factors},
        "sliding_window": 262144,
        "tie_word_embeddings": True,
        "rms_norm_eps": 1e-5,
    }
    args = ModelArgs.from_hf(config)
    assert (args.head_dim, args.rotary_dim, args.max_context) == (128, 96, 4096)
    assert args.tie_embeddings and args.rope_scaling["rope_type"] == "longrope"
    hf = Phi3Config(**{k: v for k, v in config.items() if k != "model_type"})
    inv, factor = ROPE_INIT_FUNCTIONS["longrope"](hf, None)
    assert torch.equal(rope_inv_freq(args), inv)
    assert rope_attention_factor(args) == factor > 1.0


@pytest.mark.parametrize(
    "family, change, message",
    [
        ("qwen3", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope scaling 'yarn'"),
        ("smollm3", {"no_rope_layers": [1, 0]}, "no_rope_layers has 2 entries for 4 layers"),
        # transformers' sdpa mask would slide layers 1 and 3, flash attention would not
        ("smollm3", {"use_sliding_window": False}, "use_sliding_window is off"),
        # a sliding layer without a window: transformers' mask raises
        ("qwen2", {"use_sliding_window": False}, "sliding layers but no sliding_window"),
        ("qwen3", {"layer_types": ["sliding_attention"]}, "layer_types has 1 entries"),
        ("phi3", {"rope_scaling": {"rope_type": "dynamic"}}, "rope scaling 'dynamic'"),
        ("gemma3_text", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        ("gemma3_text", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ("gemma3_text", {"layer_types": ["chunked_attention"] * 4}, "chunked_attention"),
        ("gemma3_text", {"layer_types": ["full_attention"]}, "layer_types has 1 entries"),
        (
            "gemma3_text",
            {"rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 2.0}}},
            "rope scaling 'yarn'",
        ),
        (
            "qwen3_moe",
            {"shared_expert_intermediate_size": 64},
            "shared_expert_intermediate_size=64",
        ),
        ("qwen3_moe", {"scoring_func": "sigmoid"}, "scoring_func='sigmoid'"),
        ("qwen3_moe", {"num_experts_per_tok": 9}, "num_experts_per_tok 9 of 8 experts"),
        ("gpt_oss", {"quantization_config": {"quant_method": "gptq"}}, "quantization 'gptq'"),
        ("gpt_oss", {"layer_types": ["chunked_attention"] * 3}, "chunked_attention"),
        ("gpt_oss", {"layer_types": ["full_attention"]}, "layer_types has 1 entries"),
        ("gpt_oss", {"num_experts_per_tok": 9}, "num_experts_per_tok 9 of 8 experts"),
        ("gpt_oss", {"rope_scaling": {"rope_type": "dynamic"}}, "rope scaling 'dynamic'"),
    ],
)
def test_unsupported_variants_of_the_new_families_are_refused(family, change, message):
    config = hf_config(family).to_dict()
    config.pop("rope_parameters", None)
    with pytest.raises(UnsupportedModel, match=message):
        ModelArgs.from_hf(config | change)


@pytest.mark.parametrize("family", ["mistral", "phi3", "qwen3_moe"])
def test_a_window_on_some_layers_is_refused_where_transformers_slides_all(family):
    args = ModelArgs.from_hf(hf_config(family, sliding_window=40).to_dict())
    with pytest.raises(UnsupportedModel, match="every layer slides, or none"):
        replace(args, full_layers=(0,)).to_hf()


def test_hub_id_resolves_from_the_local_cache(checkpoint, tmp_path, monkeypatch):
    """A hub cache laid out as huggingface_hub writes it (blobs, a snapshot of links, a
    ref); offline, so a missing model is a clear error rather than a download."""
    from huggingface_hub import scan_cache_dir

    src, cache, commit = checkpoint("llama"), tmp_path / "hub", "0123456789abcdef" * 2 + "01234567"
    repo = cache / "models--acme--tiny-llama"
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for f in src.iterdir():
        blob = repo / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copy(f, blob)
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    assert [r.repo_id for r in scan_cache_dir(cache).repos] == ["acme/tiny-llama"]
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    from_hub, from_dir = (
        load("acme/tiny-llama", CPU, torch.float32),
        load(str(src), CPU, torch.float32),
    )
    assert from_hub.args == from_dir.args and from_hub.tokenizer is not None
    assert torch.equal(from_hub.model.layers[1].w2.weight, from_dir.model.layers[1].w2.weight)
    with pytest.raises(ValueError, match="'acme/absent' is not in the local Hugging Face cache"):
        load("acme/absent", CPU, torch.float32)


@pytest.mark.parametrize(
    "shape, billions",
    [
        ("opt-13b", 12.85),
        ("llama-2-70b", 69.25),
        ("gemma-3-1b", 1.0),
        ("gemma-3-4b", 3.88),
        ("gpt-oss-20b", 20.91),
    ],
)
def test_large_dummy_shapes_match_transformers_on_the_meta_device(shape, billions):
    """The paper-scale shapes allocate nothing here; they have transformers' parameter count
    and tensor names for the same config."""
    from transformers import AutoConfig, AutoModelForCausalLM

    args = DUMMY_SHAPES[shape]
    config = args.to_hf()
    with torch.device("meta"):
        ours = Decoder(args)
        hf = AutoModelForCausalLM.from_config(
            AutoConfig.for_model(config.pop("model_type"), **config)
        )
    n = sum(p.numel() for p in ours.parameters())
    assert n == sum(p.numel() for p in hf.parameters())
    assert abs(n / 1e9 - billions) < 0.05, n
    theirs = set(hf.state_dict()) - ({"lm_head.weight"} if args.tie_embeddings else set())
    assert set(to_hf(args, ours.state_dict())) == theirs


# ---- CUDA ------------------------------------------------------------------------------------


@gpu
@cuda
@pytest.mark.parametrize("family", FAMILIES)
def test_cuda_greedy_equals_transformers(family, tmp_path):
    """float32 on the GPU (Triton attention, fused elementwise kernels, CUDA graphs for
    decode): every family's greedy tokens equal transformers' over 3 turns of 4
    conversations of token ids, through swaps and recomputes."""
    import random

    config = hf_config(family)
    path = save_checkpoint(tmp_path / family, config, bundled_tokenizer=False)
    engine = Engine(
        EngineConfig(
            model=str(path),
            device="cuda",
            dtype="float32",
            gpu_cache_chunks=9,
            cpu_cache_chunks=4,
            max_batch_tokens=64,
            cache_dir=str(tmp_path),
        )
    )
    hf = hf_from(path).to("cuda")
    rng = random.Random(1)
    contexts: list[list[int]] = [[] for _ in range(4)]
    sp = SamplingParams(max_tokens=24, ignore_eos=True)
    for t in range(3):
        lens = [rng.randint(40, 64) for _ in contexts]
        plan = [[rng.randrange(100, config.vocab_size) for _ in range(n)] for n in lens]
        results = engine.run([Turn(f"g{i}", p, sp) for i, p in enumerate(plan)])
        for i, r in enumerate(results):
            contexts[i] += plan[i]
            assert r.token_ids == hf_greedy(hf, contexts[i], 24, set(), device="cuda"), (i, t)
            contexts[i] += r.token_ids
        engine.cache.check()
    counters = engine.snapshot().counters
    assert counters.swapped_in_tokens > 0 and counters.recomputed_tokens > 0, counters


@gpu
@cuda
def test_cuda_gemma3_dummy_shape_triton_equals_reference():
    """Gemma 3 1B's shape on the GPU (head_dim 256, 4 query heads over 1 KV head, a window of
    512): a 700-token prompt and then a decode step at position 700, with Triton attention
    and the fused kernels, give the logits of the PyTorch reference path (float32)."""
    model = load("dummy:gemma-3-1b", torch.device("cuda"), torch.float32).model
    a, block, n = model.args, 32, 700
    ids = torch.randint(0, a.vocab_size, (n + 1,), generator=torch.Generator().manual_seed(0))
    ids, table = ids.cuda(), list(range(-(-(n + 1) // block)))

    def run(backend: str) -> torch.Tensor:
        shape = (len(table), block, a.n_kv_heads, a.head_dim)
        pools = [
            (torch.zeros(shape, device="cuda"), torch.zeros(shape, device="cuda"))
            for _ in range(a.n_layers)
        ]
        rows = torch.arange(n, device="cuda")
        meta = kernels.AttentionMetadata.build([n], [0], [table], "cuda")
        prompt = model(ids[:n], rows, pools, meta, rows, rows, backend=backend)
        at = torch.tensor([n], device="cuda")
        meta = kernels.AttentionMetadata.build([1], [n], [table], "cuda")
        step = model(
            ids[n:], at, pools, meta, at, torch.tensor([0], device="cuda"), backend=backend
        )
        return torch.cat([prompt, step])

    got, want = run("triton"), run("torch")
    assert a.window(0) == 512 and n > a.window(0)
    err = (got - want).abs().max() / want.abs().max()
    assert err < 1e-3, err
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.99
