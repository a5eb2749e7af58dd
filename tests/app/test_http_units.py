"""Settings and flags derived from EngineConfig, log redaction, the rate limit."""

from __future__ import annotations

import dataclasses

import pytest

from app.cli import _settings, parser
from app.logs import redact
from app.settings import ENGINE_HELP, SET_BY_SERVER, Settings
from engine.types import EngineConfig

FIELDS = {f.name: f for f in dataclasses.fields(EngineConfig)}
# Scheduling knobs an operator tunes on a server, with a value other than the default.
KNOBS = {"max_running": 7, "admit_reserve": 0.2, "swap_out_threshold": 0.3, "max_waiting": 9}


def test_every_engine_field_is_a_setting_and_a_flag_with_help():
    flags = {a.dest: a for a in parser()._subparsers._group_actions[0].choices["serve"]._actions}
    for name, f in FIELDS.items():
        if name in SET_BY_SERVER:  # follows a server setting (kv_events: an endpoint)
            assert name not in flags and name not in Settings.model_fields
            continue
        assert ENGINE_HELP.get(name), f"EngineConfig.{name} has no help text in ENGINE_HELP"
        assert Settings.model_fields[name].default == f.default
        assert flags[name].help == ENGINE_HELP[name]
    assert Settings().engine_config() == EngineConfig()
    events = Settings(kv_events_endpoint="tcp://127.0.0.1:5557").engine_config()
    assert events == EngineConfig(kv_events=True)


def test_scheduling_knobs_from_env(monkeypatch):
    knobs = {k: v for k, v in KNOBS.items() if k in FIELDS}
    assert {"max_running", "admit_reserve", "swap_out_threshold"} <= set(knobs)
    for name, value in knobs.items():
        monkeypatch.setenv(f"PENSIEVE_{name.upper()}", str(value))
    config = Settings().engine_config()
    assert {k: getattr(config, k) for k in knobs} == knobs


def test_scheduling_knobs_from_flags(monkeypatch):
    knobs = {k: v for k, v in KNOBS.items() if k in FIELDS}
    argv = ["serve", "--no-unified", "--gpu-cache-chunks", "12"]
    for name, value in knobs.items():
        argv += ["--" + name.replace("_", "-"), str(value)]
    monkeypatch.setenv("PENSIEVE_MAX_RUNNING", "99")  # a flag wins over the environment
    config = _settings(parser().parse_args(argv)).engine_config()
    assert {k: getattr(config, k) for k in knobs} == knobs
    assert config.unified is False and config.gpu_cache_chunks == 12


@pytest.mark.parametrize(
    ("env", "says"),
    [("PENSIEVE_ADMIT_RESERVE", "admit_reserve"), ("PENSIEVE_CHUNK_SIZE", "power of two")],
)
def test_bad_engine_settings_fail_at_once(monkeypatch, env, says):
    monkeypatch.setenv(env, "3")
    with pytest.raises(ValueError, match=says):
        Settings()


@pytest.mark.parametrize(
    ("line", "clean"),
    [
        ("GET /admin?token=abc HTTP/1.1", "GET /admin?token=[redacted] HTTP/1.1"),
        ("/x?a=1&access_token=abc&b=2", "/x?a=1&access_token=[redacted]&b=2"),
        ("/x?API_KEY=abc", "/x?API_KEY=[redacted]"),
        ('"GET /p?password=hunter2 HTTP/1.1" 200', '"GET /p?password=[redacted] HTTP/1.1" 200'),
        ("/ws/chat/c1?session=s", "/ws/chat/c1?session=[redacted]"),
        ("/x?title=token", "/x?title=token"),
    ],
)
def test_redact(line, clean):
    assert redact(line) == clean
