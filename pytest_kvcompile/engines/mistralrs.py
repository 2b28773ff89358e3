"""mistral.rs (``mistralrs==0.9.5``, its Python bindings: a Rust engine on candle, paged attention) as the engine
``mistralrs``. mistralrs is imported only when an engine is built.

Rules:

- mistral.rs loads a Hugging Face directory with a ``tokenizer.json``, and reads transformers-4 config fields: the
  adapter builds a private copy per engine object (the safetensors linked, not copied) with a stand-in tokenizer
  (word-level, vocabulary ``<t0>`` ... ``<tN-1>`` in id order, whitespace split, byte-level decoder: mistral.rs
  accepts no other decoder here) and ``rope_theta`` written from transformers 5's ``rope_parameters`` (0.9.5 fails
  with "missing field `rope_theta`" otherwise). Whatever mistral.rs then refuses is ModelNotSupported with its reason.
- Prompts go in as the stand-in tokens separated by spaces, so the tokenizer maps them back to the same ids; the
  completion text (``<t191><t147>...``) is read back to ids. Greedy, exactly N tokens:
  ``CompletionRequest(prompt, max_tokens=N, temperature=0.0, ignore_eos=True)``.
- One prompt per call (``batching=False``): the Python API serves one request per call.
- float32 (``dtype=ModelDType.F32``); no ``score()``, no ``kv_cache_bytes`` (neither is exposed).
- ``isolated=True``: native code runs in a process of its own (a crash fails one test).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import weakref
from pathlib import Path

from pytest_kvcompile.contract.engine import Declaration, ModelNotSupported, ModelSpec
from pytest_kvcompile.contract.findings import KnownFinding
from pytest_kvcompile.engines.recipe import Recipe
from pytest_kvcompile.verdicts.failures import Kind

RECIPE = Recipe(packages=("mistralrs==0.9.5",), note="mistral.rs's CPU wheel (Python bindings).")
TOKEN = re.compile(r"<t(\d+)>")
_CLOSE_CALLS = ("mistral.rs 0.9.5 (F32 on CPU): its logits are not float32-exact; greedy choices whose oracle "
                "gap is under 0.01 flip (0.0018 on mistral-sw; 0.0067 and 0.0055 on llama), beyond float32's tie "
                "tolerance of 0.001 (docs/engines/mistralrs.md, finding 1)")
_CLOSE_CALL = 0.01  # the oracle gaps of the flips it covers are under this (beyond the tie tolerance, 0.001)
KNOWN_FINDINGS = (KnownFinding("test_token_identity", Kind.MISMATCH, _CLOSE_CALLS, models=("mistral-sw",),
                               prompts=("2W+3=19",), max_gap=_CLOSE_CALL),
                  KnownFinding("test_shared_prefixes", Kind.MISMATCH, _CLOSE_CALLS, models=("llama",),
                               max_gap=_CLOSE_CALL),
                  KnownFinding("test_full_hit", Kind.MISMATCH, _CLOSE_CALLS, models=("llama",),
                               max_gap=_CLOSE_CALL))


def stand_in_tokenizer(vocab_size: int, path: Path) -> None:
    """A tokenizer.json mapping ``<tI>`` to id I (whitespace split, byte-level decoder)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel(vocab={f"<t{i}>": i for i in range(vocab_size)}, unk_token="<t0>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(path))


class MistralRs:
    """mistral.rs ``Runner`` over the checkpoint (plain model), greedy completions."""

    kv_declaration = Declaration(
        devices=("cpu",),
        dtypes=("float32",),
        requires=(("mistralrs", RECIPE.packages[0]),),
        isolated=True,  # native code: a crash or hang fails one test, not the run (run/isolation.py)
        description="mistral.rs Runner (Rust, candle), plain model, float32, greedy completions",
        known_findings=KNOWN_FINDINGS,
    )

    def __init__(self, spec: ModelSpec):
        import mistralrs

        self.spec, self._mistralrs = spec, mistralrs
        self.dir = Path(tempfile.mkdtemp(prefix="kvcompile-mistralrs-"))
        weakref.finalize(self, shutil.rmtree, self.dir, True)
        for file in Path(spec.path).iterdir():
            if file.name != "config.json":
                os.symlink(file.resolve(), self.dir / file.name)
        config = json.loads((Path(spec.path) / "config.json").read_text())
        rope = config.get("rope_parameters") or {}
        if "rope_theta" not in config and "rope_theta" in rope:
            config["rope_theta"] = rope["rope_theta"]
        (self.dir / "config.json").write_text(json.dumps(config))
        stand_in_tokenizer(spec.vocab_size, self.dir / "tokenizer.json")
        try:
            self.runner = mistralrs.Runner(which=mistralrs.Which.Plain(model_id=str(self.dir),
                                                                       dtype=mistralrs.ModelDType.F32))
        except (ValueError, RuntimeError) as exc:
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ModelNotSupported(f"mistral.rs 0.9.5 refuses {spec.config.model_type}: {reason}") from None

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        if max_new_tokens == 0:
            return [[] for _ in prompts]
        out = []
        for prompt in prompts:
            request = self._mistralrs.CompletionRequest(
                model="default", prompt=" ".join(f"<t{i}>" for i in prompt), max_tokens=max_new_tokens,
                temperature=0.0, ignore_eos=True)
            text = self.runner.send_completion_request(request).choices[0].text
            out.append([int(i) for i in TOKEN.findall(text)])
        return out
