"""Pytester runs forked from a process that has already imported torch and transformers (`run_pytest`).

A `python -m pytest` subprocess of the suites spends ~10 s of CPU importing torch, transformers, dynamo and inductor
before its first check; with ~300 such runs, those imports were most of the tests job. The server here (one per xdist
worker) imports them and the plugin once, then forks one child per run: the child is that run's `python -m pytest` (same
arguments, working directory, environment, sys.path, stdout/stderr files; atexit handlers run), its exit status reported
back as Popen would (-N for a signal). Forking is safe: the server runs no torch op, so no OpenMP pool or other thread
exists when it forks. A run whose environment differs in what those imports read at import time (TORCH*, PYTORCH*,
TRANSFORMERS*, HF_*, OMP_*, MKL_*) gets a real subprocess instead, and so does every run when the server cannot start.
Tests of what the plugin imports at startup keep `runpytest_subprocess`.

Isolated engines (pytest_kvcompile/run/isolation.py) start as `python -m pytest_kvcompile.run.isolation`, each
importing torch and transformers anew (4-8 s of CPU a process here). In a forked run they are forked instead, from a
zygote the server forks after its imports (`Zygote`, `_zygote`): same pipes, log, session of its own, working
directory and environment as the spawned child, its exit status relayed back (`Forked`: Popen's methods the isolation
uses). Only the processes' start changes; what runs in them is isolation's own `_serve`.
"""

from __future__ import annotations

import array
import atexit
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest
from _pytest.pathlib import make_numbered_dir
from _pytest.pytester import RunResult

PRELOAD = ("torch", "torch._dynamo", "torch._inductor.compile_fx", "transformers", "transformers.generation",
           "transformers.models.llama.modeling_llama", "transformers.models.mistral.modeling_mistral",
           "transformers.models.gemma3.modeling_gemma3", "transformers.models.gemma4.modeling_gemma4",
           "transformers.models.gpt2.modeling_gpt2", "xdist.plugin", "pytest_benchmark.plugin",
           # hypothesis's pytest plugin imports hypothesis in every run's terminal summary: 0.9 s of a 2.2 s run here
           "hypothesis", "hypothesis.internal.observability",
           # the plugin and what a run of the suites imports after it (80 modules, compiled from source in every run
           # where bytecode is not written: PYTHONDONTWRITEBYTECODE), xdist's remote side, torch.export
           "pytest_kvcompile.plugin", "pytest_kvcompile.run.session", "pytest_kvcompile.run.fixtures",
           "pytest_kvcompile.run.harness", "pytest_kvcompile.run.isolation", "pytest_kvcompile.run.fuzz",
           "pytest_kvcompile.oracles.store", "pytest_kvcompile.oracles.token_match", "pytest_kvcompile.oracles.hf",
           "pytest_kvcompile.oracles.computations", "pytest_kvcompile.reports", "pytest_kvcompile.reports.html",
           "pytest_kvcompile.verdicts.results", "pytest_kvcompile.recompiles.recorder",
           "pytest_kvcompile.memory.measure", "pytest_kvcompile.latency.measure", "execnet", "xdist.looponfail",
           "torch.export._trace")
IMPORT_TIME = ("TORCH", "PYTORCH", "TRANSFORMERS", "HF_", "OMP_", "MKL_", "KMP_", "CUDA_")


def _read_at_import(env) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME)}


class Server:
    """The test side: starts the server, sends it one run at a time, falls back to a subprocess."""

    def __init__(self, env: dict[str, str]):
        self.env = env
        self.imported: dict[str, str] = {}
        self.proc: subprocess.Popen | None = None
        try:
            self.proc = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         env=env, text=True)
            self.proc.stdin.write("\n")  # wait for the preloads: the first run must not race them
            self.proc.stdin.flush()
            ready = json.loads(self.proc.stdout.readline() or "{}")
            self.imported = ready.get("imported", {})  # the server's variables after its imports
            if "imported" not in ready:
                self.close()
        except OSError:
            self.proc = None

    def unusable(self) -> str:
        """Why this run cannot be forked ('' when it can): the server is dead, or a variable its imports read is not
        as the run has it (as the server started, or as those imports left it: torch sets TORCHINDUCTOR_CACHE_DIR)."""
        if self.proc is None or self.proc.poll() is not None:
            return "the server is not running"
        start, run = _read_at_import(self.env), _read_at_import(os.environ)
        differ = sorted(k for k in {*start, *run, *self.imported} if run.get(k) not in (start.get(k),
                                                                                          self.imported.get(k)))
        return f"{', '.join(differ)} differ from the server's" if differ else ""

    def run(self, pytester: pytest.Pytester, *args: str) -> RunResult:
        why = self.unusable()
        if why:
            print(f"not forked from the prewarmed server ({why}): a subprocess")
            return pytester.runpytest_subprocess(*args)
        basetemp = make_numbered_dir(root=pytester.path, prefix="runpytest-", mode=0o700)
        cwd = os.getcwd()
        env = dict(os.environ)  # as pytester.popen: the working directory first on PYTHONPATH
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [cwd, env.get("PYTHONPATH", "")]))
        out, err = pytester.path / "stdout", pytester.path / "stderr"
        argv = [f"--basetemp={basetemp}", *map(os.fspath, args)]
        print("running (forked from the prewarmed server): pytest", *argv, "\n     in:", cwd)
        started = time.monotonic()
        self.proc.stdin.write(json.dumps({"argv": argv, "cwd": cwd, "env": env, "out": str(out),
                                          "err": str(err)}) + "\n")
        self.proc.stdin.flush()
        reply = self.proc.stdout.readline()
        if not reply:
            raise RuntimeError(f"the prewarmed pytest server died running: pytest {' '.join(argv)}")
        ret = json.loads(reply)["ret"]
        lines_out = out.read_text(encoding="utf8", errors="replace").splitlines()
        lines_err = err.read_text(encoding="utf8", errors="replace").splitlines()
        for line in lines_out:
            print(line)
        for line in lines_err:
            print(line, file=sys.stderr)
        try:
            ret = pytest.ExitCode(ret)
        except ValueError:
            pass
        return RunResult(ret, lines_out, lines_err, time.monotonic() - started)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


# --- the server ----------------------------------------------------------------------------------------------------
def _child(request: dict, base_path: list[str], zygote: str | None) -> int:
    """In the forked child: become `python -m pytest ARGV` run in CWD with ENV, then exit with its status; its isolated
    engines forked from the zygote at `zygote` where there is one."""
    if zygote:
        from pytest_kvcompile.run import isolation

        isolation._spawn = lambda: _forked_engine(zygote)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [request["cwd"], *extra, *base_path]
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, name in ((1, request["out"]), (2, request["err"])):
        target = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    sys.argv = [sys.executable, *request["argv"]]
    try:
        code = pytest.console_main()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001  (as the interpreter would: the traceback on stderr, status 1)
        import traceback

        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    return int(code)


def _serve() -> None:
    import gc
    import importlib

    requests = os.fdopen(os.dup(0), "r")
    replies = os.fdopen(os.dup(1), "w")
    start_path = {p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
    base_path = [p for p in sys.path[1:] if p not in start_path]  # without this script's folder and PYTHONPATH
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    # the distributions behind each import name, cached once for every run (importlib.metadata reads every installed
    # package's RECORD: 0.3 s of each run's first engine build)
    from pytest_kvcompile.contract import registry

    registry._distributions()
    # The preloaded modules' objects into the permanent generation: each run's gc.collect() (pytest's unraisable-
    # exception cleanup collects five times at exit) no longer walks torch's and transformers' millions of objects
    # (0.23 s a collection here, 1.2 s of each run's exit).
    gc.collect()
    gc.freeze()
    zygote = _start_zygote(requests.fileno(), replies.fileno())
    requests.readline()
    replies.write(json.dumps({"imported": _read_at_import(os.environ)}) + "\n")
    replies.flush()
    for line in requests:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            requests.close()
            replies.close()
            for fd in _ALIVE:
                os.close(fd)
            os._exit(_child(request, base_path, zygote))
        _, status = os.waitpid(pid, 0)
        replies.write(json.dumps({"ret": os.waitstatus_to_exitcode(status)}) + "\n")
        replies.flush()


# --- the zygote: isolated engines forked, not spawned --------------------------------------------------------------
class Forked:
    """The run's handle on an engine process forked by the zygote: what isolation uses of `subprocess.Popen` (pid,
    stdin, stdout, poll, wait; returncode as Popen's: -N for signal N). The zygote's waiter for the process sends its
    exit status over `conn` (a SOCK_SEQPACKET socket: one message each, its pid first)."""

    def __init__(self, conn: socket.socket, stdin, stdout) -> None:
        self.conn, self.stdin, self.stdout = conn, stdin, stdout
        self.pid = json.loads(conn.recv(4096))["pid"]
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self.conn], [], [], 0)[0]:
            self._status(self.conn.recv(4096))
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not select.select([self.conn], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(f"engine process {self.pid}", timeout)
            self._status(self.conn.recv(4096))
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def _status(self, message: bytes) -> None:
        self.returncode = json.loads(message)["returncode"] if message else -signal.SIGKILL  # the waiter itself died
        self.conn.close()


def _forked_engine(path: str):
    """isolation._spawn's stand-in in a forked run: (Forked, log) for an engine process forked by the zygote at
    `path`, in this run's working directory and environment."""
    log = tempfile.NamedTemporaryFile(prefix="kvcompile-engine-", suffix=".log", delete=False)
    stdin_r, stdin_w = os.pipe()
    stdout_r, stdout_w = os.pipe()
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    conn.connect(path)
    body = json.dumps({"cwd": os.getcwd(), "env": dict(os.environ)}).encode()
    conn.sendmsg([body], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [stdin_r, stdout_w,
                                                                                    log.fileno()]))])
    os.close(stdin_r)
    os.close(stdout_w)
    return Forked(conn, os.fdopen(stdin_w, "wb"), os.fdopen(stdout_r, "rb")), log


def _start_zygote(*server_pipes: int) -> str | None:
    """Fork the zygote (single-threaded, torch and transformers imported, no torch op run: safe to fork from); its
    socket's path, None where it could not start. It leaves when the server does (EOF on `alive`), and holds none of
    the server's pipes (`server_pipes`, stdin, stdout): the test side still sees the server's end."""
    path = os.path.join(tempfile.mkdtemp(prefix="kvcompile-zygote-"), "sock")
    try:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        listener.bind(path)
        listener.listen(16)
    except OSError:
        return None
    alive_r, alive_w = os.pipe()
    if os.fork() == 0:
        os.close(alive_w)
        null = os.open(os.devnull, os.O_RDWR)
        for fd in server_pipes:
            os.close(fd)
        os.dup2(null, 0)
        os.dup2(null, 1)
        os.close(null)
        try:
            _zygote(listener, alive_r)
        finally:
            os.unlink(path)
            os.rmdir(os.path.dirname(path))
            os._exit(0)
    os.close(alive_r)
    listener.close()
    os.set_inheritable(alive_w, False)
    _ALIVE.append(alive_w)  # held until the server exits; closed in each run it forks
    return path


_ALIVE: list[int] = []


def _zygote(listener: socket.socket, alive: int) -> None:
    """Per request: a waiter process, which forks the engine process and sends its pid, then its exit status."""
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the waiters are reaped by the kernel
    while True:
        ready = select.select([listener, alive], [], [])[0]
        if alive in ready:
            return
        conn, _ = listener.accept()
        fds = array.array("i")
        body, ancillary, _, _ = conn.recvmsg(1 << 20, socket.CMSG_SPACE(3 * fds.itemsize))
        for level, kind, data in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
        if os.fork() == 0:
            listener.close()
            os.close(alive)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            os._exit(_waiter(conn, json.loads(body), list(fds)))
        conn.close()
        for fd in fds:
            os.close(fd)


def _waiter(conn: socket.socket, request: dict, fds: list[int]) -> int:
    started_r, started_w = os.pipe()  # its pid is sent once it leads a session: a kill of its group reaches it
    pid = os.fork()
    if pid == 0:  # the engine process: as `python -m pytest_kvcompile.run.isolation` with these pipes and this log
        conn.close()
        os.setsid()
        os.close(started_r)
        os.close(started_w)
        for target, fd in zip((0, 1, 2), fds):
            os.dup2(fd, target)
        for fd in fds:
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        from pytest_kvcompile.run import isolation

        code = 0
        try:
            isolation._serve()
        except BaseException:  # noqa: BLE001  (as the interpreter would: the traceback in the log, status 1)
            import traceback

            traceback.print_exc()
            code = 1
        finally:
            sys.stderr.flush()
            os._exit(code)
    for fd in (*fds, started_w):
        os.close(fd)
    os.read(started_r, 1)  # EOF: the child closed its end after setsid (or died)
    conn.send(json.dumps({"pid": pid}).encode())
    _, status = os.waitpid(pid, 0)
    conn.send(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode())
    return 0


if __name__ == "__main__":
    _serve()
