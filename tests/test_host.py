"""Where an engine runs is its host (pytest_kvcompile/run/host.py): one interface, an in-process and a subprocess
implementation, and a server's (`Server`: an engine over HTTP). The rest of the package and the suites use the
host's methods and never ask which host an engine has:
`no_isolation_branch_outside_the_hosts` keeps it that way. The hosts' own behaviour, with fakes (no process started);
tests/test_isolation.py and tests/test_crash_safety.py run real isolated engines."""

from __future__ import annotations

import ast
import time
import types
from pathlib import Path

import pytest

from pytest_kvcompile.errors import CallTimeout, EngineProcessDied
from pytest_kvcompile.models.prompts import Prompt
from pytest_kvcompile.recompiles.recorder import CompileEvent
from pytest_kvcompile.run import host as hosts
from pytest_kvcompile.run.harness import EngineUnderTest

ROOT = Path(__file__).resolve().parents[1]
HOSTS = {"pytest_kvcompile/run/host.py", "pytest_kvcompile/run/isolation.py"}  # the only ones that know
#: what only the subprocess host may reach through its proxy (run/isolation.py: IsolatedEngine)
PROXY_ONLY = {"observed", "last_ms", "dead", "proc", "remote"}


def _sources() -> list[tuple[str, ast.AST]]:
    files = [*sorted((ROOT / "pytest_kvcompile").rglob("*.py")), *sorted((ROOT / "suites").rglob("*.py"))]
    return [(str(path.relative_to(ROOT)), ast.parse(path.read_text())) for path in files
            if str(path.relative_to(ROOT)) not in HOSTS]


def _isolation_uses(where: str, tree: ast.AST) -> list[str]:
    parents = {id(child): node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found = []
    for node in ast.walk(tree):
        at = f"{where}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Name) and node.id == "IsolatedEngine" or (
                isinstance(node, ast.alias) and node.name.endswith(("IsolatedEngine", "run.isolation"))) or (
                isinstance(node, ast.ImportFrom) and node.module == "pytest_kvcompile.run.isolation"):
            found.append(f"{at}: {ast.unparse(node) if not isinstance(node, ast.alias) else node.name} "
                         "(only run/host.py builds or wraps an isolated engine)")
        elif isinstance(node, ast.Attribute) and node.attr == "isolated":
            parent = parents.get(id(node))
            called = isinstance(parent, ast.Call) and parent.func is node  # Settings.isolated(name, ...): the rule
            declared = ast.unparse(node.value).endswith(("declaration", "decl"))  # Declaration.isolated
            public = where == "pytest_kvcompile/run/harness.py" and ast.unparse(node) == "self.host.isolated"
            if not (called or declared or public):
                found.append(f"{at}: {ast.unparse(node)} (ask the host for what differs, not whether it is isolated)")
        elif isinstance(node, ast.Attribute) and node.attr in PROXY_ONLY and isinstance(node.value, ast.Attribute) \
                and node.value.attr == "engine":
            found.append(f"{at}: {ast.unparse(node)} (the isolated engine's proxy: only its host reads it)")
        elif isinstance(node, ast.Attribute) and node.attr in ("observed", "last_ms"):
            found.append(f"{at}: {ast.unparse(node)} (the isolated engine's proxy: only its host reads it)")
        elif isinstance(node, ast.Name) and node.id == "ServerEngine" and not where.startswith(
                "pytest_kvcompile/engines/server"):
            found.append(f"{at}: ServerEngine (a server is its host: run/host.py, Server; ask the host what differs)")
        elif isinstance(node, ast.Attribute) and node.attr == "limits" and ast.unparse(node.value).endswith("engine"):
            found.append(f"{at}: {ast.unparse(node)} (a server's limits: ask its host, host.max_concurrency)")
        elif isinstance(node, ast.Call) and ast.unparse(node.func) in ("getattr", "hasattr") and len(node.args) > 1 \
                and isinstance(node.args[1], ast.Constant) and node.args[1].value in PROXY_ONLY:
            found.append(f"{at}: {ast.unparse(node)} (duck typing on the isolated engine's proxy: use the host)")
    return found


def test_no_isolation_branch_outside_the_hosts():
    found = [use for where, tree in _sources() for use in _isolation_uses(where, tree)]
    assert not found, "outside run/host.py and run/isolation.py:\n" + "\n".join(found)


def test_the_rule_catches_a_branch():
    code = ("if eut.isolated:\n    x = eut.engine.last_ms\nremote = getattr(eut.engine, 'observed', None)\n"
            "ok = settings.isolated('e', ref.declaration.isolated, True)\n"
            "served = isinstance(eut.engine, ServerEngine)\ncap = eut.engine.limits\n")
    found = _isolation_uses("x.py", ast.parse(code))
    assert sorted(line.split(" ")[0] for line in found) == ["x.py:1:", "x.py:2:", "x.py:3:", "x.py:5:",
                                                            "x.py:6:"], found


# --- the two hosts, with fakes ----------------------------------------------------------------------------------------
class Proxy:
    """Stands for run/isolation.py's IsolatedEngine: what the subprocess host reads of it."""

    def __init__(self, observed=((), 0, 0, ()), last_ms=None):
        self.observed, self.last_ms, self.dead, self.asked, self.closed = observed, last_ms, None, [], 0
        self.build_compiles, self.build_captures = (), ()
        self.proc = types.SimpleNamespace(pid=4242)

    def generate(self, prompts, n):
        return [[1] * n for _ in prompts]

    def concurrently(self, calls, n, timeout):  # the round answered in the engine's process
        return [[[7] * n for _ in call] for call in calls]

    def remote(self, what):
        if self.dead:
            raise EngineProcessDied(self.dead)
        self.asked.append(what)
        return {"live": 123}.get(what)

    def close(self):
        self.closed += 1


def _event(name: str) -> CompileEvent:
    return CompileEvent(frame=f"{name} (x.py:1)", compile_id="0/0", is_recompile=False)


def _eut(host: hosts.Host) -> EngineUnderTest:
    ref = types.SimpleNamespace(name="e", declaration=types.SimpleNamespace(bounds=None))
    spec = types.SimpleNamespace(name="m", device="cpu", vocab_size=10)
    return EngineUnderTest(ref, spec, host.engine, 2, 0.0, None, host=host)


def test_in_process_host():
    engine = types.SimpleNamespace(generate=lambda prompts, n: [[1] * n for _ in prompts])
    host = hosts.host_of(engine)
    assert isinstance(host, hosts.InProcess) and host.engine is engine and not host.isolated
    assert (host.where, host.dead, host.unreachable, host.cuda_here) == ("", None, None, True)
    assert host.timed(lambda: None, lambda call: 7.0) == 7.0  # the caller's timer
    assert host.concurrently([[[1, 2]]], 2, 5.0) is None  # the caller releases a round from its own threads
    with pytest.raises(CallTimeout):  # SIGALRM in the pytest process
        with host.bounded(0.2):
            time.sleep(5)
    host.freeze()
    try:
        assert host.live_tensor_bytes() == 0
    finally:
        host.unfreeze()
    eut = _eut(host)
    assert eut.generate([Prompt("two", [1, 2])]) == [[1, 1]]
    assert eut.history[-1].compiles == () and not eut.isolated


def test_subprocess_host_merges_what_dynamo_did_in_the_engine_process():
    proxy = Proxy(observed=((_event("forward"),), 3, 1, ("graph",)), last_ms=12.5)
    host = hosts.Subprocess(proxy)
    assert host.isolated and not host.cuda_here and host.where == " in process 4242"
    assert host.unreachable == "the engine runs isolated"
    assert host.concurrently([[[1, 2]]], 2, 5.0) == [[[7, 7]]]  # its process releases a round itself
    assert host.timed(lambda: None, lambda call: 999.0) == 12.5  # the child's own timing, not the pipe's
    eut = _eut(host)
    eut.generate([Prompt("two", [1, 2])])
    call = eut.history[-1]
    assert [e.frame for e in call.compiles] == ["forward (x.py:1)"]
    assert (call.guard_hits, call.eager_runs, call.captures) == (3, 1, ("graph",)) and eut.isolated
    eut.reset_dynamo()
    assert eut.held() is None and proxy.asked == ["reset", "held"]
    with eut.tensor_census() as live:
        assert live() == 123
    assert proxy.asked[2:] == ["freeze", "live", "unfreeze"]


def test_a_dead_engine_process_fails_the_test_and_marks_the_engine_broken():
    proxy = Proxy()
    eut = _eut(hosts.Subprocess(proxy))
    with eut.tensor_census():
        proxy.dead = "engine 'e' on model 'm' crashed: its process (pid 4242) died of SIGSEGV"
    assert "unfreeze" not in proxy.asked  # nothing is sent to a dead process
    with pytest.raises(pytest.fail.Exception, match="died of SIGSEGV"):
        eut.held()
    assert eut.broken == proxy.dead and eut.host.dead == proxy.dead
    eut.host.close()
    assert proxy.closed == 1
