"""The results' typed records, their merge rules and JSON (the one place a results field's key is read or written).

A `Record` is a dataclass whose every field carries its merge rule beside it (`rule(...)`: how two records of the same
row combine, in words for the docs by `rule_name`), and is written and read field by field (`Record.to_json` /
`Record.from_json`: unknown keys ignored, missing optional ones defaulted, a wrong type a ValueError naming where).
"""

from __future__ import annotations

import copy
import dataclasses
from collections import Counter
from collections.abc import Callable
from dataclasses import field
from typing import Any


class MergeError(ValueError):
    """Two result sets cannot be merged (say why and where)."""


# --- merge rules ---------------------------------------------------------------------------------------------------
def described(words: str) -> Callable[[Callable[[Any, Any], Any]], Callable[[Any, Any], Any]]:
    """A merge rule, with how it merges in words (`rule_name`)."""
    def mark(merge: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
        merge.words = words  # type: ignore[attr-defined]
        return merge
    return mark


@described('sum')
def _add(a: Any, b: Any) -> Any:
    return a + b


@described('union, in order')
def _union(a: list, b: list) -> list:
    return list(dict.fromkeys(a + b))


@described('the first')
def _first(a: Any, b: Any) -> Any:
    return a


@described('the larger')
def _max(a: Any, b: Any) -> Any:
    return max(a, b)


@described('union by key (a sequence counts once)')
def _update(a: dict, b: dict) -> dict:
    """Keyed by sequence: one seen twice (repeated calls, two workers) counts once."""
    return {**a, **b}


@described('field by field')
def _records(a: Any, b: Any) -> Any:
    """Two records of one type, merged field by field (`Record.merge`)."""
    merged = copy.deepcopy(a)
    merged.merge(b)
    return merged


@described('by key, field by field')
def _keyed(a: dict, b: dict) -> dict:
    """Records keyed by name: the same key merged field by field, new keys kept."""
    merged = {k: copy.deepcopy(v) for k, v in a.items()}
    for key, found in b.items():
        merged[key] = _records(merged[key], found) if key in merged else copy.deepcopy(found)
    return merged


@described('append the new ones')
def _new_failures(a: list, b: list) -> list:
    return a + [f for f in b if f not in a]


@described('the first non-empty')
def _either(a: Any, b: Any) -> Any:
    return a or b


@described('the larger per key')
def _max_per_key(a: dict, b: dict) -> dict:
    return {k: max(a.get(k, 0), b.get(k, 0)) for k in {**a, **b}}


@described('sum per key')
def _count_per_key(a: dict, b: dict) -> dict:
    return dict(Counter(a) + Counter(b))


def rule(merge: Callable[[Any, Any], Any] | None, default: Any = None, *, factory: Callable[[], Any] | None = None,
         record: type | None = None, items: str = "", required: bool = False, types: tuple[type, ...] = ()) -> Any:
    """A `Record` field: `merge(a, b)` combines two records' values (None: a key field, equal in both; an optional
    field's None takes the other side); `record`: the field's Record type (with `items` "dict" or "list": a dict or
    list of them); `required`: a results file must have it; `types`: JSON types a plain value may have."""
    meta = {"merge": merge, "record": record, "items": items, "required": required, "types": types}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def rule_name(merge: Callable[[Any, Any], Any] | None) -> str:
    """How a rule merges, in words (the docs' schema tables): `described`'s words, or a key field's."""
    return "key (equal in both)" if merge is None else merge.words  # type: ignore[attr-defined]


def _is(value: Any, types: tuple[type, ...]) -> bool:
    if isinstance(value, bool):
        return bool in types
    return isinstance(value, types)


class Record:
    """A dataclass of the results: merged, written and read field by field from each field's `rule`."""

    def merge(self, other: Record) -> None:
        """Fold `other` (same type) into this record, each field by its rule."""
        for f in dataclasses.fields(self):
            merge, mine, theirs = f.metadata["merge"], getattr(self, f.name), getattr(other, f.name)
            if merge is None or theirs is None:
                continue
            setattr(self, f.name, theirs if mine is None else merge(mine, theirs))

    def to_json(self) -> dict[str, Any]:
        return {f.name: _encode(getattr(self, f.name), f) for f in dataclasses.fields(self)} | self.derived()

    def derived(self) -> dict[str, Any]:
        return {}

    @classmethod
    def from_json(cls, data: Any, where: str) -> Any:
        """The record from its JSON; ValueError names `where` and what is wrong. Unknown keys are ignored, missing
        optional ones take their defaults (older files)."""
        if not isinstance(data, dict):
            raise ValueError(f"{where}: expected an object, got {type(data).__name__}")
        found = {}
        for f in dataclasses.fields(cls):
            meta = f.metadata
            if f.name not in data:
                if meta["required"]:
                    raise ValueError(f"{where}: missing key {f.name!r}")
                continue
            value, at = data[f.name], f"{where}.{f.name}"
            if value is None:
                found[f.name] = None
            elif meta["record"] is not None:
                kind = meta["record"]
                if meta["items"] == "dict":
                    if not isinstance(value, dict):
                        raise ValueError(f"{at}: wrong type {type(value).__name__}")
                    found[f.name] = {k: kind.from_json(v, f"{at}[{k!r}]") for k, v in value.items()}
                elif meta["items"] == "list":
                    if not isinstance(value, list):
                        raise ValueError(f"{at}: wrong type {type(value).__name__}")
                    found[f.name] = [kind.from_json(v, f"{at}[{i}]") for i, v in enumerate(value)]
                else:
                    found[f.name] = kind.from_json(value, at)
            elif meta["types"] and not _is(value, meta["types"]):
                raise ValueError(f"{at}: wrong type {type(value).__name__}")
            else:
                found[f.name] = copy.deepcopy(value)
        return cls(**found)  # type: ignore[call-arg]


def _encode(value: Any, f: dataclasses.Field) -> Any:
    if value is None or f.metadata["record"] is None:
        return copy.deepcopy(value)
    if f.metadata["items"] == "dict":
        return {k: v.to_json() for k, v in value.items()}
    if f.metadata["items"] == "list":
        return [v.to_json() for v in value]
    return value.to_json()


INT, NUMBER, TEXT, LIST, DICT = (int,), (int, float), (str,), (list,), (dict,)

