"""Build, from registries only, a virtualenv in which real SGLang runs on a CPU, and its model.

Tests and the demo prove the engine adapter against the real engine, and the machines they run
on have no GPU and cannot download weights. ``pip install sglang`` cannot work there (it pins a
CUDA torch and GPU-only kernels), so this module follows a fixed recipe instead:

1. ``shim``: copy the CPU-test glue (``shim/``: an ``sgl_kernel`` stand-in and a
   ``sitecustomize`` that lets CUDA-linked torchvision import) to ``<root>/sglang-shim``, which
   goes on the engine's ``PYTHONPATH`` only.
2. ``venv``: ``<root>/sglang-venv``, made with the Python that runs this, holding exactly the
   pins of ``requirements-cpu.txt`` (installed with ``--no-deps``; see ``requirements-cpu.in``).
3. ``model``: ``<root>/models/tiny-llama``, made by ``make_model.py`` inside that venv.

Each step writes a stamp holding the hash of its inputs and is skipped while the hash matches,
so ``setup`` is idempotent and cheap once done. This module imports only the standard library
(and ``engine_adapter.conf``, which does too): it runs under the platform's Python, never
inside the SGLang venv.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from engine_adapter import conf

PACKAGE_DIR = Path(__file__).resolve().parent
REQUIREMENTS_IN = PACKAGE_DIR / "requirements-cpu.in"
REQUIREMENTS_LOCK = PACKAGE_DIR / "requirements-cpu.txt"
SHIM_SOURCE = PACKAGE_DIR / "shim"
MAKE_MODEL = PACKAGE_DIR / "make_model.py"
# Bump to force every machine to rebuild, e.g. after changing how a step runs.
RECIPE_VERSION = "1"
SUPPORTED_PYTHON = (3, 11)
# The venv takes about 3.5 GB; keep headroom for pip's downloads and unpacking.
MIN_FREE_BYTES = 6 * 1024**3
MODEL_NAME = "tiny-llama"


class SetupError(RuntimeError):
    """The SGLang CPU environment is missing or could not be built; the message says what to do."""


@dataclass(frozen=True)
class SglangPaths:
    """Where the SGLang CPU environment lives under one root (``.tollgate`` by default)."""

    root: Path

    @property
    def venv(self) -> Path:
        return self.root / "sglang-venv"

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    @property
    def shim(self) -> Path:
        return self.root / "sglang-shim"

    @property
    def model_dir(self) -> Path:
        return self.root / "models" / MODEL_NAME

    @property
    def stamps(self) -> Path:
        return self.root / "stamps"

    @property
    def logs(self) -> Path:
        return self.root / "logs"


def default_root() -> Path:
    """Return ``$TOLLGATE_ROOT`` if set, else ``.tollgate`` at the repository root."""
    return conf.state_dir().resolve()


def resolve_paths(root: Path | str | None = None) -> SglangPaths:
    """Return the paths of the environment under ``root`` (default: :func:`default_root`)."""
    return SglangPaths(Path(root).resolve() if root is not None else default_root())


# -- hashes and stamps ---------------------------------------------------------------------


def _digest(parts: Iterable[bytes]) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(len(part).to_bytes(8, "big"))
        h.update(part)
    return h.hexdigest()


def _shim_files() -> list[Path]:
    return sorted(
        p
        for p in SHIM_SOURCE.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
    )


def _step_hashes() -> dict[str, str]:
    interpreter = f"{sys.version}|{os.path.realpath(sys.executable)}|{platform.machine()}"
    venv = _digest([RECIPE_VERSION.encode(), interpreter.encode(), REQUIREMENTS_LOCK.read_bytes()])
    shim = _digest(
        [RECIPE_VERSION.encode()]
        + [str(p.relative_to(SHIM_SOURCE)).encode() + b"\0" + p.read_bytes() for p in _shim_files()]
    )
    # The model depends on the venv (torch, transformers, the stdlib the tokenizer reads).
    model = _digest([RECIPE_VERSION.encode(), venv.encode(), MAKE_MODEL.read_bytes()])
    return {"shim": shim, "venv": venv, "model": model}


def _read_stamp(paths: SglangPaths, step: str) -> dict[str, object]:
    try:
        return json.loads((paths.stamps / f"{step}.json").read_text())
    except (OSError, ValueError):
        return {}


def _write_stamp(paths: SglangPaths, step: str, digest: str, seconds: float) -> None:
    paths.stamps.mkdir(parents=True, exist_ok=True)
    stamp = {"hash": digest, "seconds": round(seconds, 1), "finished_at": time.time()}
    (paths.stamps / f"{step}.json").write_text(json.dumps(stamp, indent=2) + "\n")


def _artifact_present(paths: SglangPaths, step: str) -> bool:
    if step == "shim":
        return (paths.shim / "sgl_kernel" / "__init__.py").is_file()
    if step == "venv":
        return paths.python.exists()
    return (paths.model_dir / "config.json").is_file()


def stale_steps(root: Path | str | None = None) -> list[str]:
    """Return the set-up steps whose output is missing or older than the recipe."""
    paths = resolve_paths(root)
    return [
        step
        for step, digest in _step_hashes().items()
        if _read_stamp(paths, step).get("hash") != digest or not _artifact_present(paths, step)
    ]


def is_ready(root: Path | str | None = None) -> bool:
    """Return whether the venv, the shim and the model are built and up to date."""
    return not stale_steps(root)


# -- steps ---------------------------------------------------------------------------------

Log = Callable[[str], None]


def _print_log(message: str) -> None:
    print(f"[sglang-cpu] {message}", flush=True)  # noqa: T201 - progress for a CLI/CI log


def _run_logged(argv: list[str], log_file: Path, *, env: dict[str, str] | None = None) -> None:
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with log_file.open("w") as out:
        out.write("$ " + " ".join(argv) + "\n")
        out.flush()
        result = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, env=env, check=False)
    if result.returncode != 0:
        tail = "\n".join(log_file.read_text(errors="replace").splitlines()[-25:])
        raise SetupError(
            f"`{' '.join(argv[:4])} ...` failed (exit {result.returncode}); "
            f"full log: {log_file}\n--- last lines ---\n{tail}"
        )


def _engine_env(paths: SglangPaths) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "VIRTUAL_ENV"}}
    env.update({"PYTHONPATH": str(paths.shim), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    return env


def _check_host(paths: SglangPaths) -> None:
    if sys.version_info[:2] != SUPPORTED_PYTHON:
        raise SetupError(
            f"SGLang's CPU recipe is pinned for Python {'.'.join(map(str, SUPPORTED_PYTHON))} "
            f"(cp311 wheels of sglang and torch); this is {platform.python_version()}. "
            "Run the setup with a Python 3.11 interpreter."
        )
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        raise SetupError(
            f"The pinned wheels are for Linux x86_64; this is {platform.system()} "
            f"{platform.machine()}. Use the engine simulator (engine_adapter/sim) here instead."
        )
    paths.root.mkdir(parents=True, exist_ok=True)
    # Keep everything under the root out of git, whatever the repository's .gitignore says.
    ignore = paths.root / ".gitignore"
    if not ignore.exists():
        ignore.write_text("# Made by engine_adapter.sglang_cpu: build outputs, never commit.\n*\n")


def _build_shim(paths: SglangPaths, log: Log) -> None:
    tmp = paths.shim.with_name(paths.shim.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(SHIM_SOURCE, tmp, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.rmtree(paths.shim, ignore_errors=True)
    tmp.rename(paths.shim)
    log(f"shim: sgl_kernel stand-in and torchvision sitecustomize in {paths.shim}")


def _build_venv(paths: SglangPaths, log: Log) -> None:
    if paths.venv.exists():
        log(f"venv: recipe changed, removing the old {paths.venv}")
        shutil.rmtree(paths.venv)
    free = shutil.disk_usage(paths.root).free
    if free < MIN_FREE_BYTES:
        raise SetupError(
            f"Only {free / 1024**3:.1f} GiB free under {paths.root}; the SGLang venv needs about "
            f"{MIN_FREE_BYTES / 1024**3:.0f} GiB. Free some space or pass --root elsewhere."
        )
    log(f"venv: creating {paths.venv} with {sys.executable}")
    _run_logged([sys.executable, "-m", "venv", str(paths.venv)], paths.logs / "venv-create.log")
    pins = sum(
        1 for line in REQUIREMENTS_LOCK.read_text().splitlines() if "==" in line.split("#")[0]
    )
    pip_log = paths.logs / "venv-pip.log"
    log(f"venv: installing {pins} pinned packages (~3.5 GB, a few minutes; log: {pip_log})")
    try:
        _run_logged(
            [
                str(paths.python),
                "-m",
                "pip",
                "install",
                "--no-input",
                "--no-deps",
                "--disable-pip-version-check",
                "-r",
                str(REQUIREMENTS_LOCK),
            ],
            pip_log,
        )
    except SetupError as exc:
        raise SetupError(
            f"{exc}\nWhat to do: check that PyPI is reachable (`pip download six`), and that "
            "`pip install torch==2.13.0` finds the CPU wheel this kind of machine keeps on "
            "local disk (pip's find-links). Then rerun setup; finished steps are kept."
        ) from exc
    log("venv: checking that sglang imports with the shim")
    _run_logged(
        [
            str(paths.python),
            "-c",
            "import sglang, torch, torchvision, sgl_kernel; "
            "assert not torch.cuda.is_available(); print(sglang.__version__, torch.__version__)",
        ],
        paths.logs / "venv-check.log",
        env=_engine_env(paths),
    )


def _build_model(paths: SglangPaths, log: Log) -> None:
    tmp = paths.model_dir.with_name(paths.model_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    log(f"model: making {MODEL_NAME} (random weights, seeded) in {paths.model_dir}")
    _run_logged(
        [str(paths.python), str(MAKE_MODEL), "--out", str(tmp)],
        paths.logs / "model.log",
        env=_engine_env(paths),
    )
    shutil.rmtree(paths.model_dir, ignore_errors=True)
    tmp.rename(paths.model_dir)


@contextlib.contextmanager
def _exclusive(paths: SglangPaths, log: Log) -> Iterator[None]:
    """Hold the root's set-up lock, so concurrent setups (tests, fleet up) build once."""
    with (paths.root / ".setup.lock").open("w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log("another setup is running on this root; waiting for it")
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


_STEPS: dict[str, Callable[[SglangPaths, Log], None]] = {
    "shim": _build_shim,
    "venv": _build_venv,
    "model": _build_model,
}


def setup(root: Path | str | None = None, *, log: Log = _print_log) -> SglangPaths:
    """Build whatever is missing or stale under ``root`` and return the paths; idempotent."""
    paths = resolve_paths(root)
    started = time.monotonic()
    _check_host(paths)
    with _exclusive(paths, log):
        hashes = _step_hashes()
        stale = set(stale_steps(paths.root))
        for step, build in _STEPS.items():
            if step not in stale:
                log(f"{step}: up to date, skipped")
                continue
            step_started = time.monotonic()
            build(paths, log)
            seconds = time.monotonic() - step_started
            _write_stamp(paths, step, hashes[step], seconds)
            log(f"{step}: done in {seconds:.1f}s")
    total = time.monotonic() - started
    log(f"ready in {total:.1f}s: python={paths.python} model={paths.model_dir}")
    return paths


def ensure_ready(root: Path | str | None = None, *, log: Log = _print_log) -> SglangPaths:
    """Return the paths, running :func:`setup` first if anything is missing or stale."""
    paths = resolve_paths(root)
    if is_ready(paths.root):
        return paths
    return setup(paths.root, log=log)


# -- re-pinning ----------------------------------------------------------------------------


def lock(root: Path | str | None = None, *, log: Log = _print_log) -> Path:
    """Resolve ``requirements-cpu.in`` in a scratch venv and rewrite ``requirements-cpu.txt``."""
    paths = resolve_paths(root)
    _check_host(paths)
    resolved: list[str] = []
    no_deps: list[str] = []
    for raw in REQUIREMENTS_IN.read_text().splitlines():
        requirement, _, comment = raw.partition("#")
        if requirement.strip():
            (no_deps if comment.strip() == "no-deps" else resolved).append(requirement.strip())
    with tempfile.TemporaryDirectory(dir=paths.root, prefix="lock-") as scratch:
        python = Path(scratch) / "venv" / "bin" / "python"
        log_dir = paths.logs
        _run_logged([sys.executable, "-m", "venv", str(python.parents[1])], log_dir / "lock.log")
        pip = [str(python), "-m", "pip", "install", "--no-input", "--disable-pip-version-check"]
        log(f"lock: resolving {len(resolved)} requirements (log: {log_dir / 'lock-pip.log'})")
        _run_logged(pip + resolved, log_dir / "lock-pip.log")
        log(f"lock: adding {', '.join(no_deps)} without their dependencies")
        _run_logged([*pip, "--no-deps", *no_deps], log_dir / "lock-pip-no-deps.log")
        freeze = subprocess.run(
            [str(python), "-m", "pip", "freeze", "--all", "--disable-pip-version-check"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.splitlines()
    pins = sorted((line for line in freeze if not line.lower().startswith("pip==")), key=str.lower)
    header = (
        "# Pinned by `python -m engine_adapter.sglang_cpu lock` from requirements-cpu.in "
        "(Python 3.11,\n# x86_64). Installed as-is with `pip install --no-deps`; edit the .in "
        "file, then re-lock.\n"
    )
    REQUIREMENTS_LOCK.write_text(header + "\n".join(pins) + "\n")
    log(f"lock: wrote {len(pins)} pins to {REQUIREMENTS_LOCK}")
    return REQUIREMENTS_LOCK
