"""The simulated runtime: the KV pool and the runner of an engine on `sim:<device>`.

They hold no tensors. The engine's own scheduler and cache decide every step and copy as
they do on a real device; here a step only moves the virtual clock on by what the device
model says the host, the forward and the copies take, with the overlap the real pool
implements:
- the host's work comes first (planning, the batch; it sends the copies, then the forward),
  while the copy stream goes on with what earlier steps gave it;
- swap-outs before the forward run first and the forward waits for them (blocks are freed);
  it waits as well for the previous step's ahead-of-time swap-outs, whenever there were
  some (`KVPool.begin_step`: the event it waits on is recorded after them);
- the swap-in is copied layer by layer beside the forward: its measured hidden share is
  hidden, and the forward cannot end before the copy does;
- ahead-of-time swap-outs after the forward run in the background on the copy stream (the
  next step's copies queue behind them; `swap_in_busy` tells the scheduler of a swap-in
  still running), off the critical path;
- chunks read back from the disk tier (read into host memory off the step loop, while
  their turn waited: `engine/sim/disk.py`) go to the GPU with the swap-in, layer by layer;
- a chunk leaving for the disk tier from a GPU block is copied to the host before the
  step's copies (the real engine's `read_pages`, on the step loop); from a CPU block it is
  a host copy, not counted;
- on a CPU every copy runs in the step, one after the other.
Every sampled token is 0: benchmarks replay reply lengths (`ignore_eos`), and the
scheduler never looks at token ids.
"""

from __future__ import annotations

from engine.copies import CopyPlan
from engine.kv_layout import KVLayout
from engine.sim.clock import VirtualClock
from engine.sim.cost import Work
from engine.sim.devices import Device


class SimPool:
    """The copy stream of a simulated device and its bookkeeping of time."""

    def __init__(
        self,
        device: Device,
        clock: VirtualClock,
        bytes_per_chunk: int,
        cpu: int,
        layout: KVLayout | None = None,
    ):
        self.device = device
        self.clock = clock
        self.layout = layout
        self.chunk_bytes = bytes_per_chunk  # every layer's KV of a chunk
        # a block is a page: with sliding groups, a share of the layers (engine/kv_layout.py)
        self.block_bytes = bytes_per_chunk if layout is None else layout.page_bytes(bytes_per_chunk)
        self.cpu_blocks = cpu
        self.copy_free_at = 0.0  # when the copy stream has done all it was given
        self.swap_in_until = 0.0  # when the last swap-in is copied
        self._out_s = 0.0  # this step's swap-outs, before its forward
        self._in_s = 0.0  # this step's swap-in, beside its forward
        self._spill_s = 0.0  # chunks for the disk tier copied out of GPU blocks
        self._background = False  # the last step started ahead-of-time swap-outs
        self.copied_bytes = 0

    @property
    def bytes_per_chunk(self) -> int:
        return self.chunk_bytes

    def read_pages(self, tier: str, pages: tuple[int, ...]) -> list:
        """A chunk leaving for the disk tier: no tensors, the time of its copy to the host."""
        if tier == "gpu":
            self._spill_s += self._seconds(len(pages), self.device.copies.swap_out_bps)
        return []

    def _seconds(self, blocks: int, bps: float) -> float:
        self.copied_bytes += blocks * self.block_bytes
        return blocks * self.block_bytes / bps

    def begin_step(self, plan: CopyPlan) -> None:
        c = self.device.copies
        self._out_s = self._spill_s + self._seconds(len(plan.swap_out), c.swap_out_bps)
        loads = sum(len(pages) for _, pages in plan.load)
        self._in_s = self._seconds(len(plan.swap_in) + loads, c.swap_in_bps)
        self._spill_s = 0.0

    def run(self, forward_s: float, host_s: float = 0.0) -> None:
        """The step's host work, copies and forward: move the clock to the step's end."""
        c, now = self.device.copies, self.clock()
        if c.synchronous:
            self.clock.advance(host_s + self._out_s + self._in_s + forward_s)
            return
        sent = now + host_s  # the host has planned the step and sent its copies
        start = max(sent, self.copy_free_at)  # behind earlier background copies
        out_done = start + self._out_s
        # The forward waits for the swap-outs, and for the last step's background ones
        forward_start = out_done if self._out_s or self._background else sent
        in_done = out_done + self._in_s
        end = forward_start + forward_s
        if self._in_s:
            end = max(end + (1 - c.swap_in_hidden) * self._in_s, in_done)
            self.swap_in_until = in_done
        self.copy_free_at = max(self.copy_free_at, in_done)
        self._out_s = self._in_s = 0.0
        self._background = False
        self.clock.advance_to(end)

    def swap_in_now(self) -> None:
        """No forward this step: the copies alone."""
        self.run(0.0)

    def end_step(self, plan: CopyPlan) -> None:
        if not plan.background:
            return
        c = self.device.copies
        seconds = self._seconds(len(plan.background), c.swap_out_bps)
        if c.synchronous:
            self.clock.advance(seconds)
        else:
            self.copy_free_at = max(self.copy_free_at, self.clock()) + seconds
            self._background = True

    def swap_in_busy(self) -> bool:
        return self.swap_in_until > self.clock()

    def before_attention(self, layer: int) -> None:  # the real pool's hook; nothing to wait on
        pass


class SimRunner:
    """Carries out a planned step in virtual time; samples token 0 for every sampling piece."""

    def __init__(self, device: Device, pool: SimPool) -> None:
        self.device = device
        self.pool = pool
        self.graphs = None
        self.steps = 0

    def step(self, pieces, plan: CopyPlan) -> list[int]:
        batch = [Work(p.end - p.start, p.start, p.sample) for p in pieces]
        cost = self.device.cost
        self.pool.begin_step(plan)
        self.pool.run(cost.forward_s(batch), cost.host_s(batch))
        self.steps += 1
        return [0] * sum(w.sample for w in batch)
