"""The KV tensors of both tiers and the copies between them.

GPU tier: per layer K and V of shape [num_blocks, block_size, kv_heads, head_dim] (one
tensor [layers, 2, ...]). CPU tier: chunk-major [num_blocks, layers, 2, block_size, kv_heads,
head_dim] in pinned memory, so a chunk is one contiguous region. On CUDA the copies run on a
side stream: swap-in is enqueued layer by layer with one event per layer, and attention of
layer i waits for layer i's event only. On the CPU the same calls copy synchronously.
"""

from __future__ import annotations

import torch

from engine.cache import CopyPlan
from engine.shapes import ModelArgs


class KVPool:
    def __init__(
        self, args: ModelArgs, gpu_blocks: int, cpu_blocks: int, block_size: int, device, dtype
    ) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        shape = (block_size, args.n_kv_heads, args.head_dim)
        self.gpu = torch.zeros(
            (args.n_layers, 2, gpu_blocks, *shape), device=self.device, dtype=dtype
        )
        self.cpu = torch.zeros(
            (max(cpu_blocks, 0), args.n_layers, 2, *shape), dtype=dtype, pin_memory=self.cuda
        )
        self.layers = [(self.gpu[i, 0], self.gpu[i, 1]) for i in range(args.n_layers)]
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._layer_events: list | None = None
        self._pending_swap_in: list[tuple[int, int]] = []
        self._background_done = None

    @staticmethod
    def bytes_per_block(args: ModelArgs, block_size: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return args.n_layers * 2 * block_size * args.n_kv_heads * args.head_dim * elem

    # ---- one step --------------------------------------------------------------------------

    def begin_step(self, plan: CopyPlan) -> None:
        """Before the forward: synchronous swap-outs, then start the swap-in."""
        if self.cuda:
            compute = torch.cuda.current_stream(self.device)
            self.stream.wait_stream(compute)  # chunks to copy were written by earlier steps
            with torch.cuda.stream(self.stream):
                self._copy_out(plan.swap_out)
                # Freed GPU blocks may be rewritten by this forward: it waits for the swap-outs
                # and for the previous step's background copies (long done, usually).
                if plan.swap_out or self._background_done is not None:
                    freed = torch.cuda.Event()
                    freed.record(self.stream)
                    compute.wait_event(freed)
                events = []
                for layer in range(len(self.layers)):
                    self._copy_in(plan.swap_in, layer)
                    ev = torch.cuda.Event()
                    ev.record(self.stream)
                    events.append(ev)
            self._layer_events = events if plan.swap_in else None
            self._background_done = None
        else:
            self._copy_out(plan.swap_out)
            self._pending_swap_in = plan.swap_in

    def before_attention(self, layer: int) -> None:
        """Hook called by the model before layer `layer` reads its KV."""
        if self.cuda:
            if self._layer_events is not None:
                torch.cuda.current_stream(self.device).wait_event(self._layer_events[layer])
        elif self._pending_swap_in:
            self._copy_in(self._pending_swap_in, layer)

    def end_step(self, plan: CopyPlan) -> None:
        """After the forward: start the ahead-of-time swap-outs in the background."""
        self._pending_swap_in = []
        if not plan.background:
            return
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                self._copy_out(plan.background)
                self._background_done = torch.cuda.Event()
                self._background_done.record(self.stream)
        else:
            self._copy_out(plan.background)

    def swap_in_busy(self) -> bool:
        """A swap-in is still being copied (swap-out waits for it: swap-in has priority)."""
        if self._layer_events is None:
            return False
        if self._layer_events[-1].query():
            self._layer_events = None
            return False
        return True

    # ---- copies ----------------------------------------------------------------------------

    def _copy_out(self, pairs: list[tuple[int, int]]) -> None:
        for gpu, cpu in pairs:
            self.cpu[cpu].copy_(self.gpu[:, :, gpu], non_blocking=self.cuda)

    def _copy_in(self, pairs: list[tuple[int, int]], layer: int) -> None:
        for cpu, gpu in pairs:
            self.gpu[layer, :, gpu].copy_(self.cpu[cpu, layer], non_blocking=self.cuda)
