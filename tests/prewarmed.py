"""Pytester runs forked from a process that has already imported torch and transformers (`run_pytest`).

A `python -m pytest` subprocess of the suites spends ~10 s of CPU importing torch, transformers, dynamo and inductor
before its first check; with ~300 such runs, those imports were most of the tests job. The server here (one per xdist
worker) imports them and the plugin once, then forks one child per run: the child is that run's `python -m pytest` (same
arguments, working directory, environment, sys.path, stdout/stderr files; atexit handlers run), its exit status reported
back as Popen would (-N for a signal). Forking is safe: the server runs no torch op, so no OpenMP pool or other thread
exists when it forks. A run whose environment differs in what those imports read at import time (TORCH*, PYTORCH*,
TRANSFORMERS*, HF_*, OMP_*, MKL_*) gets a real subprocess instead, and so does every run when the server cannot start.
Tests of what the plugin imports at startup keep `runpytest_subprocess`.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
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
def _child(request: dict, base_path: list[str]) -> int:
    """In the forked child: become `python -m pytest ARGV` run in CWD with ENV, then exit with its status."""
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
            os._exit(_child(request, base_path))
        _, status = os.waitpid(pid, 0)
        replies.write(json.dumps({"ret": os.waitstatus_to_exitcode(status)}) + "\n")
        replies.flush()


if __name__ == "__main__":
    _serve()
