"""A steady state of the serving replay, computed once by the simulator and resumed on any
engine (the GPU report's steady part, its rehearsal and its twin start from the same file).

A warm-up in virtual time (`warm_up`: the sample repeated, arriving at a rate for
`steady_cut_s`) is cut and written (`State`). A run seeds an engine with it (`seeds`,
`Engine.seed`: each conversation's history, the tier of each chunk, its last activity) and
replays its continuation (`resume`): live conversations at their next turn, the turns in
flight at the cut going on from where they were (sending them again from their start left
a backlog near the bound that a 53 s run did not clear), new conversations arriving from
where the warm-up's stopped.

The file, `<mode>-<rate>.json` (`State.to_json`), one row a conversation live or holding
chunks at the cut (those in flight first, in the engine's order):

    {"format": "pensieve-steady/1", "mode", "rate", "think_s", "cut_s", "seed", "sample",
     "sample_size", "next_index", "gpu_cache_chunks", "cpu_cache_chunks", "chunk_size",
     "simulated", "git_commit", "summary", "warmup_metrics",
     "columns": ["index", "turns", "kv", "residency", "idle_s", "next_s", "partial"],
     "conversations": [[index, turns, kv, "d12c5g8", idle_s, next_s, partial], ...]}

`index` in the repeated sample (`nth`); `turns` done; `kv` positions its chunks stand for;
residency run-length encoded (`d` dropped, `k` disk, `c` cpu, `g` gpu, `b` both); seconds
since its last activity and to its next turn (0: in flight; null: ended, held until
evicted); `partial` `[p, g]`: a turn in flight had computed `p` prompt and `g` reply
tokens. A chunk shared by several conversations is held by the first only. A reply's
tokens in a seeded history are 0s, as the simulator samples them.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from bench.lib import workload as wl
from bench.lib.metrics import cache_use, steady_metrics, turn_table, window_metrics
from bench.lib.virtual import replay
from engine import Seed

FORMAT = "pensieve-steady/1"
COLUMNS = ["index", "turns", "kv", "residency", "idle_s", "next_s", "partial"]
CODES = {"gpu": "g", "both": "b", "cpu": "c", "disk": "k", "dropped": "d"}
TIERS = {v: k for k, v in CODES.items()}
WARMUP_MEASURED = 0.3  # the warm-up's own metrics: turns sent after this share of the cut
OUTPUT_TOKEN = 0  # a reply's tokens in a seeded history: what the simulator samples


# ---- residency, run-length encoded --------------------------------------------------------


def encode(tiers: list[str]) -> str:
    """["dropped", "dropped", "gpu"] -> "d2g1"."""
    return "".join(f"{CODES[t]}{len(list(g))}" for t, g in itertools.groupby(tiers))


def decode(text: str) -> list[str]:
    out: list[str] = []
    for code, n in re.findall(r"([a-z])(\d+)", text):
        out += [TIERS[code]] * int(n)
    return out


# ---- the sample, repeated -------------------------------------------------------------------


def nth(convs: list[wl.Conversation], k: int) -> wl.Conversation:
    """Conversation k of the sample cycled: a copy's first token differs from the
    original's, so that no copy finds another's KV by prefix sharing."""
    c = convs[k % len(convs)]
    copy = k // len(convs)
    if not copy:
        return c
    first = replace(c.turns[0], prompt=[c.turns[0].prompt[0] + copy, *c.turns[0].prompt[1:]])
    return wl.Conversation(f"{c.id}#{copy}", [first, *c.turns[1:]])


def history(conv: wl.Conversation, turns: int) -> list[int]:
    """The stream after `turns` turns: each prompt, then its reply's tokens."""
    out: list[int] = []
    for t in conv.turns[:turns]:
        out += t.prompt
        out += [OUTPUT_TOKEN] * t.output_len
    return out


# ---- the state ------------------------------------------------------------------------------


@dataclass
class Row:
    index: int
    turns: int
    kv: int
    residency: str
    idle_s: float
    next_s: float | None
    partial: list[int] | None = None  # [p, g]: the turn in flight, as far as it had got

    def to_list(self) -> list:
        nxt = None if self.next_s is None else round(self.next_s, 3)
        return [self.index, self.turns, self.kv, self.residency, round(self.idle_s, 3), nxt,
                self.partial]  # fmt: skip

    def tokens(self, conv: wl.Conversation) -> list[int]:
        """Its stream as seeded: the turns done, and as much of the one in flight as it had
        computed."""
        out = history(conv, self.turns)
        if self.partial:
            p, g = self.partial
            out += conv.turns[self.turns].prompt[:p] + [OUTPUT_TOKEN] * g
        return out

    def next_turn(self, conv: wl.Conversation) -> wl.TurnSpec:
        """The turn it sends next: a turn in flight goes on from where it was (the rest of
        its prompt, or its last sampled token and the rest of its reply)."""
        spec = conv.turns[self.turns]
        if not self.partial:
            return spec
        p, g = self.partial
        if p < len(spec.prompt):
            return wl.TurnSpec(spec.prompt[p:], spec.output_len, spec.text)
        return wl.TurnSpec([OUTPUT_TOKEN], spec.output_len - g - 1, spec.text)


@dataclass
class State:
    mode: str
    rate: float
    think_s: float
    cut_s: float
    seed: int
    sample: str
    sample_size: int
    next_index: int
    gpu_cache_chunks: int
    cpu_cache_chunks: int
    chunk_size: int
    rows: list[Row]
    simulated: str = ""
    git_commit: str = ""
    summary: dict[str, Any] = field(default_factory=dict)
    warmup_metrics: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        head = {k: v for k, v in self.__dict__.items() if k != "rows"}
        return {"format": FORMAT, **head, "columns": COLUMNS,
                "conversations": [r.to_list() for r in self.rows]}  # fmt: skip

    def write(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = self.to_json()
        rows = data.pop("conversations")
        text = json.dumps(data, indent=1, default=float)[:-2]  # one row a line: diffable
        body = ",\n".join(json.dumps(r) for r in rows)
        path.write_text(f'{text},\n "conversations": [\n{body}\n ]\n}}\n')
        return path

    @staticmethod
    def read(path: Path) -> State:
        data = json.loads(Path(path).read_text())
        if data.get("format") != FORMAT:
            raise ValueError(f"{path}: not a steady state of format {FORMAT}")
        rows = [Row(*r) for r in data.pop("conversations")]
        data.pop("format"), data.pop("columns")
        return State(rows=rows, **data)

    def live(self) -> list[Row]:
        return [r for r in self.rows if r.next_s is not None]


def state_path(folder: Path, mode: str, rate: float) -> Path:
    return Path(folder) / f"{mode}-{rate:g}.json"


# ---- the warm-up, in virtual time -----------------------------------------------------------


RANK = {"dropped": 0, "disk": 0, "cpu": 1, "gpu": 2, "both": 2}


def residency(engine, table, kv: int, tally: dict[str, Any], going_on: bool = False) -> str:
    """The tier of each chunk of the table's first `kv` positions, laid out as a seed takes
    them ([dropped or disk | cpu | gpu or both]): a shared chunk is kept in the first
    conversation written only, a faster chunk before a slower one demoted (both counted in
    `tally`). A stateless engine holds chunks only for a turn going on (`going_on`)."""
    cs = engine.cache.chunk_size
    on_disk = engine.disk.keys() if engine.disk is not None else set()
    state = engine.streams.get(table.id)
    hashes = state.hashes if state is not None else []
    claimed = tally.setdefault("claimed", set())
    out = []
    for i, c in enumerate(table.chunks[: -(-kv // cs)]):
        if c.gpu is not None:
            tier = "both" if c.cpu is not None else "gpu"
        elif c.cpu is not None:
            tier = "cpu"
        elif i < len(hashes) and hashes[i] in on_disk:
            tier = "disk"
        else:
            tier = "dropped"
        if c.shared and len(c.holders) > 1 and tier != "dropped":
            if id(c) in claimed:
                tier = "dropped"
                tally["shared_dropped"] = tally.get("shared_dropped", 0) + 1
            claimed.add(id(c))
        out.append(tier)
    if len(out) * cs < kv:  # never: a table covers its computed positions
        raise RuntimeError(f"{table.id}: {len(out)} chunks for {kv} positions")
    if engine.config.cache_mode == "stateless" and not going_on:
        return encode(["dropped"] * len(out))  # a turn in flight from its start: recomputed
    changed = True
    while changed:  # each chunk no faster than the next: demote the ones that are
        changed = False
        for i in range(len(out) - 1):
            if RANK[out[i]] > RANK[out[i + 1]]:
                out[i] = "cpu" if out[i] == "both" and out[i + 1] == "cpu" else "dropped"
                tally["demoted"] = tally.get("demoted", 0) + 1
                changed = True
    return encode(out)


def warm_up(
    engine, convs: list[wl.Conversation], rate: float, think: float, seed: int, cut_s: float,
    tag: str = "warm",
) -> tuple[list[Row], int, float, dict[str, Any], dict[str, Any]]:  # fmt: skip
    """The replay of `convs` (the repeated sample) at `rate` on a simulated engine, cut at
    `cut_s` virtual seconds (`virtual.replay`): the state there (rows, the next index, the
    cut's time), then the turns in flight run to their end with no new turn sent, for the
    warm-up's own metrics (turns sent in its last 70%, as `bench.sim` measures a steady
    state) and a summary."""
    start = engine.now()
    plans = wl.plan(convs, rate, think, seed)
    index = {p.conversation.id: k for k, p in enumerate(plans)}
    counts: dict[str, Any] = {}
    rows: dict[int, Row] = {}
    cut: dict[str, Any] = {}

    def at_cut(waiting: dict[int, str], pending: list[tuple[float, str]], records) -> None:
        t_cut = engine.now()
        done = [0] * len(plans)  # turns recorded per conversation
        for rec in records:
            done[index[rec.conversation]] += 1
        flying = []  # in flight, in the engine's order: sent again at once, going on from there
        for req in engine.scheduler.turns():
            if id(req) not in waiting:
                continue  # a prefetch
            k = index[waiting[id(req)]]
            rows[k] = in_flight(engine, req, k, plans[k].conversation, done[k], t_cut, counts)
            flying.append(k)
        arrived = len(plans)
        for at, cid in pending:
            k = index[cid]
            if not done[k]:  # its arrival: not yet
                arrived = min(arrived, k)
                continue
            state = engine.streams[f"{tag}/{cid}"]
            idle = t_cut - (engine.clock.last_active(state.id) or t_cut)
            res = residency(engine, engine.cache.table(state.id), state.kv_len, counts)
            rows[k] = Row(k, done[k], state.kv_len, res, idle, max(0.0, at - t_cut))
        live = {index[cid] for cid in waiting.values()} | {index[cid] for _, cid in pending}
        for table in engine.cache.held():  # ended, holding chunks until they are evicted
            k = index[table.id.split("/", 1)[1]]
            if k in rows or k in live or table.n_dropped == len(table.chunks):
                continue
            state = engine.streams[table.id]
            idle = t_cut - (engine.clock.last_active(table.id) or t_cut)
            rows[k] = Row(k, done[k], state.kv_len, residency(engine, table, state.kv_len, counts),
                          idle, None)  # fmt: skip
        cut.update(t=t_cut, arrived=arrived, flying=flying, n_flying=len(waiting))

    records, _ = replay(engine, plans, tag, cut_s=cut_s, at_cut=at_cut)
    metrics = steady_metrics(records, WARMUP_MEASURED * cut_s, cut_s)
    tiers: dict[str, int] = {}
    for r in rows.values():
        for t in decode(r.residency):
            tiers[t] = tiers.get(t, 0) + 1
    summary = {
        "arrived": cut["arrived"],
        "live": sum(1 for r in rows.values() if r.next_s is not None),
        "in_flight": cut["n_flying"],
        "in_flight_partial": counts.get("partial", 0),  # going on from where they were
        "ended_holding": sum(1 for r in rows.values() if r.next_s is None),
        "chunks": tiers,
        "context_tokens_live": sum(r.kv for r in rows.values() if r.next_s is not None),
        # A chunk shared by several conversations is held by the first written only; a
        # shared run before private CPU chunks goes to the CPU or is dropped (`residency`)
        "shared_chunks_dropped": counts.get("shared_dropped", 0),
        "chunks_demoted": counts.get("demoted", 0),
        "chunk_size": engine.cache.chunk_size,
    }
    first = set(cut["flying"])
    order = [rows[k] for k in cut["flying"]]
    order += sorted((r for k, r in rows.items() if k not in first), key=lambda r: r.index)
    return order, cut["arrived"], cut["t"] - start, metrics, summary


def in_flight(engine, req, k: int, conv: wl.Conversation, turns: int, t_cut: float, counts) -> Row:
    """The row of a turn in flight at the cut: its history as far as it had computed it
    (a turn decoding: its prompt and all but its last sampled token; one in its prompt: the
    positions computed; one waiting: its turns done)."""
    prev = len(history(conv, turns))
    prompt = len(conv.turns[turns].prompt)
    made, kv = len(req.output), req.state.kv_len
    if made:
        p, g = prompt, made - 1
    else:
        p, g = max(0, kv - prev), 0
    if kv > prev + p + g or (made and kv != prev + p + g):  # not as a turn leaves it: as sent
        p, g, kv = 0, 0, min(req.base, prev)
    res = residency(engine, req.table, kv, counts, going_on=bool(p or g)) if kv else ""
    idle = t_cut - (engine.clock.last_active(req.state.id) or t_cut)
    counts["partial"] = counts.get("partial", 0) + bool(p or g)
    return Row(k, turns, kv, res, idle, 0.0, [p, g] if p or g else None)


def warmup_plans_needed(rate: float, cut_s: float) -> int:
    """Conversations to plan for a warm-up: more than arrive by the cut."""
    return math.ceil(rate * cut_s * 1.2) + 20


# ---- resuming it ----------------------------------------------------------------------------


def seeds(state: State, convs: list[wl.Conversation], tag: str, now: float, chunk_size: int = 32):
    """The engine's seeds of every row that has a history (`Engine.seed`): conversation ids
    `<tag>/<id>` as the replay's drivers name them, last activity on the engine's clock
    `now`. Returns (seeds, rows left out: a history that does not match its residency)."""
    out, bad = [], []
    for r in state.rows:
        conv = nth(convs, r.index)
        tokens = r.tokens(conv)
        if not tokens:
            continue
        tiers = decode(r.residency)
        if r.kv > len(tokens) or len(tiers) != -(-r.kv // chunk_size):
            bad.append(r.index)
            continue
        out.append(Seed(f"{tag}/{conv.id}", tokens, tiers, now - r.idle_s, computed=r.kv))
    return out, bad


def resume(
    state: State, convs: list[wl.Conversation], stop_s: float, rate: float | None = None
) -> list[wl.Plan]:
    """The state's continuation up to `stop_s`: each live conversation from its next turn
    (one in flight at once, from where it was), and new ones from `next_index` arriving at
    the state's rate (a new Poisson draw)."""
    rate = state.rate if rate is None else rate
    plans = []
    for r in state.live():
        conv = nth(convs, r.index)
        if r.turns >= len(conv.turns):
            continue
        think = wl.think_times(state.think_s, len(conv.turns) - 1, state.seed,
                               f"{r.index}:{conv.id}")  # fmt: skip
        context = len(r.tokens(conv))
        if r.partial:  # the turn in flight goes on from where it was
            turns = list(conv.turns)
            turns[r.turns] = r.next_turn(conv)
            conv = wl.Conversation(conv.id, turns)
        plans.append(wl.Plan(conv, r.next_s, think, start=r.turns, context=context))
    n = math.ceil(rate * stop_s * 1.5) + 10
    arrivals = wl.poisson_arrivals(rate, n, f"{state.seed}/resume")
    for j, at in enumerate(a for a in arrivals if a <= stop_s):
        k = state.next_index + j
        conv = nth(convs, k)
        think = wl.think_times(state.think_s, len(conv.turns) - 1, state.seed, f"{k}:{conv.id}")
        plans.append(wl.Plan(conv, at, think))
    return plans


def going_on(state: State, convs: list[wl.Conversation]) -> set[tuple[str, int]]:
    """(conversation id, turn index) of each turn in flight at the cut that goes on from
    where it was."""
    return {(nth(convs, r.index).id, r.turns) for r in state.rows if r.partial}


def window(
    records: list[wl.TurnRecord], start: float, end: float, resumed: set = frozenset()
) -> dict[str, Any]:
    """The run's figures: the turns sent in [start, end), cut ones at their lower bound
    (`window_metrics`); throughput is those turns over the window, served or not, as
    `steady_metrics` counts it (`completed_rps`: those served). `first_second`: what the
    turns sent first found (the seeded state), those that went on from the cut apart."""
    inside = [r for r in records if start <= r.sent_s < end]
    m = window_metrics(inside, end - start)
    sent = [r for r in inside if r.error is None and r.output_tokens > 0]
    done = [r for r in sent if not r.stats.get("censored")]
    m["duration_s"] = end - start
    m["throughput_rps"] = len(sent) / (end - start)
    m["throughput_tps"] = sum(r.output_tokens for r in sent) / (end - start)
    m["completed_rps"] = len(done) / (end - start)
    m["window_s"] = [start, end]
    first = [r for r in records if r.sent_s < 1.0 and r.error is None
             and not r.stats.get("censored")]  # fmt: skip
    on = [r for r in first if (r.conversation, r.index) in resumed]
    first = [r for r in first if (r.conversation, r.index) not in resumed]
    m["first_second"] = {"turns": len(first), "later_turns": sum(1 for r in first if r.index),
                         **cache_use(first)}  # fmt: skip
    m["went_on"] = {"turns": len(on), **cache_use(on)}
    return m


def run_row(
    s,
    mode: str,
    state: State,
    path: Path,
    seeded: tuple[int, int],
    seed_s: float,
    wall_s: float,
    records: list[wl.TurnRecord],
    convs: list[wl.Conversation],
) -> dict[str, Any]:
    """One steady run as the report keeps it, real or simulated: its state, the seeding
    (`seeded`: conversations placed and left out), its window's figures (`window`)."""
    stop = s.steady_warmup_s + s.steady_window_s
    return {
        "mode": mode,
        "engine_mode": mode,
        "rate": state.rate,
        "think_s": state.think_s,
        "state": path.name,
        "seeded": seeded[0],
        "seed_left_out": seeded[1],
        "seed_s": seed_s,
        "warmup_s": s.steady_warmup_s,
        "window_s": s.steady_window_s,
        "wall_s": wall_s,
        "metrics": window(records, s.steady_warmup_s, stop, going_on(state, convs)),
        "turns": turn_table(records),
    }
