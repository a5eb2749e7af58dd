"""An agent-like workload three ways: many short tool turns on a growing context.

    python -m bench.agent_protocols --agents 3 --steps 12

Each agent asks a question with three function tools, then loops: the model must call a
tool (`tool_choice: required`), the agent answers with a result of about `--result-words`
words. Modes: `responses` (`/v1/responses` with `previous_response_id`: a step sends only
the new output item), `chat` (`/v1/chat/completions` resending the whole chat; the server
finds the conversation by its prefix), `stateless` (the same resend to a server with
`cache_mode=stateless`). Per step: time to the whole answer, request bytes, cached tokens.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.lib.common import RESULTS, environment
from bench.lib.harness import Server

MODEL = "smollm2-135m-instruct"
MODES = ("responses", "chat", "stateless")
SYSTEM = "You are an agent. Use the tools to answer; call one tool at a time."
PARAMS = {"type": "object", "properties": {"query": {"type": "string", "maxLength": 24}},
          "required": ["query"], "additionalProperties": False}  # fmt: skip
TOOLS = [
    ("search_docs", "Search the documentation."),
    ("read_file", "Read a file of the project."),
    ("run_tests", "Run the tests matching a pattern."),
]
WORDS = "alpha beta gamma delta kernel cache chunk swap layer token batch step query".split()  # noqa: SIM905


def chat_tools() -> list[dict]:
    return [{"type": "function", "function": t} for t in response_tools(flat=False)]


def response_tools(flat: bool = True) -> list[dict]:
    tools = [{"name": n, "description": d, "parameters": PARAMS} for n, d in TOOLS]
    return [{"type": "function", **t} for t in tools] if flat else tools


def tool_result(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


class Agent:
    """One agent's loop against `url` with owner `key`, in `mode`."""

    def __init__(self, url: str, key: str, mode: str, seed: int, args) -> None:
        import httpx

        self.http = httpx.Client(base_url=url + "/v1", timeout=600, trust_env=False,
                                 headers={"Authorization": f"Bearer {key}"})  # fmt: skip
        self.mode, self.args = mode, args
        self.rng = random.Random(seed)
        self.question = f"Task {seed}: find why step {seed} is slow and fix it."

    def post(self, path: str, body: dict) -> tuple[dict, int, float]:
        raw = json.dumps(body).encode()
        t0 = time.perf_counter()
        r = self.http.post(path, content=raw, headers={"Content-Type": "application/json"})
        elapsed = time.perf_counter() - t0
        r.raise_for_status()
        return r.json(), len(raw), elapsed

    def run(self) -> list[dict]:
        return self.run_responses() if self.mode == "responses" else self.run_chat()

    def run_chat(self) -> list[dict]:
        messages = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": self.question},
        ]
        steps = []
        for _ in range(self.args.steps):
            body = {"model": MODEL, "messages": messages, "tools": chat_tools(),
                    "tool_choice": "required", "parallel_tool_calls": False,
                    "temperature": 0, "max_tokens": self.args.reply_tokens}  # fmt: skip
            out, sent, elapsed = self.post("/chat/completions", body)
            msg = out["choices"][0]["message"]
            call = msg["tool_calls"][0]
            messages += [
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": call["id"],
                 "content": tool_result(self.rng, self.args.result_words)},
            ]  # fmt: skip
            usage = out["usage"]
            steps.append(record(elapsed, sent, usage["prompt_tokens"],
                                usage["prompt_tokens_details"]["cached_tokens"]))  # fmt: skip
        return steps

    def run_responses(self) -> list[dict]:
        steps, previous = [], None
        items: list = [{"role": "user", "content": self.question}]
        for _ in range(self.args.steps):
            body = {"model": MODEL, "input": items, "instructions": SYSTEM,
                    "tools": response_tools(), "tool_choice": "required",
                    "parallel_tool_calls": False, "temperature": 0,
                    "max_output_tokens": self.args.reply_tokens}  # fmt: skip
            if previous:
                body["previous_response_id"] = previous
            out, sent, elapsed = self.post("/responses", body)
            previous = out["id"]
            call = next(o for o in out["output"] if o["type"] == "function_call")
            items = [{"type": "function_call_output", "call_id": call["call_id"],
                      "output": tool_result(self.rng, self.args.result_words)}]  # fmt: skip
            usage = out["usage"]
            steps.append(record(elapsed, sent, usage["input_tokens"],
                                usage["input_tokens_details"]["cached_tokens"]))  # fmt: skip
        return steps


def record(elapsed: float, sent: int, prompt: int, cached: int) -> dict:
    return {"latency_s": elapsed, "bytes_sent": sent, "prompt_tokens": prompt,
            "cached_tokens": cached}  # fmt: skip


def run_mode(mode: str, args, tmp: Path) -> list[list[dict]]:
    env = {"PENSIEVE_TURNS_PER_MINUTE": "100000"}
    if mode == "stateless":
        env["PENSIEVE_CACHE_MODE"] = "stateless"
    db = f"sqlite+aiosqlite:///{tmp / mode}.db"
    server = Server(database_url=db, log_path=tmp / f"{mode}.log", env=env).start()
    try:
        key = server.user("agent")
        agents = [Agent(server.url, key, mode, seed, args) for seed in range(args.agents)]
        with ThreadPoolExecutor(len(agents)) as pool:
            return list(pool.map(Agent.run, agents))
    finally:
        server.stop()


def summary(runs: list[list[dict]]) -> dict:
    """Per step: the median over agents; overall: means over every step."""
    per_step = [{k: statistics.median(r[i][k] for r in runs) for k in runs[0][i]}
                for i in range(len(runs[0]))]  # fmt: skip
    every = [s for r in runs for s in r]
    mean = lambda k: statistics.fmean(s[k] for s in every)  # noqa: E731
    return {"per_step": per_step, "latency_s_mean": mean("latency_s"),
            "latency_s_last": per_step[-1]["latency_s"], "bytes_sent_mean": mean("bytes_sent"),
            "bytes_sent_last": per_step[-1]["bytes_sent"],
            "cached_share": sum(s["cached_tokens"] for s in every)
            / max(1, sum(s["prompt_tokens"] for s in every))}  # fmt: skip


def plot(result: dict, path: Path) -> None:
    from bench.lib.plots import plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for mode, m in result["modes"].items():
        xs = range(1, len(m["per_step"]) + 1)
        a.plot(xs, [s["latency_s"] * 1000 for s in m["per_step"]], marker="o", label=mode)
        b.plot(xs, [s["bytes_sent"] / 1024 for s in m["per_step"]], marker="o", label=mode)
    a.set(xlabel="agent step", ylabel="time per step (ms, median of agents)")
    b.set(xlabel="agent step", ylabel="request size (KiB)")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend()
    env = result["environment"]
    fig.suptitle(f"Agent loop: {result['agents']} agents x {result['steps']} tool steps, "
                 f"{MODEL} on {env['device']} ({env['git_commit'][:9]})")  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--agents", type=int, default=3)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--result-words", type=int, default=120)
    p.add_argument("--reply-tokens", type=int, default=48)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--out", type=Path, default=RESULTS / "agent-cpu.json")
    args = p.parse_args(argv)
    result = {"benchmark": "agent_protocols", "agents": args.agents, "steps": args.steps,
              "result_words": args.result_words, "reply_tokens": args.reply_tokens,
              "environment": environment(), "modes": {}}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.modes.split(","):
            result["modes"][mode] = m = summary(run_mode(mode, args, Path(tmp)))
            print(f"{mode:10s} step {m['latency_s_mean'] * 1000:7.0f} ms mean, last "
                  f"{m['latency_s_last'] * 1000:7.0f} ms; sent {m['bytes_sent_mean']:8.0f} B "
                  f"mean, last {m['bytes_sent_last']:8.0f} B; cached {m['cached_share']:.0%}")  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    plot(result, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
