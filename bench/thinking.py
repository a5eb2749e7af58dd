"""Thinking replies keep the cache: a chat of a thinking-shaped template, with and without
re-encoding each reply as the template renders it in history (app/turns/reencode.py).

    python -m bench.thinking                  # 8 turns, the bundled model on the CPU
    python -m bench.thinking --turns 5 --max-tokens 32

The template is bench/samples/thinking.jinja (Qwen3-shaped: earlier replies render without
their <think> block). Each turn runs as the server runs it, in process (`plan_turn`, the
engine, then `reencode` + `Engine.rewrite` or not). Per turn: the previous context's tokens
not reused, the prompt positions computed, the reply's tokens re-encoded, and the KV the idle
chat holds. Results: bench/results/thinking-cpu.json and .png.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

from app.turns.reencode import reencode
from app.turns.window import plan_turn
from bench.lib.common import device_name, git_commit, write_json
from bench.lib.plots import plt, save_fig
from engine import Engine, EngineConfig, SamplingParams, Turn

ROOT = Path(__file__).resolve().parent
TEMPLATE = ROOT / "samples" / "thinking.jinja"
SYSTEM = "Answer in a few words."
QUESTIONS = [
    "Name a fruit.",
    "Name another one.",
    "And a vegetable?",
    "A colour?",
    "An animal?",
    "A city?",
    "A river?",
    "A planet?",
    "A metal?",
    "A tree?",
]


@dataclass
class Msg:
    role: str
    content: str
    token_ids: list[int]
    starts_context: bool = False


@dataclass
class Run:
    mode: str
    not_reused: list[int] = field(default_factory=list)  # previous context not reused
    computed: list[int] = field(default_factory=list)  # prompt positions computed
    reencoded: list[int] = field(default_factory=list)  # at the end of the turn
    held_idle: list[int] = field(default_factory=list)  # KV positions kept between turns
    ttft_s: list[float] = field(default_factory=list)


def cut(history: list[Msg], length: int) -> None:
    """The stored stream's first `length` tokens kept (as `HistoryStore.truncate`)."""
    for m in history:
        m.token_ids, length = m.token_ids[:length], max(0, length - len(m.token_ids))


def chat(engine: Engine, cid: str, turns: int, max_tokens: int, redo: bool) -> Run:
    tok = engine.tokenizer
    run = Run("re-encoded" if redo else "as generated")
    history: list[Msg] = []
    stop = set(engine.stop_token_ids)
    before = 0  # the stream's length after the previous turn, as generated
    for i in range(turns):
        q = QUESTIONS[i % len(QUESTIONS)]
        plan = plan_turn(tok, SYSTEM, history, q, engine.context_limit, max_tokens, True)
        if plan.context_len < plan.stored_len:
            cut(history, plan.context_len)
        sp = SamplingParams(max_tokens=plan.max_tokens, temperature=0.0)
        r = engine.run([Turn(cid, plan.prompt, sp, context_len=plan.context_len)])[0]
        s = r.stats
        reused = s.cached_tokens + s.swapped_in_tokens + s.disk_tokens
        run.not_reused.append(before - reused if i else 0)
        run.computed.append(plan.context_len + len(plan.prompt) - reused)
        run.ttft_s.append(round(s.ttft_s, 3))
        history.append(Msg("user", q, plan.prompt))
        ids, text = r.token_ids, tok.decode(r.token_ids, skip_special_tokens=True)
        before = plan.context_len + len(plan.prompt) + len(ids)
        n = 0
        if redo:
            x = reencode(tok, plan.messages, plan.stream, plan.context_len, text, ids, stop)
            if x is not None and engine.rewrite(cid, x.keep, x.token_ids, before):
                cut(history, x.keep)
                ids, n = x.token_ids, len(x.token_ids)
        history.append(Msg("assistant", text, ids))
        run.reencoded.append(n)
        run.held_idle.append(engine.streams[cid].kv_len)
    return run


def plot(runs: list[Run], path: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    turns = range(1, len(runs[0].computed) + 1)
    width = 0.4
    for k, run in enumerate(runs):
        x = [t + (k - 0.5) * width for t in turns]
        axes[0].bar(x, run.not_reused, width, label=run.mode)
        axes[1].plot(turns, run.held_idle, marker="o", label=run.mode)
    axes[0].set_title("previous context not reused (tokens)", fontsize=10)
    axes[1].set_title("KV held by the idle chat after the turn (tokens)", fontsize=10)
    for ax in axes:
        ax.set_xlabel("turn")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("a thinking chat (bench/samples/thinking.jinja), SmolLM2-135M on the CPU")
    save_fig(fig, path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--out", default=str(ROOT / "results" / "thinking-cpu"))
    a = p.parse_args()
    runs = []
    for redo in (False, True):
        engine = Engine(EngineConfig(model="smollm2-135m-instruct", device="cpu"))
        engine.tokenizer.chat_template = TEMPLATE.read_text()
        runs.append(chat(engine, "chat", a.turns, a.max_tokens, redo))
        engine.close()
    result = {
        "bench": "thinking",
        "commit": git_commit(),
        "device": device_name(),
        "model": "smollm2-135m-instruct",
        "template": str(TEMPLATE.relative_to(ROOT.parent)),
        "turns": a.turns,
        "max_tokens": a.max_tokens,
        "runs": [vars(r) for r in runs],
    }
    out = Path(a.out)
    write_json(out.with_suffix(".json"), result, indent=2)
    plot(runs, out.with_suffix(".png"))
    for r in runs:
        print(r.mode, "not reused", r.not_reused, "computed", r.computed)
        print("  re-encoded", r.reencoded, "held idle", r.held_idle)


if __name__ == "__main__":
    main()
