"""Host time of turning a step's pieces into the model's tensors (no model, no GPU).

    python -m bench.step_prep --pieces 64 --context 2048

A decode step of `--pieces` turns at `--context` tokens each (64 chunks of 32) runs through
`Runner.step` with a model that returns zeros at once and a pool with no copies, so what is
timed is the runner's own work: the step's lists, the positions, slots, block tables and
metadata, the uploads (none on the CPU) and a greedy sample of 8 zero logits per row.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from bench.lib.common import environment
from engine.cache.chunks import Chunk, ChunkTable
from engine.copies import CopyPlan
from engine.kv_layout import KVLayout
from engine.plan import Piece
from engine.request import Request
from engine.runner import Runner
from engine.stream import StreamState
from engine.types import SamplingParams, Turn, TurnStats

CS = 32
VOCAB = 8  # sampling is not what is timed


class NoModel:
    """Logits of zeros for the wanted rows: the forward takes no time."""

    def set_kv_groups(self, groups: tuple[int, ...]) -> None:
        """Each layer's page group: nothing reads it here."""

    def __call__(self, ids, positions, layers, meta, slots, rows, **kw) -> torch.Tensor:
        return torch.zeros((rows.shape[0], VOCAB))


class NoPool:
    device = torch.device("cpu")
    layers: list = []
    layout = KVLayout(0, 0, (), ())  # no layers: one page group

    def begin_step(self, plan: CopyPlan, writes=None) -> None:
        pass

    def before_attention(self, layer: int) -> None:
        pass


def pieces(n: int, context: int) -> list[Piece]:
    """n decode pieces: each turn's last position, its chunks on distinct GPU blocks."""
    chunks = -(-(context + 1) // CS)
    out = []
    for i in range(n):
        table = ChunkTable(f"c{i}", [Chunk(gpu=i * chunks + j) for j in range(chunks)])
        req = Request(
            turn=Turn(f"c{i}", [1], SamplingParams()),
            state=StreamState(f"c{i}"),
            table=table,
            seq=i,
            base=context,
            tokens=[7],
            stats=TurnStats(),
        )
        out.append(Piece(req, context, context + 1, True))
    return out


def step_us(n: int, context: int, steps: int = 300) -> float:
    runner = Runner(NoModel(), NoPool(), CS, "torch")
    ps, plan = pieces(n, context), CopyPlan()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        runner.step(ps, plan)
        times.append(time.perf_counter() - start)
    return statistics.median(times[50:]) * 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pieces", type=int, default=64)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--out", default=None, help="write the JSON result here too")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    result = {
        "pieces": args.pieces,
        "context": args.context,
        "step_prep_us": round(step_us(args.pieces, args.context), 1),
        "environment": environment("cpu"),
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
