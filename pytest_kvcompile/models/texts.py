"""Prompts a person would send: prose, code and a chat turn, tokenized by the model's own tokenizer.

Where the checkpoint has a tokenizer (the trained zoo model; a --kv-model directory with its tokenizer files), the
prompt set gets these beside the id prompts (prompts.py): the prose and the code cut to the lengths the suites use
(their first N tokens, the name saying N: ``prose250``, whose decode crosses 256 positions, and ``code48``), the chat
turn whole through the tokenizer's chat template where it has one (``chat48``: its length, which another tokenizer or
template changes). Text prompts come first in the prompt set, so a suite picking its prompt of a length from a map by
length keeps the id prompt (the text ones are checked as prompts of their own). Random-weight models have no
tokenizer: their prompts stay ids. A failure on a model with a tokenizer decodes the tokens it names (`Decoder`).
The smoke profile's prompts are id prompts only (config/profiles.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from pathlib import Path

from pytest_kvcompile.models.prompts import LONG, PAST_256, Prompt

PROSE = """\
The lighthouse keeper had kept a log for thirty-one years, and in all that time he had never missed an entry. Each
morning he wrote down the wind, the height of the swell, the ships that passed and the birds that rested on the
rail. Most days the entries were short. A grey sky, a north wind, two fishing boats going out before dawn and coming
back heavy in the afternoon. On other days he filled a whole page, because a storm had come in from the west and the
lamp had to be watched through the night, or because a stranger had rowed across from the mainland to ask about the
old wreck on the reef.

When the lamp was automated, the company sent a young engineer to install the new equipment. She was polite and
quick, and she asked him whether he would miss the work. He said he would miss the log more than the lamp. The lamp
had only ever needed oil and patience; the log had needed attention, which is a different thing. She thought about
that on the boat back, and years later, when she ran a team that monitored power stations from a control room in the
city, she made everyone keep a written log of what they noticed, even when the screens said everything was fine.

Her colleagues thought it was old-fashioned. Then one winter a turbine began to vibrate a little more each week, too
slowly for any alarm to trigger, and it was a line in the handwritten log, repeated and slightly changed each
Monday, that made someone look closer before the bearing failed.
"""

CODE = '''\
import heapq
from dataclasses import dataclass, field


@dataclass(order=True)
class Task:
    priority: int
    name: str = field(compare=False)
    attempts: int = field(default=0, compare=False)


class Scheduler:
    """Run tasks by priority; a failed task is retried up to `retries` times with a lower priority."""

    def __init__(self, retries: int = 3) -> None:
        self.retries = retries
        self.queue: list[Task] = []
        self.done: list[str] = []

    def submit(self, name: str, priority: int = 0) -> None:
        heapq.heappush(self.queue, Task(priority, name))

    def run(self, work) -> list[str]:
        while self.queue:
            task = heapq.heappop(self.queue)
            try:
                work(task.name)
            except Exception as exc:  # retried below, or given up
                task.attempts += 1
                if task.attempts <= self.retries:
                    task.priority += 10
                    heapq.heappush(self.queue, task)
                else:
                    print(f"giving up on {task.name}: {exc}")
                continue
            self.done.append(task.name)
        return self.done


def parse_config(text: str) -> dict[str, str]:
    """Lines of `key = value`; blank lines and lines starting with # are skipped."""
    config = {}
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if "=" not in line:
            raise ValueError(f"line {number}: expected key = value, got {line!r}")
        key, value = (part.strip() for part in line.split("=", 1))
        config[key] = value
    return config
'''

CHAT = "What is the capital of France? Answer in one sentence, then name one museum there."


def has_tokenizer(path: Path | None) -> bool:
    """Whether a checkpoint directory holds a tokenizer transformers can load."""
    return path is not None and any((path / f).is_file() for f in ("tokenizer.json", "tokenizer.model"))


@functools.cache
def _tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def text_prompts(path: Path, vocab_size: int, limit: int | None = None) -> list[Prompt]:
    """The text prompts of the checkpoint at `path` (module docstring), each within `limit` tokens (the longest prompt
    the model's positions allow; None: no limit) and the model's vocabulary; none where a text is shorter than its
    length, and none at all where the tokenizer does not load (the id prompts stay)."""
    try:
        tokenizer = _tokenizer(path)
        found = []
        for kind, text, lengths in (("prose", PROSE, (PAST_256,)), ("code", CODE, (LONG,))):
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            found += [Prompt(f"{kind}{n}", tuple(int(t) for t in ids[:n])) for n in lengths if n <= len(ids)]
        if getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template([{"role": "user", "content": CHAT}], add_generation_prompt=True,
                                                tokenize=True, return_dict=True)["input_ids"]
            found.append(Prompt(f"chat{len(ids)}", tuple(int(t) for t in ids)))
    except Exception:  # a tokenizer transformers cannot load or run here: the run keeps its id prompts
        return []
    return [p for p in found if (limit is None or len(p) <= limit) and max(p.ids) < vocab_size]


class Decoder:
    """Token ids as the model's tokenizer reads them, for failure messages (expected ' Paris', got ' Lyon')."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __call__(self, ids: Sequence[int]) -> str:
        try:
            return repr(_tokenizer(self.path).decode([int(t) for t in ids]))
        except Exception as exc:  # never in the way of the failure it describes
            return f"(not decoded: {type(exc).__name__})"


def decoder(path: Path | None) -> Callable[[Sequence[int]], str] | None:
    """A `Decoder` for the checkpoint at `path`, None where it has no tokenizer."""
    return Decoder(path) if has_tokenizer(path) else None
