"""An agent workload: sessions of dozens of steps whose context grows by tool outputs, each
step a short reply that calls a named tool, the next step sent when the tool returns.

A session is a replayed conversation (`workload.Plan`) whose think times are its tools'
durations: turn 0 the task, turn k > 0 the result of the tool reply k - 1 called, the last
reply the answer. Deterministic from a seed; token ids random (a simulated device counts
them). Tool durations are log-normal per tool (heavy-tailed, as measured tool latencies
are: Continuum, arXiv 2511.02230); `TOOLS` approximates that shape, written into results.
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass, field
from statistics import NormalDist

from bench.lib import workload as wl

TOKEN_IDS = (1000, 40000)  # drawn ids: inside every dummy shape's vocabulary


@dataclass(frozen=True)
class Tool:
    """A tool: a log-normal duration (median, sigma of the log), `output` tokens of result."""

    name: str
    share: float  # of the calls
    median_s: float
    sigma: float
    output: tuple[int, int]

    @property
    def mean_s(self) -> float:
        """The expected duration: what an agent that knows its tool would hint."""
        return self.median_s * math.exp(self.sigma**2 / 2)

    def duration(self, rng: random.Random) -> float:
        return rng.lognormvariate(math.log(self.median_s), self.sigma)

    def quantile(self, q: float) -> float:
        return self.median_s * math.exp(self.sigma * NormalDist().inv_cdf(q))


# A coding agent's: reads, searches, edits under a second; commands 4 s median, p99 ~130 s.
TOOLS: tuple[Tool, ...] = (
    Tool("read_file", 0.30, 0.15, 1.0, (1000, 4000)),
    Tool("search", 0.20, 0.6, 1.0, (1000, 3000)),
    Tool("edit_file", 0.20, 0.3, 0.8, (1000, 2000)),
    Tool("run_command", 0.25, 4.0, 1.5, (1000, 4000)),
    Tool("web_fetch", 0.05, 1.5, 1.0, (2000, 4000)),
)


@dataclass(frozen=True)
class AgentSpec:
    """Sessions' shape (token ranges); tools stop before the context passes `context_cap`."""

    steps: tuple[int, int] = (24, 48)
    task: tuple[int, int] = (2000, 4000)
    reply: tuple[int, int] = (20, 120)
    answer: int = 200
    output_scale: float = 1.0
    context_cap: int = 100_000
    tools: tuple[Tool, ...] = TOOLS


@dataclass
class Session:
    """One session: its turns, the tool each reply called (None: the answer), their times."""

    conversation: wl.Conversation
    tools: list[str | None]
    tool_s: list[float]  # len(turns) - 1: the gap after each reply but the last

    @property
    def id(self) -> str:
        return self.conversation.id


@dataclass
class Workload:
    """Agent sessions over a background of chats, each a replay plan."""

    sessions: list[Session]
    agents: list[wl.Plan]
    chats: list[wl.Plan]
    spec: AgentSpec
    info: dict = field(default_factory=dict)
    by_id: dict[str, Session] = field(init=False)

    def __post_init__(self) -> None:
        self.by_id = {s.id: s for s in self.sessions}

    def tool_of(self, conversation: str, index: int) -> Tool | None:
        """The tool that reply `index` of the conversation called (None: a chat or an answer)."""
        session = self.by_id.get(conversation)
        name = None if session is None else session.tools[index]
        return None if name is None else next(t for t in self.spec.tools if t.name == name)

    def is_agent(self, conversation: str) -> bool:
        return conversation in self.by_id

    def is_last(self, conversation: str, index: int) -> bool:
        return index == len(self.by_id[conversation].tools) - 1


def session(name: str, spec: AgentSpec, rng: random.Random) -> Session:
    """The task, tool calls until the steps are done or the cap is near, the answer."""
    lo, hi = TOKEN_IDS

    def tokens(n: int) -> list[int]:
        return [rng.randrange(lo, hi) for _ in range(n)]

    weights = [t.share for t in spec.tools]
    steps = rng.randint(*spec.steps)
    turns = [wl.TurnSpec(tokens(rng.randint(*spec.task)), rng.randint(*spec.reply))]
    tools: list[str | None] = []
    gaps: list[float] = []
    context = len(turns[0].prompt) + turns[0].output_len
    for _ in range(steps):
        tool = rng.choices(spec.tools, weights)[0]
        out = max(1, round(rng.randint(*tool.output) * spec.output_scale))
        reply = rng.randint(*spec.reply)
        if context + out + reply + spec.answer > spec.context_cap:
            break
        tools.append(tool.name)
        gaps.append(tool.duration(rng))
        turns.append(wl.TurnSpec(tokens(out), reply))
        context += out + reply
    turns[-1] = wl.TurnSpec(turns[-1].prompt, spec.answer)  # the last reply answers
    tools.append(None)
    return Session(wl.Conversation(name, turns), tools, gaps)


def build(n_agents: int, agent_rate: float, chats: list[wl.Conversation], chat_rate: float,
          think_s: float, seed: int, spec: AgentSpec | None = None) -> Workload:  # fmt: skip
    """`n_agents` sessions arriving at `agent_rate` a second over `chats` arriving at
    `chat_rate` with users thinking `think_s` on average (the ShareGPT replay's plan)."""
    spec = spec or AgentSpec()
    rng = random.Random(f"agents:{seed}")
    sessions = [session(f"agent-{i}", spec, rng) for i in range(n_agents)]
    arrivals = wl.poisson_arrivals(agent_rate, n_agents, seed)
    agents = [
        wl.Plan(s.conversation, a, list(s.tool_s)) for s, a in zip(sessions, arrivals, strict=True)
    ]
    background = wl.plan(chats, chat_rate, think_s, seed) if chats else []
    info = {"agents": n_agents, "agent_rate": agent_rate, "chats": len(chats),
            "chat_rate": chat_rate, "think_s": think_s, "seed": seed, "spec": asdict(spec),
            "agent_summary": wl.summarize([s.conversation for s in sessions]),
            "tool_s": tool_summary(sessions)}  # fmt: skip
    return Workload(sessions, agents, background, spec, info)


def tool_summary(sessions: list[Session]) -> dict[str, dict[str, float]]:
    """Per tool name: calls and the drawn durations' p50, p90, max."""
    by: dict[str, list[float]] = {}
    for s in sessions:
        for name, gap in zip(s.tools, s.tool_s, strict=False):
            by.setdefault(str(name), []).append(gap)
    every = [g for s in sessions for g in s.tool_s]
    by["all"] = every
    return {
        k: {"calls": len(v), "p50": wl.percentile(v, 50), "p90": wl.percentile(v, 90),
            "max": max(v) if v else 0.0}
        for k, v in by.items()
    }  # fmt: skip
