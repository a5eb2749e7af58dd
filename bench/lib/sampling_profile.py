"""Where a server's time goes during a run, from py-spy attached to its process (no change to
the server, about 1% of a core at 100 samples a second; idle threads sampled too: a thread
waiting at a barrier inside an op is busy with that op, only the waits below are idle).

Each sample of the engine's step thread falls in one part by the first rule its stack
matches: `linears` (weight matmuls), `attention` (paged attention, KV writes), `model, other`
(the rest of the forward), `sampling`, `step, host` (the rest of the step loop), `idle` (no
turn to step). The event loop's thread and the others are counted apart, busy where their
stack is more than their wait: they run beside the step, on the cores its threads would use.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

RATE = 100  # samples a second
STEP_THREAD = "engine-loop"  # engine/async_engine.py names its step thread so
EVENT_LOOP = ("MainThread", "uvloop")

# (part, substrings of a frame that put a sample in it), first match wins
RULES = (
    ("linears", ("PackedLinear.", "Int4Linear.", "linear (torch/nn/functional")),
    ("attention", ("paged_attention", "write_kv", "paged_decode")),
    ("model, other", ("Decoder.forward",)),
    ("sampling", ("Sampler.",)),
)
STEP_PARTS = ("linears", "attention", "model, other", "sampling", "step, host", "idle")
STEP_WAITS = ("Event.wait", "wait_for_io")  # the step loop has nothing to do
# Leaves of a thread that waits: the event loop in its C loop, a worker on its queue
WAITS = ("Runner.run (asyncio/runners.py", "(aiosqlite/core.py:59)", "_worker (concurrent/futures")
WAITS += ("wait (threading.py", "get (queue.py", "select (selectors.py")
MODEL_PARTS = ("linears", "attention", "model, other")


def part(frames: list[str]) -> str:
    if any(w in f for f in frames for w in STEP_WAITS):
        return "idle"
    for name, marks in RULES:
        if any(m in f for f in frames for m in marks):
            return name
    return "step, host"


@dataclass
class Profile:
    """Seconds of a run in each part of the step thread, and in the other threads."""

    wall_s: float
    step: dict[str, float] = field(default_factory=dict)  # STEP_PARTS
    event_loop_s: float = 0.0
    other_threads_s: float = 0.0
    samples: int = 0

    def shares(self) -> dict[str, float]:
        """Each part of the step thread as a share of its samples (about the wall time)."""
        total = sum(self.step.values())
        return {k: round(v / total, 4) for k, v in self.step.items()} if total else {}

    def not_model(self) -> float:
        """The share of the step thread's busy time that is not the model's own arithmetic."""
        busy = sum(v for k, v in self.step.items() if k != "idle")
        model = sum(self.step.get(k, 0.0) for k in MODEL_PARTS)
        return round(1 - model / busy, 4) if busy else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "shares": self.shares(), "not_model_share": self.not_model()}


def parse(raw: str, wall_s: float, rate: int = RATE) -> Profile:
    """A profile from py-spy's raw output (`thread (id): name;frame;...;frame count` lines,
    idle threads included)."""
    step: Counter[str] = Counter()
    loop = others = total = 0
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        thread, *frames = stack.split(";")
        if STEP_THREAD in thread:
            step[part(frames)] += n
        elif not frames or any(w in frames[-1] for w in WAITS):
            continue
        elif any(name in thread for name in EVENT_LOOP):
            loop += n
        else:
            others += n
    seconds = {k: step[k] / rate for k in STEP_PARTS}
    return Profile(wall_s, seconds, loop / rate, others / rate, total)


class Recorder:
    """py-spy attached to a process from `start` until `stop` (SIGINT: it writes its samples)."""

    def __init__(self, pid: int, out: Path, rate: int = RATE) -> None:
        self.pid, self.out, self.rate = pid, out, rate
        self.proc: subprocess.Popen | None = None
        self.t0 = 0.0

    def start(self) -> Recorder:
        spy = Path(sys.executable).with_name("py-spy")
        cmd = [str(spy), "record", "--pid", str(self.pid), "--rate", str(self.rate), "--format",
               "raw", "--output", str(self.out), "--threads", "--nonblocking", "--idle"]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.t0 = time.monotonic()
        return self

    def stop(self) -> Profile:
        assert self.proc is not None
        wall_s = time.monotonic() - self.t0
        self.proc.send_signal(signal.SIGINT)
        _, err = self.proc.communicate(timeout=60)
        if not self.out.exists():
            raise RuntimeError(f"py-spy wrote no profile: {err.decode(errors='replace')[-500:]}")
        return parse(self.out.read_text(), wall_s, self.rate)


def mean_shares(runs: list) -> dict[tuple[str, int], dict[str, float]]:
    """Per (system, conversations), over the runs with a profile: each step part's mean share
    of the step thread, and the event loop's and other threads' busy share of the wall."""
    groups: dict[tuple[str, int], list[dict]] = {}
    for r in runs:
        if r.profile:
            groups.setdefault((r.system, r.conversations), []).append(r.profile)
    out = {}
    for key, ps in groups.items():
        shares = {k: sum(p["shares"].get(k, 0.0) for p in ps) / len(ps) for k in STEP_PARTS}
        shares["event loop"] = sum(p["event_loop_s"] / p["wall_s"] for p in ps) / len(ps)
        shares["other threads"] = sum(p["other_threads_s"] / p["wall_s"] for p in ps) / len(ps)
        out[key] = {k: round(v, 4) for k, v in shares.items()}
    return out


def plot(runs: list, path: Path) -> Path | None:
    """The step thread's wall time by part (stacked), beside the event loop's and the other
    threads' busy time, per system and conversation count."""
    if not (shares := mean_shares(runs)):
        return None
    from bench.lib.plots import plt

    keys = sorted(shares, key=lambda k: (k[1], k[0]))
    labels = [f"{s} · {n} convs" for s, n in keys]
    fig, ax = plt.subplots(figsize=(10, 1.2 + 0.55 * len(keys)))
    left = [0.0] * len(keys)
    for part_name in (*STEP_PARTS, "event loop", "other threads"):
        widths = [shares[k][part_name] for k in keys]
        hatch = "//" if part_name in ("event loop", "other threads") else None
        ax.barh(labels, widths, left=left, label=part_name, hatch=hatch)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    ax.set_xlabel("share of the run's wall time (step thread; then the threads beside it)")
    ax.legend(ncol=4, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.25))
    ax.set_title("Where the server's time goes (sampled with py-spy)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
