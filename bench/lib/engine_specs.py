"""Engine configurations given on a benchmark's command line, passed through to the server:
`pensieve serve` settings, comma- or space-separated (`dtype=bfloat16,max-batch-tokens=512`;
a bare dtype name sets the dtype, a bare name is a switch: `name` on, `no-name` off). Any
setting the server knows is accepted (checked against `Settings`); the server gets them as
PENSIEVE_* variables, the in-process engine as an `EngineConfig`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

DTYPES = ("float32", "bfloat16", "float16")
DEFAULTS = {"device": "cpu", "dtype": "float32"}


@dataclass(frozen=True)
class EngineSpec:
    label: str  # as given on the command line
    settings: dict[str, str] = field(default_factory=dict)  # over DEFAULTS

    def merged(self) -> dict[str, str]:
        return {**DEFAULTS, **self.settings}

    def env(self) -> dict[str, str]:
        """The settings as the server's environment variables."""
        return {f"PENSIEVE_{k.upper()}": v for k, v in self.merged().items()}

    def engine_config(self):
        """The in-process engine's `EngineConfig` (the server's other settings do not apply)."""
        from app.settings import Settings

        return Settings(**self.merged()).engine_config()


def _name(key: str) -> str:
    return key.strip().lstrip("-").replace("-", "_").lower()


def parse(text: str, known: set[str] | None = None) -> EngineSpec:
    """One configuration; `known` (the server's setting names) rejects misspelt ones."""
    settings: dict[str, str] = {}
    for item in (i for i in re.split(r"[,\s]+", text.strip()) if i):
        if "=" in item:
            key, value = item.split("=", 1)
            key, value = _name(key), value.strip()
        elif item in DTYPES:
            key, value = "dtype", item
        elif _name(item).startswith("no_"):
            key, value = _name(item)[3:], "false"
        else:
            key, value = _name(item), "true"
        if not key or not value:
            raise ValueError(f"engine configuration {text!r}: bad item {item!r}")
        if known is not None and key not in known:
            raise ValueError(f"engine configuration {text!r}: the server has no setting {key!r}")
        settings[key] = value
    return EngineSpec(label=text.strip() or "float32", settings=settings)


def server_settings() -> set[str]:
    from app.settings import Settings

    return set(Settings.model_fields)


def parse_all(texts: list[str], known: set[str] | None = None) -> list[EngineSpec]:
    """The configurations to run, the float32 default first (always, once)."""
    specs = [parse(t, known) for t in texts]
    base = EngineSpec("float32", {"dtype": "float32"})
    rest = [s for s in specs if s.merged() != base.merged()]
    labels = [s.label for s in rest]
    if len(set(labels)) != len(labels):
        raise ValueError(f"engine configurations given twice: {labels}")
    return [base, *rest]
