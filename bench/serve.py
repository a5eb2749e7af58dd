"""Multi-turn serving benchmark: replay ShareGPT conversations and measure latency vs throughput.

    python -m bench.serve --preset cpu                 # the engine in process, every mode
    python -m bench.serve --preset gpu --think 600     # one of the paper's settings
    python -m bench.serve --preset gpu --dry-run       # its plumbing on the CPU in seconds
    python -m bench.serve --url http://127.0.0.1:8000 --token=T --preset cpu --modes server
    python -m bench.serve --url http://127.0.0.1:8000 --token=T --preset cpu --api openai

In process, each mode (pensieve / gpu / stateless, lru, separate prefill and decode) gets
its own AsyncEngine; every conversation is an asyncio task that arrives, sends a turn,
waits for the whole reply, thinks, and sends the next. With --url the same replay goes to
a running server over its WebSocket protocol (conversations created through REST), or with
--api openai through its OpenAI API (each turn resends the whole chat).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from bench import workload as wl
from bench.common import RESULTS, ROOT, environment, host_memory_gb
from bench.presets import MODES, PRESETS, Mode, Preset, dry_run

# Per-turn token counts a reply reports, in process and over the WebSocket alike.
_USAGE = (
    "prompt_tokens",
    "cached_tokens",
    "swapped_in_tokens",
    "recomputed_tokens",
    "prefetched_tokens",
)


# ---------------------------------------------------------------- drivers


class EngineDriver:
    """Sends turns to an in-process AsyncEngine; each turn replays the reference reply length."""

    def __init__(self, engine, tag: str) -> None:
        self.engine = engine
        self.tag = tag  # keeps ids of successive runs on one engine apart
        self.ids: set[str] = set()

    async def send(self, cid: str, index: int, spec: wl.TurnSpec, context: int) -> wl.Reply:
        from engine import SamplingParams, Turn

        conv = f"{self.tag}/{cid}"
        self.ids.add(conv)
        sampling = SamplingParams(max_tokens=spec.output_len, temperature=0.0, ignore_eos=True)
        try:
            stream = self.engine.submit(Turn(conv, list(spec.prompt), sampling))
            first = None
            async for _ in stream:
                if first is None:
                    first = time.monotonic()
            done = time.monotonic()
            res = stream.result
        except Exception as e:  # a refused turn is a result of the run, not a crash
            now = time.monotonic()
            return wl.Reply(now, now, 0, error=f"{type(e).__name__}: {e}")
        return wl.Reply(
            first_token_at=first if first is not None else done,
            done_at=done,
            output_tokens=len(res.token_ids),
            stats=_stats(res.stats),
            error=None if res.finish_reason != "cancelled" else "cancelled",
        )

    async def free(self) -> None:
        for conv in self.ids:
            await self.engine.free(conv)
        self.ids.clear()


def _stats(stats) -> dict[str, Any]:
    out = {k: getattr(stats, k, 0) for k in _USAGE}
    out["suspensions"] = getattr(stats, "suspensions", 0)
    if getattr(stats, "admitted_s", 0) and getattr(stats, "arrival_s", 0):
        out["queued_s"] = stats.admitted_s - stats.arrival_s  # waiting to be scheduled
    return out


class UrlDriver:
    """Sends turns to a running server: REST to create chats, one WebSocket per chat.

    The server takes text, so each turn sends the user's message and asks for the reference
    reply's length as max_tokens; the reply may end earlier on a stop token.
    """

    def __init__(self, url: str, token: str, timeout: float = 600.0) -> None:
        self.url = url.rstrip("/")
        self.token = token
        self.timeout = timeout
        self.chats: dict[str, str] = {}
        self.sockets: dict[str, Any] = {}

    def _create(self) -> str:
        import urllib.request

        req = urllib.request.Request(
            f"{self.url}/api/conversations",
            data=json.dumps({"title": "bench"}).encode(),
            headers={"Authorization": f"Bearer {self.token}", "Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(req, timeout=30) as resp:
            return json.loads(resp.read())["id"]

    async def _socket(self, cid: str):
        if cid not in self.sockets:
            from websockets.asyncio.client import connect

            self.chats[cid] = await asyncio.to_thread(self._create)
            ws_url = self.url.replace("http", "ws", 1) + f"/ws/chat/{self.chats[cid]}"
            self.sockets[cid] = await connect(
                ws_url, additional_headers={"Authorization": f"Bearer {self.token}"}
            )
        return self.sockets[cid]

    async def send(self, cid: str, index: int, spec: wl.TurnSpec, context: int) -> wl.Reply:
        try:
            ws = await self._socket(cid)
            msg = {"type": "message", "content": spec.text, "max_tokens": spec.output_len}
            await ws.send(json.dumps({**msg, "temperature": 0.0}))
            first = None
            while True:
                frame = json.loads(await asyncio.wait_for(ws.recv(), self.timeout))
                if frame["type"] == "token" and first is None:
                    first = time.monotonic()
                elif frame["type"] == "error":
                    now = time.monotonic()
                    return wl.Reply(now, now, 0, error=f"{frame['code']}: {frame['message']}")
                elif frame["type"] == "done":
                    done = time.monotonic()
                    usage = frame.get("usage", {})
                    stats = {k: usage.get(k, 0) for k in _USAGE}
                    return wl.Reply(
                        first or done, done, int(usage.get("completion_tokens", 0)), stats
                    )
        except Exception as e:
            now = time.monotonic()
            return wl.Reply(now, now, 0, error=f"{type(e).__name__}: {e}")

    async def close(self) -> None:
        for ws in self.sockets.values():
            await ws.close()
        self.sockets.clear()


class OpenAIDriver:
    """Sends turns to a running server's OpenAI API (/v1/chat/completions, streamed): each
    turn resends the whole chat, as OpenAI clients do, and the server finds the conversation
    it continues. Usage over /v1 has no tiers: `cached_tokens` is the context reused from
    either one, `prompt_tokens` the whole context."""

    def __init__(self, url: str, token: str, timeout: float = 600.0) -> None:
        import httpx

        self.url = url.rstrip("/")
        self.http = httpx.AsyncClient(
            headers={"Authorization": f"Bearer {token}"},
            timeout=timeout,
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
        )
        self.model: str | None = None
        self.chats: dict[str, list[dict]] = {}

    async def send(self, cid: str, index: int, spec: wl.TurnSpec, context: int) -> wl.Reply:
        try:
            if self.model is None:
                r = await self.http.get(f"{self.url}/v1/models")
                r.raise_for_status()
                self.model = r.json()["data"][0]["id"]
            messages = self.chats.setdefault(cid, [])
            messages.append({"role": "user", "content": spec.text})
            body = {
                "model": self.model,
                "messages": messages,
                "max_tokens": spec.output_len,
                "temperature": 0.0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            first, pieces, usage = None, [], {}
            async with self.http.stream("POST", f"{self.url}/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    now = time.monotonic()
                    text = (await r.aread()).decode(errors="replace")[:200]
                    messages.pop()
                    return wl.Reply(now, now, 0, error=f"HTTP {r.status_code}: {text}")
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        raise RuntimeError(chunk["error"]["message"])
                    for choice in chunk.get("choices", []):
                        piece = choice["delta"].get("content")
                        if piece:
                            first = first or time.monotonic()
                            pieces.append(piece)
                    usage = chunk.get("usage") or usage
            done = time.monotonic()
            messages.append({"role": "assistant", "content": "".join(pieces)})
            stats = {
                "prompt_tokens": usage.get("prompt_tokens", 0),
                "cached_tokens": usage.get("prompt_tokens_details", {}).get("cached_tokens", 0),
            }
            return wl.Reply(first or done, done, int(usage.get("completion_tokens", 0)), stats)
        except Exception as e:
            now = time.monotonic()
            return wl.Reply(now, now, 0, error=f"{type(e).__name__}: {e}")

    async def close(self) -> None:
        await self.http.aclose()


# ---------------------------------------------------------------- metrics


def metrics(records: list[wl.TurnRecord], wall_s: float) -> dict[str, Any]:
    """Throughput, normalized latency (latency / output tokens), TTFT and cache hits of a run."""
    ok = [r for r in records if r.error is None and r.output_tokens > 0]
    span = max((r.done_s for r in ok), default=0.0) - min((r.sent_s for r in ok), default=0.0)
    span = span or wall_s or 1e-9
    norm = [r.latency_s / r.output_tokens for r in ok]
    ttft = [r.ttft_s for r in ok]
    out_tokens = sum(r.output_tokens for r in ok)
    return {
        "turns": len(ok),
        "errors": len(records) - len(ok),
        "error_samples": sorted({r.error for r in records if r.error})[:3],
        "duration_s": span,
        "throughput_rps": len(ok) / span,
        "throughput_tps": out_tokens / span,
        "output_tokens": out_tokens,
        "prompt_tokens": sum(r.prompt_tokens for r in ok),
        "norm_latency_mean": statistics.fmean(norm) if norm else float("nan"),
        "norm_latency_p50": wl.percentile(norm, 50),
        "norm_latency_p90": wl.percentile(norm, 90),
        "latency_mean_s": statistics.fmean(r.latency_s for r in ok) if ok else float("nan"),
        "ttft_p50_s": wl.percentile(ttft, 50),
        "ttft_p90_s": wl.percentile(ttft, 90),
        **cache_use(ok, ("suspensions",)),
    }


def cache_use(ok: list[wl.TurnRecord], extra: tuple[str, ...] = ()) -> dict[str, int]:
    """Context tokens of the turns, and how much of it each way of keeping KV supplied."""
    keys = ("cached_tokens", "swapped_in_tokens", "recomputed_tokens", *extra)
    out = {"context_tokens": sum(r.context_tokens for r in ok)}
    out.update({k: int(sum(r.stats.get(k, 0) for r in ok)) for k in keys})
    return out


def counters_delta(before, after) -> dict[str, int]:
    """What the engine's counters (`EngineCounters`) grew by between two snapshots."""
    a, b = asdict(after), asdict(before)
    return {k: a[k] - b[k] for k in a if k not in ("running", "waiting")}


def crossing(runs: list[dict[str, Any]], bound: float, key: str = "norm_latency_mean") -> dict:
    """Where one mode's latency (`key`) reaches `bound` as its rate grows.

    Runs are taken in rate order; the first whose latency is over the bound (or that had
    errors: refused turns) is the crossing. Capacity = the throughput linearly interpolated
    between the last run under the bound and that one, in latency. Not crossed: the best
    throughput under the bound, a lower bound on the capacity. Crossed at the lowest rate:
    no capacity (it is under every throughput measured)."""
    pts = sorted((r for r in runs if r["metrics"]["turns"]), key=lambda r: r["rate"])
    under = None
    for r in pts:
        m = r["metrics"]
        lat, tp = m[key], m["throughput_rps"]
        if m["errors"] == 0 and lat <= bound:
            under = r
            continue
        out = {"crossed": True, "over_rate": r["rate"], "under_rate": None, "capacity_rps": None}
        if under is None:
            return out
        u = under["metrics"]
        out["under_rate"] = under["rate"]
        if lat <= u[key] or not lat > bound:  # errors without a latency rise: no slope
            out["capacity_rps"] = u["throughput_rps"]
        else:
            share = (bound - u[key]) / (lat - u[key])
            out["capacity_rps"] = u["throughput_rps"] + share * (tp - u["throughput_rps"])
        return out
    best = max((r["metrics"]["throughput_rps"] for r in pts), default=None)
    return {
        "crossed": False,
        "over_rate": None,
        "under_rate": under["rate"] if under else None,
        "capacity_rps": best,  # a lower bound: the sweep never reached the bound
    }


def capacity(runs: list[dict[str, Any]], bound: float, key: str = "norm_latency_mean") -> dict:
    """Per mode: `crossing` of its runs (mean normalized latency by default)."""
    modes = dict.fromkeys(r["mode"] for r in runs)
    return {m: crossing([r for r in runs if r["mode"] == m], bound, key) for m in modes}


def _ratio(cap: dict, a: str, b: str) -> float | None:
    """Capacity of a over b, only where both sweeps crossed the bound."""
    x, y = cap.get(a), cap.get(b)
    if not x or not y or not (x["crossed"] and y["crossed"]):
        return None
    if not x["capacity_rps"] or not y["capacity_rps"]:
        return None
    return x["capacity_rps"] / y["capacity_rps"]


def claims(runs: list[dict[str, Any]], bound: float) -> dict[str, Any]:
    """The paper's comparison per think time: each mode's capacity where its mean normalized
    latency reaches `bound` (p90 as a second, stricter figure), and their ratios."""
    out = {}
    for think in sorted({r["think_s"] for r in runs}):
        these = [r for r in runs if r["think_s"] == think]
        mean, p90 = capacity(these, bound), capacity(these, bound, "norm_latency_p90")
        peak: dict[str, float] = {}
        for r in these:
            if r["metrics"]["turns"]:
                peak[r["mode"]] = max(peak.get(r["mode"], 0.0), r["metrics"]["throughput_rps"])
        ps, pg = _ratio(mean, "pensieve", "stateless"), _ratio(mean, "pensieve", "gpu")
        out[f"think_{think:g}s"] = {
            "latency_bound_s_per_token": bound,
            "peak_rps": peak,  # the most each mode served at any rate, whatever its latency
            "capacity_rps": {m: c["capacity_rps"] for m, c in mean.items()},
            "crossed": {m: c["crossed"] for m, c in mean.items()},
            "capacity": mean,
            "capacity_p90": p90,
            # None where either sweep did not cross the bound: no ratio of capacities then.
            "pensieve_over_stateless": ps,
            "pensieve_over_gpu": pg,
            "pensieve_over_stateless_p90": _ratio(p90, "pensieve", "stateless"),
            "pensieve_over_gpu_p90": _ratio(p90, "pensieve", "gpu"),
            "pensieve_2x_stateless": None if ps is None else ps >= 2.0,
            "pensieve_beats_gpu": None if pg is None else pg > 1.0,
        }
    return out


def merge_runs(earlier: list[dict[str, Any]], new: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Earlier runs, less those that a new run of the same mode, think time and rate replaces."""
    key = lambda r: (r["mode"], r["think_s"], r["rate"])  # noqa: E731
    replaced = {key(r) for r in new}
    return [r for r in earlier if key(r) not in replaced] + new


# ---------------------------------------------------------------- running


def engine_config(preset: Preset, mode: Mode):
    from engine import EngineConfig

    return EngineConfig(
        model=preset.model,
        device=preset.device,
        dtype=preset.dtype,
        kv_dtype=preset.kv_dtype,
        gpu_cache_chunks=preset.gpu_cache_chunks,
        cpu_cache_chunks=preset.cpu_cache_chunks if mode.cache_mode == "pensieve" else 0,
        cache_mode=mode.cache_mode,
        eviction=mode.eviction,
        unified=mode.unified,
        max_batch_tokens=preset.max_batch_tokens,
        max_running=preset.max_running,
        seed=preset.seed,
    )


def size_pools(preset: Preset) -> Preset:
    """Turn the preset's GB pool sizes into chunk counts from the model's KV bytes per chunk."""
    if preset.gpu_cache_gb is None and preset.cpu_cache_gb is None:
        return preset
    per = kv_bytes_per_chunk(preset.model, preset.dtype or "bfloat16", preset.kv_dtype)
    gpu, cpu = preset.gpu_cache_chunks, preset.cpu_cache_chunks
    if preset.gpu_cache_gb is not None:
        gpu = int(preset.gpu_cache_gb * 2**30 // per)
    if preset.cpu_cache_gb is not None:
        cpu = int(_cpu_pool_gb(preset.cpu_cache_gb) * 2**30 // per)
    return replace(preset, gpu_cache_chunks=gpu, cpu_cache_chunks=cpu)


def model_args(model: str):
    """The model's shape without loading its weights."""
    from engine.loader import model_args as shape

    return shape(model)


def kv_bytes_per_chunk(model: str, dtype: str, kv_dtype: str = "auto", chunk_size: int = 32) -> int:
    """K and V bytes of one chunk across all layers (8-bit: with its scales), from the shape."""
    import torch

    from engine.kv_pool import KVPool

    return KVPool.bytes_per_block(model_args(model), chunk_size, getattr(torch, dtype), kv_dtype)


def _chunks(conv: wl.Conversation, chunk: int) -> int:
    """Chunks that the conversation's full context takes."""
    return -(-conv.context_lens()[-1] // chunk)


def history_chunks(convs: list[wl.Conversation], chunk: int = 32) -> int:
    """Chunks that every conversation's full context takes: the idle history at its largest."""
    return sum(_chunks(c, chunk) for c in convs)


def fit_pools(preset: Preset, convs: list[wl.Conversation], chunk: int = 32) -> Preset:
    """First tier = gpu_fraction of the sample's history (at least room for the longest
    conversation twice over); the second tier holds all of it. Sized in bytes of the
    model's own dtype: an 8-bit KV gets the chunks that the same bytes hold."""
    total = history_chunks(convs, chunk)
    longest = max(_chunks(c, chunk) for c in convs)
    gpu = max(int(total * preset.gpu_fraction), 2 * longest + 2)
    cpu = max(total, gpu)
    if preset.kv_dtype != "auto":
        dtype = preset.dtype or "bfloat16"
        per = kv_bytes_per_chunk(preset.model, dtype, chunk_size=chunk)
        per8 = kv_bytes_per_chunk(preset.model, dtype, preset.kv_dtype, chunk)
        gpu, cpu = gpu * per // per8, cpu * per // per8
    return replace(preset, gpu_cache_chunks=gpu, cpu_cache_chunks=cpu)


def _cpu_pool_gb(wanted: float) -> float:
    """The paper's CPU pool when the host has the memory, else 60% of the host's RAM."""
    host = host_memory_gb()
    return wanted if host is None else min(wanted, 0.6 * host)


async def run_once(
    driver_send,
    convs: list[wl.Conversation],
    rate: float,
    think: float,
    preset: Preset,
    desc: str,
) -> tuple[list[wl.TurnRecord], float]:
    # `rate` is in real seconds; time_scale compresses the think times of the replay.
    plans = wl.plan(convs, rate * preset.time_scale, think, preset.seed)
    total = sum(len(c.turns) for c in convs)
    bar = _bar(total, desc)
    start = time.monotonic()
    records = await wl.replay(
        plans, driver_send, time_scale=preset.time_scale, on_turn=lambda _: bar.update(1)
    )
    bar.close()
    return records, time.monotonic() - start


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _bar(total: int, desc: str):
    try:
        from tqdm import tqdm
    except ImportError:  # a bare GPU box may lack it; the bar is only a nicety
        return _NoBar()
    return tqdm(total=total, desc=desc, unit="turn", leave=False, disable=None, file=sys.stderr)


def _record(mode: str, think: float, rate: float, records, wall: float, extra: dict) -> dict:
    return {
        "mode": mode,
        "think_s": think,
        "rate": rate,
        "wall_s": wall,
        "metrics": metrics(records, wall),
        **extra,
    }


def _line(r: dict[str, Any]) -> str:
    m = r["metrics"]
    return (
        f"{r['mode']:<18} think {r['think_s']:>5g}s rate {r['rate']:>5g}/s  "
        f"{m['throughput_rps']:6.2f} req/s {m['throughput_tps']:7.1f} tok/s  "
        f"norm lat mean {m['norm_latency_mean'] * 1e3:7.1f} p90 {m['norm_latency_p90'] * 1e3:7.1f} ms/tok  "
        f"ttft p50 {m['ttft_p50_s']:.2f}s p90 {m['ttft_p90_s']:.2f}s  "
        f"cached {m['cached_tokens']} swapped {m['swapped_in_tokens']} "
        f"recomputed {m['recomputed_tokens']} susp {m['suspensions']} err {m['errors']}"
    )


def _log(*a) -> None:
    print(*a, flush=True)


def next_rate(rates: list[float], rate: float, max_rate: float | None) -> float | None:
    """After the last listed rate of a sweep still under the bound: twice it, up to max_rate."""
    if rate != rates[-1] or max_rate is None or 2 * rate > max_rate:
        return None
    return 2 * rate


async def bench_engine(
    preset: Preset, modes: list[str], log=_log, sample_file=None, on_run=None
) -> dict[str, Any]:
    from engine import AsyncEngine

    preset = size_pools(preset)
    convs, workload = load_workload(preset, model_args(preset.model).max_context, sample_file)
    log(wl.format_summary(workload["summary"]))
    if preset.gpu_fraction is not None:
        preset = fit_pools(preset, convs)
    per = kv_bytes_per_chunk(preset.model, preset.dtype or "bfloat16", preset.kv_dtype)
    workload["pools"] = {
        "kv_dtype": preset.kv_dtype,
        "gpu_cache_chunks": preset.gpu_cache_chunks,
        "cpu_cache_chunks": preset.cpu_cache_chunks,
        "history_chunks": history_chunks(convs),
        "bytes_per_chunk": per,
        "gpu_cache_bytes": (preset.gpu_cache_chunks or 0) * per,
    }
    log(f"pools: {workload['pools']}")
    runs: list[dict[str, Any]] = []
    bound = preset.latency_bound
    for mode_name in modes:
        mode = MODES[mode_name]
        engine = AsyncEngine(engine_config(preset, mode))
        await engine.start()
        try:
            for think in preset.think_s:
                rates = list(preset.rates)
                for rate in rates:  # grows while the mode has not crossed the bound
                    driver = EngineDriver(engine, f"{mode_name}-{think:g}-{rate:g}")
                    before = engine.snapshot().counters
                    records, wall = await run_once(
                        driver.send, convs, rate, think, preset, f"{mode_name} rate {rate:g}"
                    )
                    await asyncio.sleep(0.6)  # the loop refreshes its snapshot once idle
                    counters = counters_delta(before, engine.snapshot().counters)
                    await driver.free()
                    run = _record(mode_name, think, rate, records, wall, {"counters": counters})
                    runs.append(run)
                    log(_line(run))
                    if on_run is not None:
                        on_run({"workload": workload, "runs": runs})
                    m = run["metrics"]
                    if m["errors"] or m["norm_latency_mean"] > bound * preset.stop_past_bound:
                        log(f"{mode_name}: past the latency bound, skipping higher rates")
                        break
                    nxt = next_rate(rates, rate, preset.max_rate)
                    if nxt is not None:
                        log(f"{mode_name}: under the bound at {rate:g}/s, going on to {nxt:g}/s")
                        rates.append(nxt)
        finally:
            await engine.stop()
    return {"workload": workload, "runs": runs}


async def bench_url(
    preset: Preset, url: str, token: str, log=_log, sample_file=None, api: str = "ws"
) -> dict[str, Any]:
    convs, workload = load_workload(preset, preset.context_cap, sample_file)
    log(wl.format_summary(workload["summary"]))
    runs = []
    for think in preset.think_s:
        for rate in preset.rates:
            driver = OpenAIDriver(url, token) if api == "openai" else UrlDriver(url, token)
            mode = "server-openai" if api == "openai" else "server"
            try:
                records, wall = await run_once(
                    driver.send, convs, rate, think, preset, f"{mode} rate {rate:g}"
                )
            finally:
                await driver.close()
            run = _record(mode, think, rate, records, wall, {"url": url, "api": api})
            runs.append(run)
            log(_line(run))
    return {"workload": workload, "runs": runs}


def load_tokenizer(model: str):
    """The tokenizer of the model the server runs (the sample's token counts depend on it)."""
    from transformers import AutoTokenizer

    from engine.loader import BUNDLED, model_dir

    if model.startswith("dummy:"):  # dummy shapes use the bundled tokenizer
        model = BUNDLED
    return AutoTokenizer.from_pretrained(model_dir(model))


def save_sample(path: Path, convs: list[wl.Conversation], workload: dict[str, Any]) -> None:
    """The tokenized sample as JSON: a machine without the dataset package replays it as is."""
    data = {"workload": workload, "conversations": [asdict(c) for c in convs]}
    path.write_text(json.dumps(data))


def read_sample(path: Path) -> tuple[list[wl.Conversation], dict[str, Any]]:
    data = json.loads(path.read_text())
    convs = [
        wl.Conversation(c["id"], [wl.TurnSpec(**t) for t in c["turns"]])
        for c in data["conversations"]
    ]
    return convs, {**data["workload"], "sample_file": path.name}


def load_workload(preset: Preset, max_context: int | None, sample_file=None):
    """The preset's sample: replayed from `sample_file` when it exists (no tokenizer or
    dataset needed, as on a bare GPU machine), else drawn from ShareGPT and tokenized."""
    if sample_file is not None and Path(sample_file).exists():
        convs, info = read_sample(Path(sample_file))
        if preset.conversations < len(convs):  # a quick check on the first few
            convs = convs[: preset.conversations]
        if preset.dry:
            convs = wl.shorten(convs, prompt=40, output=6, turns=3)
        return convs, {**info, "summary": wl.summarize(convs)}
    tokenizer = load_tokenizer(preset.model)
    data = wl.load_sharegpt(tokenizer)
    cap = min(preset.context_cap, max_context or preset.context_cap)
    convs = wl.sample(
        data.conversations,
        preset.conversations,
        preset.seed,
        context_cap=cap,
        max_output=preset.max_output,
        min_turns=preset.min_turns,
        max_turns=preset.max_turns,
        min_context=preset.min_context,
    )
    return convs, {
        "source": data.source,
        "parse": asdict(data.report),
        "tokenizer": wl.tokenizer_name(tokenizer),
        "context_cap": cap,
        "summary": wl.summarize(convs),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.serve", description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="cpu", choices=sorted(PRESETS))
    ap.add_argument("--modes", help=f"comma-separated, of {sorted(MODES)}")
    ap.add_argument("--rates", help="comma-separated new conversations per second")
    ap.add_argument("--think", help="comma-separated mean think times (s)")
    ap.add_argument("--conversations", type=int)
    ap.add_argument("--time-scale", type=float)
    ap.add_argument("--model")
    ap.add_argument("--device")
    ap.add_argument("--dtype", help="model dtype (float32, bfloat16, float16)")
    ap.add_argument(
        "--kv-dtype",
        choices=("auto", "fp8", "int8"),
        help="KV cache dtype; 8-bit pools get the chunks that auto's bytes hold",
    )
    ap.add_argument("--gpu-chunks", type=int)
    ap.add_argument("--cpu-chunks", type=int)
    ap.add_argument("--threads", type=int, help="torch intra-op threads")
    ap.add_argument("--url", help="benchmark a running server instead of the engine in process")
    ap.add_argument(
        "--api",
        choices=("ws", "openai"),
        default="ws",
        help="with --url: drive the chat WebSocket or the OpenAI API (/v1)",
    )
    ap.add_argument(
        "--token",
        default=os.environ.get("PENSIEVE_TOKEN"),
        help="bearer token (write --token=T: a token may start with -)",
    )
    ap.add_argument(
        "--out", type=Path, help="JSON path (default bench/results/serve_<preset>.json)"
    )
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument(
        "--sample-file",
        type=Path,
        help="replay this tokenized sample (JSON) when it exists (default: the preset's)",
    )
    ap.add_argument(
        "--dry-run",
        action="store_true",
        help="the preset's plumbing on the CPU in seconds (dummy:tiny, short turns); "
        "writes under the temp dir unless --out",
    )
    ap.add_argument("--save-sample", type=Path, help="write the tokenized sample as JSON and exit")
    ap.add_argument("--bound", type=float, help="mean normalized latency bound (s/token)")
    ap.add_argument(
        "--append",
        action="store_true",
        help="keep the runs already in --out (a sweep split over several invocations); "
        "a run of the same mode, think time and rate replaces the earlier one",
    )
    ap.add_argument(
        "--from-json", type=Path, help="recompute claims and the plot of an earlier result"
    )
    args = ap.parse_args(argv)

    if args.from_json:
        result = json.loads(args.from_json.read_text())
        if args.bound is not None:
            result["preset"]["latency_bound"] = args.bound
        result["claims"] = claims(result["runs"], result["preset"]["latency_bound"])
        args.from_json.write_text(json.dumps(result, indent=1, default=float) + "\n")
        print(json.dumps(result["claims"], indent=1))
        if not args.no_plot:
            from bench.plots import plot_serve

            print(f"wrote {plot_serve(result, args.from_json.with_suffix('.png'))}")
        return 0

    preset = PRESETS[args.preset]
    if args.dry_run:
        preset = dry_run(preset)
    floats = lambda s: [float(x) for x in s.split(",")]  # noqa: E731
    changes: dict[str, Any] = {}
    if args.rates:
        changes["rates"] = floats(args.rates)
    if args.think:
        changes["think_s"] = floats(args.think)
    for key, val in (
        ("conversations", args.conversations),
        ("time_scale", args.time_scale),
        ("model", args.model),
        ("device", args.device),
        ("dtype", args.dtype),
        ("kv_dtype", args.kv_dtype),
        ("gpu_cache_chunks", args.gpu_chunks),
        ("cpu_cache_chunks", args.cpu_chunks),
        ("threads", args.threads),
        ("latency_bound", args.bound),
    ):
        if val is not None:
            changes[key] = val
    if args.gpu_chunks is not None:
        changes["gpu_cache_gb"] = None
    if args.cpu_chunks is not None:
        changes["cpu_cache_gb"] = None
    preset = replace(preset, **changes)
    modes = args.modes.split(",") if args.modes else preset.modes
    unknown = [m for m in modes if m not in MODES]
    if unknown and not args.url:
        ap.error(f"unknown modes {unknown}; choose from {sorted(MODES)}")

    if args.save_sample:
        convs, workload = load_workload(preset, model_args(preset.model).max_context)
        save_sample(args.save_sample, convs, workload)
        print(wl.format_summary(workload["summary"]))
        print(f"wrote {args.save_sample}")
        return 0

    sample_file = args.sample_file or (preset.sample_file and ROOT / preset.sample_file)
    results = Path(tempfile.gettempdir()) / "pensieve-dry-run" if preset.dry else RESULTS
    out = args.out or results / f"serve_{preset.name}{'_url' if args.url else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    if preset.threads and not args.url:
        import torch

        torch.set_num_threads(preset.threads)  # before `environment` records the count
    env = environment()  # the commit and machine the run started on

    previous: list[dict[str, Any]] = []
    if args.append and out.exists():
        earlier = json.loads(out.read_text())
        if earlier.get("preset", {}).get("model") != preset.model:
            ap.error(f"--append: {out} holds runs of another model")
        previous = earlier["runs"]

    def report(result: dict[str, Any]) -> dict[str, Any]:
        for r in result["runs"]:
            r.setdefault("git_commit", env["git_commit"])
        runs = merge_runs(previous, result["runs"])
        result = {
            "benchmark": "serve",
            "preset": asdict(preset),
            "modes": list(dict.fromkeys(r["mode"] for r in runs)),
            "environment": env,
            "elapsed_s": time.monotonic() - t0,
            **result,
            "runs": runs,
            "claims": claims(runs, preset.latency_bound),
        }
        out.write_text(json.dumps(result, indent=1, default=float) + "\n")
        return result

    if args.url:
        if not args.token:
            ap.error("--url needs --token (or PENSIEVE_TOKEN)")
        result = asyncio.run(
            bench_url(preset, args.url, args.token, sample_file=sample_file, api=args.api)
        )
    else:
        result = asyncio.run(bench_engine(preset, modes, sample_file=sample_file, on_run=report))
    result = report(result)
    print(f"wrote {out} in {result['elapsed_s']:.0f}s")
    print(json.dumps(result["claims"], indent=1))
    if not args.no_plot:
        try:
            from bench.plots import plot_serve
        except ImportError as e:  # a bare GPU machine: plot later where matplotlib is
            print(f"no plot ({e}); draw it with --from-json {out}")
            return 0
        print(f"wrote {plot_serve(result, out.with_suffix('.png'))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
