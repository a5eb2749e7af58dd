"""Where a server's time goes (bench/lib/sampling_profile.py): the parts a sample's stack
falls in, and py-spy attached to a real process whose step thread runs a real model."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from bench.lib import sampling_profile as sp

LOOP = "thread (7): engine-loop;Thread.run (threading.py:982);Engine.step (engine/engine.py:244)"
FORWARD = LOOP + ";Runner.run (engine/runner.py:110);Decoder.forward (engine/model/decoder.py:9)"


def test_each_sample_falls_in_its_part() -> None:
    raw = "\n".join(
        [
            FORWARD + ";Block.mlp (decoder.py:1);PackedLinear.forward (packed.py:44) 50",
            FORWARD + ";Block.attend (decoder.py:2);paged_attention (kernels/__init__.py:5) 20",
            FORWARD + ";RMSNorm.forward (engine/model/decoder.py:124) 10",
            LOOP + ";Runner.step (engine/runner.py:50);Sampler.__call__ (engine/sampler.py:89) 5",
            LOOP + ";Scheduler.schedule (engine/scheduler.py:1) 15",
            LOOP.replace("Engine.step", "AsyncEngine._loop_steps") + ";Event.wait (t.py:629) 100",
            "thread (1): MainThread;Runner.run (asyncio/runners.py:118) 170",  # waits
            "thread (1): MainThread;Runner.run (asyncio/runners.py:118);send (app/x.py:1) 30",
            "thread (9): Thread-3 (_connection_worker_thread);w (aiosqlite/core.py:59) 196",
            "thread (9): Thread-3 (_connection_worker_thread);w (aiosqlite/core.py:63) 4",
            "garbage",
        ]
    )
    p = sp.parse(raw, wall_s=2.0, rate=100)
    assert p.step == {
        "linears": 0.5,
        "attention": 0.2,
        "model, other": 0.1,
        "sampling": 0.05,
        "step, host": 0.15,
        "idle": 1.0,
    }
    assert (p.event_loop_s, p.other_threads_s, p.samples) == (0.3, 0.04, 600)
    assert p.shares()["linears"] == 0.25
    assert p.not_model() == pytest.approx(0.2)  # (5 + 15) of 100 busy samples


@pytest.mark.timeout(300)
def test_py_spy_sees_a_real_models_step_thread(tmp_path: Path) -> None:
    """A process whose thread named as the engine's runs the bundled model's forward: most
    of its samples are the model's parts, none is lost."""
    script = textwrap.dedent(
        """
        import threading, time, torch
        from engine import Engine, EngineConfig, SamplingParams, Turn
        e = Engine(EngineConfig(model="dummy:tiny", device="cpu", gpu_cache_chunks=64))
        sp = SamplingParams(max_tokens=4)
        e.run([Turn("warm", list(range(100, 400)), sp)])  # builds the native kernel, once
        e.free("warm")
        def loop():
            for i in range(10**6):
                e.run([Turn(f"c{i}", list(range(100, 400)), sp)])
                e.free(f"c{i}")
        threading.Thread(target=loop, name="engine-loop", daemon=True).start()
        print("up", flush=True)
        time.sleep(120)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "up"
        time.sleep(1)
        spy = sp.Recorder(proc.pid, tmp_path / "raw.txt").start()
        time.sleep(4)
        p = spy.stop()
    finally:
        proc.kill()
    busy = sum(v for k, v in p.step.items() if k != "idle")
    assert busy > 0.5 * p.wall_s, p
    model = sum(p.step[k] for k in sp.MODEL_PARTS)
    assert model > 0.5 * busy and p.step["linears"] > 0, p
