"""Constrained decoding: each guided turn's grammar matcher, and a step's token masks.

A `Guide` (JSON schema, any JSON object, Lark grammar or regex) compiles to an llguidance
grammar (`check`, no tokenizer needed: the server calls it before a turn starts). `Guides`,
one per engine, builds the llguidance tokenizer once, on the first guided turn, and one
`Matcher` per guided turn. Before each forward, `Guides.masks` plans the step's constrained
rows (rows with a guide, rows still under their `min_tokens`) and starts filling their
bitmask on the host in a thread, overlapped with the forward; the sampler applies it to
the logits on their device (engine/sampler.py), and the engine feeds the chosen token back
to the matcher (`Matcher.consume`). A finished grammar allows only the model's stop tokens,
so a guided turn ends with "stop".

llguidance is imported only here and only when a turn has a guide: the engine serves
unguided turns without it installed.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.types import Guide

# JSON on one line with the usual separators, and no free whitespace elsewhere: a small
# model cannot wander off into endless blank lines between two keys.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_OBJECT = '{"type": "object"}'


def _llguidance():
    try:
        import llguidance
    except ImportError as e:  # an optional dependency on a bare GPU machine
        raise ValueError(
            "constrained decoding (response_format, guides) needs the llguidance package"
        ) from e
    return llguidance


def grammar_of(guide: Guide) -> str:
    """The llguidance grammar of `guide` (not yet checked)."""
    llg = _llguidance()
    m = llg.LLMatcher
    if guide.kind in ("json_schema", "json_object"):
        source = guide.source if guide.kind == "json_schema" else ANY_OBJECT
        try:
            schema = json.loads(source)
        except (TypeError, ValueError) as e:
            raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, dict | bool):
            raise ValueError("the JSON schema must be a JSON object")
        try:
            return m.grammar_from_json_schema(source, overrides=JSON_OPTIONS)
        except ValueError as e:
            raise ValueError(f"invalid JSON schema: {e}") from None
    if not isinstance(guide.source, str) or not guide.source:
        raise ValueError(f"a {guide.kind} guide needs a non-empty source")
    if guide.kind == "lark":
        return m.grammar_from_lark(guide.source)
    if guide.kind == "regex":
        return m.grammar_from_regex(guide.source)
    raise ValueError(f"unknown guide kind {guide.kind!r}")


def check(guide: Guide) -> str:
    """Compile and validate `guide`; its grammar, or ValueError saying what is wrong."""
    grammar = grammar_of(guide)
    error = _llguidance().LLMatcher.validate_grammar(grammar)
    if error:
        raise ValueError(f"invalid {guide.kind.replace('_', ' ')}: {error.strip()}")
    return grammar


class Matcher:
    """One guided turn's position in its grammar (an llguidance matcher)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    @property
    def stopped(self) -> bool:
        """The grammar is complete: only a stop token may follow."""
        return self.inner.is_stopped()

    def consume(self, token: int) -> None:
        """The token the sampler chose; ValueError if the grammar refuses it."""
        if not self.inner.consume_token(token):
            raise ValueError(f"the guide refused token {token}: {self.inner.get_error()}")


@dataclass
class MaskPlan:
    """Which sampled rows of a step are constrained, and how (pure bookkeeping).

    `guided`: (row, matcher, ban_stops) for rows with a guide; `banned`: (row, token ids) for
    unguided rows whose stop tokens are masked (fewer outputs than their `min_tokens`)."""

    guided: list[tuple[int, Matcher, bool]] = field(default_factory=list)
    banned: list[tuple[int, tuple[int, ...]]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.guided or self.banned)


def plan_masks(
    rows: Sequence[tuple[Matcher | None, int, int, tuple[int, ...]]], stops: Sequence[int]
) -> MaskPlan:
    """`rows`: per sampled row (its matcher or None, outputs so far, min_tokens, the turn's own
    stop token ids). The model's `stops` and the turn's own are masked while a row has fewer
    than min_tokens outputs; a guided row's grammar, once complete, still allows its stop."""
    out = MaskPlan()
    for r, (matcher, n_out, min_tokens, own) in enumerate(rows):
        early = n_out < min_tokens
        if matcher is not None:
            out.guided.append((r, matcher, early))
        elif early:
            out.banned.append((r, tuple(dict.fromkeys((*stops, *own)))))
    return out


@dataclass
class StepMask:
    """A step's masks, ready for the sampler: `bits` [len(rows), words] int32 on the host,
    bit t of row i set where row `rows[i]` may take token t; `banned`: (row, token ids)."""

    rows: list[int]
    bits: torch.Tensor | None
    banned: list[tuple[int, tuple[int, ...]]]


class MaskJob:
    """A step's mask being filled on the host while the forward runs."""

    def __init__(self, p: MaskPlan, fut: Future | None, bits: torch.Tensor | None) -> None:
        self.plan, self.fut, self.bits = p, fut, bits

    def result(self) -> StepMask:
        if self.fut is not None:
            self.fut.result()
        return StepMask([r for r, _, _ in self.plan.guided], self.bits, self.plan.banned)


class Guides:
    """One engine's grammars: the llguidance tokenizer (built on first use), a matcher per
    guided turn, and the step's mask fill (in a thread, alongside the forward)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: Sequence[int]) -> None:
        self.hf_tokenizer = tokenizer
        self.stops = tuple(sorted(stop_ids))
        self.vocab = max(vocab_size, len(tokenizer) if tokenizer is not None else 0)
        self.words = (self.vocab + 31) // 32
        self.tokenizer: Any = None  # llguidance's, built once (about 0.3 s)
        self.executor: Any = None  # llguidance's parallel mask fill
        self.thread: ThreadPoolExecutor | None = None
        self._bits: torch.Tensor | None = None  # reused host buffer

    def _ready(self) -> None:
        if self.tokenizer is not None:
            return
        if self.hf_tokenizer is None:
            raise ValueError("constrained decoding needs the model's tokenizer")
        llg = _llguidance()
        import llguidance.hf

        self.tokenizer = llguidance.hf.from_tokenizer(
            self.hf_tokenizer, n_vocab=self.vocab, eos_token=list(self.stops)
        )
        self.executor = llg.LLExecutor()
        self.thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="guide")

    def matcher(self, guide: Guide) -> Matcher:
        """A new turn's matcher; ValueError for a guide that does not compile (the matcher
        checks it against the tokenizer too)."""
        grammar = grammar_of(guide)
        self._ready()
        inner = _llguidance().LLMatcher(self.tokenizer, grammar, log_level=0)
        if inner.is_error():
            raise ValueError(f"invalid {guide.kind.replace('_', ' ')}: {inner.get_error()}")
        return Matcher(inner)

    def masks(self, p: MaskPlan, overlap: bool = True) -> MaskJob:
        """Start filling the host bitmask of the planned rows (in the guide thread when
        `overlap`); `MaskJob.result()` waits for it."""
        if not p.guided:
            return MaskJob(p, None, None)
        n = len(p.guided)
        if self._bits is None or self._bits.shape[0] < n:
            self._bits = torch.empty((max(n, 8), self.words), dtype=torch.int32)
        bits = self._bits[:n]
        if overlap and self.thread is not None:
            return MaskJob(p, self.thread.submit(self._fill, p, bits), bits)
        self._fill(p, bits)
        return MaskJob(p, None, bits)

    def _fill(self, p: MaskPlan, bits: torch.Tensor) -> None:
        matchers = [(g[1].inner, i) for i, g in enumerate(p.guided)]
        self.executor.unsafe_compute_mask_ptr(matchers, bits.data_ptr(), self.words * 4, len(bits))
        for i, (_, _, ban) in enumerate(p.guided):
            if ban:
                _ban_stops(bits[i], self.stops)

    def close(self) -> None:
        if self.thread is not None:
            self.thread.shutdown(wait=False)


def _ban_stops(row: torch.Tensor, stops: Sequence[int]) -> None:
    """Clear the stop tokens' bits of one row, unless nothing else would be left."""
    kept = row.clone()
    for t in stops:
        row[t // 32] &= ~(1 << (t % 32)) if t % 32 < 31 else 0x7FFFFFFF
    if not bool(row.any()):
        row.copy_(kept)
