"""The speculative-decoding contract: what a speculative engine declares (`Speculative`), the drafter it may take
from the caller (`Drafter`), and what it reports (``acceptance()``).

A speculative engine drafts tokens cheaply (a draft model, a drafter, n-gram lookup), checks them with the target in
one forward over its KV cache, keeps the longest prefix the target agrees with plus the target's own next token (the
bonus), and rolls back the K/V of the rejected ones. Greedy speculative decoding must equal plain greedy decoding
token for token, so every token is judged by the oracle as for any engine; suites/test_speculative.py chooses, per
position, whether the drafted token is the target's choice, so every acceptance length is exercised.

Methods of the engine object, as its `Speculative` declares:

- ``use_drafter(drafter)``: with `drafters` declared. `drafter` is a `Drafter` (``DRAFTER``), a draft checkpoint as a
  `ModelSpec` that the engine runs itself, with its own KV cache (``DRAFT_MODEL``), or None: the engine's own draft
  again. It holds for every later ``generate()``.
- ``acceptance()``: with ``acceptance=True``: per prompt of the last ``generate()``, one ``(drafted, accepted)`` pair
  per verify step, in order (accepted <= drafted <= k; a step that drafted nothing is ``(0, 0)``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

DRAFTER = "drafter"  # the engine takes a Drafter
DRAFT_MODEL = "draft_model"  # the engine takes a draft checkpoint (a ModelSpec) and runs it over its own cache
DRAFTER_KINDS = (DRAFTER, DRAFT_MODEL)


@runtime_checkable
class Drafter(Protocol):
    """Proposes draft tokens for one sequence."""

    def propose(self, context: Sequence[int], k: int) -> list[int]:
        """`k` token ids continuing `context`: the prompt followed by every token generated for it so far (the
        accepted drafts and the bonus tokens, never a rejected draft)."""
        ...


@dataclass(frozen=True)
class Speculative:
    """Declares a speculative engine (``Declaration(speculative=Speculative(k=4, ...))``).

    - `k`: tokens drafted per verify step at most.
    - `drafters`: what ``use_drafter()`` takes from the caller: ``"drafter"`` (a `Drafter`), ``"draft_model"`` (a
      draft checkpoint); empty: the engine drafts on its own only (prompt lookup).
    - `acceptance`: the engine has ``acceptance()``, so the suite checks how many drafted tokens each step kept and the
      reports show it; without it only the tokens are judged.
    - `lookup`: its own drafts come from n-gram lookup in the sequence so far (prompt lookup, vLLM's n-gram): the
      suite builds prompts whose lookup proposes a continuation the target accepts for exactly j tokens.
    """

    k: int
    drafters: tuple[str, ...] = (DRAFTER,)
    acceptance: bool = False
    lookup: bool = False

    def __post_init__(self) -> None:
        usage = 'e.g. Speculative(k=4, drafters=("drafter", "draft_model"), acceptance=True)'
        if type(self.k) is not int or self.k < 1:
            raise ValueError(f"Speculative(k={self.k!r}): k must be an int >= 1 (tokens drafted per step); {usage}")
        if not isinstance(self.drafters, tuple) or any(d not in DRAFTER_KINDS for d in self.drafters):
            kinds = ", ".join(map(repr, DRAFTER_KINDS))
            raise ValueError(f"Speculative(drafters={self.drafters!r}): a tuple of {kinds} (what use_drafter() "
                             f"takes), or () for none; {usage}")
        for name in ("acceptance", "lookup"):
            if type(getattr(self, name)) is not bool:
                raise ValueError(f"Speculative({name}={getattr(self, name)!r}) must be True or False; {usage}")

    def __str__(self) -> str:
        drafters = ",".join(self.drafters) or "own only"
        return (f"Speculative(k={self.k}, drafters={drafters}{', acceptance' if self.acceptance else ''}"
                f"{', lookup' if self.lookup else ''})")
