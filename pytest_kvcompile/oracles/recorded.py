"""References recorded once and reused (issue 54): a folder holding the oracle's store (its greedy references, the
truth along the engines' tokens, the 16-bit calibration) and, per model, what it was recorded for (`Recorded`).

A run with ``--kv-record-references=DIR`` keeps its oracle store in DIR and writes one `Recorded` per model it judged
(a nightly job, a bigger machine); a run with ``--kv-references=DIR`` judges from it, so a pull request's run spends its
time in the engine: the oracle loads its model only where the engine's tokens leave the recorded ones. The store's keys
are made of the same facts (oracles/store.py: `_fingerprint`), so a folder recorded for another checkpoint, dtype,
device, version of the suite's code (its prompts and rules) or of torch and transformers would judge nothing from the
recording: that is a usage error at start-up naming what differs (`References.problem`), never a silent recompute.
llama.cpp's ``--save-all-logits`` / ``--kl-divergence-base`` is the anchor.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

KIND = "pytest-kvcompile-references"
FOLDER = "recorded"  # DIR/recorded/<model>-<dtype>-<device>.json, one per model recorded


@dataclass(frozen=True)
class Recorded:
    """What the references of one model were recorded for: the facts the oracle store's keys are made of."""

    model: str
    checkpoint: str  # sha256 of the checkpoint's files (`content_digest`): the same wherever it is copied
    dtype: str  # the run's
    device: str  # where the oracle ran (--kv-oracle-device, else --kv-device)
    code: str  # the suite's models and oracles code: its prompts and rules (models/zoo.py: code_hash)
    torch: str
    transformers: str

    def differences(self, now: Recorded) -> list[str]:
        """Each fact of `now` (this run's) that is not the recorded one, in words."""
        words = {"checkpoint": "the checkpoint's content (sha256 of its files)", "dtype": "--kv-dtype",
                 "device": "the oracle's device", "code": "pytest-kvcompile's prompts and rules (its code)",
                 "torch": "torch", "transformers": "transformers"}
        return [f"{words[f.name]}: recorded {getattr(self, f.name)}, this run {getattr(now, f.name)}"
                for f in dataclasses.fields(self)
                if f.name != "model" and getattr(self, f.name) != getattr(now, f.name)]


class References:
    """A folder of recorded references: its oracle store (`store`) and what it was recorded for (`entries`)."""

    def __init__(self, root: Path):
        self.root = Path(root).expanduser()

    @property
    def store(self) -> Path:
        return self.root / "oracle"

    def entries(self) -> list[Recorded]:
        found = []
        for path in sorted((self.root / FOLDER).glob("*.json")):
            with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
                data = json.loads(path.read_text())
                if data.get("kind") == KIND:
                    found.append(Recorded(**{f.name: str(data[f.name]) for f in dataclasses.fields(Recorded)}))
        return found

    def record(self, entry: Recorded) -> None:
        """Write (or replace) what `entry`'s model was recorded for; atomic, so processes of one run may race."""
        folder = self.root / FOLDER
        folder.mkdir(parents=True, exist_ok=True)
        name = hashlib.sha256(f"{entry.model}\0{entry.dtype}\0{entry.device}".encode()).hexdigest()[:16]
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-")
        with os.fdopen(fd, "w") as out:
            json.dump({"kind": KIND, **dataclasses.asdict(entry)}, out, indent=1)
        os.replace(tmp, folder / f"{name}.json")

    def problem(self, now: Recorded, flag: str, record_flag: str) -> str | None:
        """Why this folder cannot judge `now`'s model (None: it can): nothing recorded, no entry for the model, or
        what differs from the entry closest to it."""
        entries = self.entries()
        if not entries:
            return (f"{flag}={self.root}: no references recorded there (no {FOLDER}/*.json); record them first with "
                    f"the same options and {record_flag}={self.root}")
        mine = [e for e in entries if e.model == now.model]
        if not mine:
            held = ", ".join(sorted({f"'{e.model}' ({e.dtype})" for e in entries}))
            return (f"{flag}={self.root}: no references recorded for model '{now.model}' (it holds {held}); record "
                    f"them with {record_flag}={self.root}, or leave the model out of this run")
        if any(not e.differences(now) for e in mine):
            return None
        closest = min(mine, key=lambda e: len(e.differences(now)))
        return (f"{flag}={self.root}: the references of model '{now.model}' were recorded for another run, so none "
                f"would judge this one: {'; '.join(closest.differences(now))}. Record them again with this run's "
                f"options and {record_flag}={self.root} (or run without {flag})")


def content_digest(path: Path, memo: Path | None = None) -> str:
    """sha256 over a checkpoint directory's files (names and bytes). Each file's own digest is kept under `memo` by
    its resolved path, size and modification time: a checkpoint is read once (a few seconds a GB), not every run."""
    total = hashlib.sha256()
    for file in sorted(p for p in path.iterdir() if p.is_file()):
        stat = file.stat()
        seen = f"{file.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}"
        known = memo / hashlib.sha256(seen.encode()).hexdigest()[:32] if memo is not None else None
        digest = known.read_text().strip() if known is not None and known.is_file() else ""
        if len(digest) != 64:
            one = hashlib.sha256()
            with file.open("rb") as source:
                for chunk in iter(lambda: source.read(1 << 24), b""):
                    one.update(chunk)
            digest = one.hexdigest()
            if known is not None:
                with contextlib.suppress(OSError):
                    known.parent.mkdir(parents=True, exist_ok=True)
                    fd, tmp = tempfile.mkstemp(dir=known.parent, prefix=".tmp-")
                    with os.fdopen(fd, "w") as out:
                        out.write(digest)
                    os.replace(tmp, known)
        total.update(f"{file.name}\0{digest}\0".encode())
    return total.hexdigest()
