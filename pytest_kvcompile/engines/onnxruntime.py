"""ONNX Runtime as an engine: ``onnxruntime`` (onnxruntime-genai 0.18.0 on onnxruntime 1.31.1), imported only
when the engine is built.

The checkpoint is exported to ONNX by onnxruntime-genai's Model Builder
(``python -m onnxruntime_genai.models.builder -i CKPT -o OUT -p fp32 -e cpu``: a decoder with
``past_key_values.N.key/value`` inputs and ``present.N.key/value`` outputs, GroupQueryAttention), once per
checkpoint, cached beside the zoo (``export_dir``). Generation is genai's own loop: ``og.Generator`` with greedy
search, ``past_present_share_buffer`` (one KV buffer of ``max_length`` positions per layer, written in place),
prompts as token ids (``append_tokens``), exactly ``max_new_tokens`` ``generate_next_token`` steps.

Why not optimum: ``optimum-onnx`` 0.1.0 (the newest) pins ``transformers<4.58`` and does not import on
transformers 5 (``optimum.exporters.onnx`` imports ``transformers.utils.generic._CAN_RECORD_REGISTRY`` and
``transformers.modeling_utils.get_parameter_dtype``, both gone), and this project needs transformers>=5.2.

The zoo has no tokenizer and no special tokens; the Model Builder needs one (it reads its EOS/PAD ids) and
genai needs an EOS and a PAD id inside the vocabulary (0.18 refuses any other). The staging directory holds a
word-level tokenizer (``<0>`` ... ``<255>`` as ids 0..255) with EOS = PAD = ``vocab_size - 1`` (``SPECIAL_ID``).
genai always stops a sequence at EOS (``min_length`` masks the EOS logit instead, which changes greedy tokens);
a single prompt that reaches it is resumed with ``append_tokens([eos])`` (genai's multi-turn call: the token
runs through the same model and cache), a batch row cannot be resumed (``RuntimeError``; no suite batch hits it on
llama).
genai finds each row's prompt length by trailing PAD ids (right padding), so a prompt ending in
``SPECIAL_ID`` is read shorter (docs/engines/onnxruntime.md).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from pytest_kvcompile.contract.engine import Declaration, ModelNotSupported, ModelSpec
from pytest_kvcompile.contract.findings import EVERY_CHECK, KnownFinding
from pytest_kvcompile.engines.recipe import Recipe
from pytest_kvcompile.verdicts.failures import Kind

RECIPE = Recipe(
    packages=("onnxruntime-genai==0.18.0", "onnxruntime==1.31.1", "onnx==1.23.2", "onnx-ir==1.1.0"),
    note="onnxruntime-genai 0.18.0 (its Model Builder exports, its Generator decodes) needs onnx and onnx-ir "
    "to export, which it does not declare; optimum-onnx 0.1.0 pins transformers<4.58 and does not import on "
    "transformers 5, so it is not used. docs/engines/onnxruntime.md",
)
REQUIRES = RECIPE.requirement("onnxruntime_genai")
GENAI_VERSION = "0.18.0"

#: model_type -> HF architecture, for the architectures the Model Builder 0.18.0 maps (builder.py create_model)
#: that the zoo uses.
SUPPORTED = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}


def special_id(vocab_size: int) -> int:
    """EOS and PAD of the exported model: the last vocabulary id (genai needs both inside the vocabulary)."""
    return vocab_size - 1


def check_supported(config) -> None:
    """ModelNotSupported, with the reason, for a model the Model Builder 0.18.0 cannot export."""
    kind = config.model_type
    if kind in SUPPORTED:
        rope = getattr(config, "rope_parameters", None) or {}
        if "rope_type" not in rope:  # transformers 5: one RoPE per layer type (Gemma3)
            raise ModelNotSupported(
                f"onnxruntime-genai {GENAI_VERSION}'s Model Builder cannot read this {kind} config: it takes "
                "config.rope_parameters['rope_type'] (builders/base.py make_rope_init), but transformers 5 gives "
                f"one RoPE per layer type (rope_parameters keys {sorted(rope)}), so the export fails with "
                "KeyError: 'rope_type'")
        return
    if kind in ("gemma4_text", "gemma3n_text"):
        raise ModelNotSupported(
            f"onnxruntime-genai {GENAI_VERSION}'s Model Builder has no text-only model_type {kind!r} (it maps "
            f"Gemma4ForConditionalGeneration only, and no Gemma3n): KV sharing "
            f"(num_kv_shared_layers={getattr(config, 'num_kv_shared_layers', None)}) and per-layer inputs "
            "cannot be exported from this checkpoint")
    raise ModelNotSupported(f"onnxruntime-genai {GENAI_VERSION}'s Model Builder has no model_type {kind!r}; "
                            f"the zoo models it exports: {', '.join(SUPPORTED.values())}")


def _architecture(spec: ModelSpec) -> str:
    import json

    return json.loads((spec.path / "config.json").read_text())["architectures"][0]


def _stage(spec: ModelSpec, staging: Path) -> None:
    """The builder's input: the checkpoint's files linked, plus a word-level tokenizer (ids as tokens)
    whose EOS and PAD are `special_id` (the builder reads them from the tokenizer)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    staging.mkdir(parents=True)
    for file in spec.path.iterdir():
        os.symlink(file.resolve(), staging / file.name)
    vocab = {f"<{i}>": i for i in range(spec.vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<0>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    special = f"<{special_id(spec.vocab_size)}>"
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=special, pad_token=special).save_pretrained(staging)


def export_dir(spec: ModelSpec) -> Path:
    """Where `spec`'s export is cached: beside the zoo checkpoint, named by checkpoint, genai version, dtype."""
    return spec.path.parent / "onnxruntime-genai" / f"{spec.path.name}-og{GENAI_VERSION}-fp32"


def export(spec: ModelSpec) -> Path:
    """The Model Builder's fp32 CPU export of `spec` (built once; atomic rename, as zoo.checkpoint)."""
    final = export_dir(spec)
    if (final / "genai_config.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        _stage(spec, tmp / "hf")
        command = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(tmp / "hf"), "-o",
                   str(tmp / "onnx"), "-p", "fp32", "-e", "cpu", "-c", str(tmp / "cache")]
        done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        if done.returncode != 0 or not (tmp / "onnx" / "genai_config.json").is_file():
            tail = "\n".join((done.stdout + done.stderr).splitlines()[-15:])
            raise RuntimeError(f"onnxruntime-genai Model Builder failed for {spec.name} (exit {done.returncode}):\n"
                               f"{' '.join(command)}\n{tail}")
        try:
            os.rename(tmp / "onnx", final)
        except OSError:
            if not (final / "genai_config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _generator(og, model, length: int, batch_size: int = 1):
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=length, do_sample=False, batch_size=batch_size)
    return og.Generator(model, params)


_MISTRAL_WINDOW = (
    f"onnxruntime-genai {GENAI_VERSION} Model Builder: a config without layer_types (Mistral) is exported with every "
    "layer full_attention (GroupQueryAttention local_window_size=-1), so the sliding window is ignored (tokens differ "
    "once a sequence passes W); yet genai_config gets a sliding_window block (window_size=W, layers=[]), and the "
    "runtime's cache then breaks GroupQueryAttention on longer sequences (total_sequence_length / present shape "
    "errors) (docs/engines/onnxruntime.md)")
_FINDINGS: tuple[KnownFinding, ...] = (  # every check on mistral-sw: its tokens diverge, or the runtime raises
    KnownFinding(EVERY_CHECK, Kind.MISMATCH, _MISTRAL_WINDOW, models=("mistral-sw",)),
    # GroupQueryAttention's shape errors: C++ errors, which onnxruntime_genai raises as RuntimeError
    KnownFinding(EVERY_CHECK, Kind.OTHER, _MISTRAL_WINDOW, models=("mistral-sw",), raised="RuntimeError"),
)


class ORTCausalLM:
    """onnxruntime-genai's Generator (greedy) over the Model Builder's fp32 ONNX export, CPU."""

    kv_declaration = Declaration(
        batching=True,
        scoring=True,
        devices=("cpu",),
        dtypes=("float32",),
        requires=REQUIRES,
        isolated=True,  # a native runtime: an abort (import order, a bad shape in GroupQueryAttention) fails one test
        description=f"onnxruntime-genai {GENAI_VERSION} Generator over its Model Builder fp32 export "
        "(GroupQueryAttention, shared past/present buffer), onnxruntime 1.31.1 CPU",
        known_findings=_FINDINGS,
    )

    def __init__(self, spec: ModelSpec):
        if spec.dtype != torch.float32 or torch.device(spec.device).type != "cpu":
            raise ModelNotSupported("this adapter exports fp32 for the CPU execution provider only")
        check_supported(spec.config)
        if _architecture(spec) not in SUPPORTED.values():
            raise ModelNotSupported(f"onnxruntime-genai {GENAI_VERSION}'s Model Builder has no {_architecture(spec)}")
        import onnxruntime  # noqa: F401  genai loads the onnxruntime library this package ships
        import onnxruntime_genai as og

        self.og = og
        self.spec = spec
        self.path = export(spec)
        self.model = og.Model(str(self.path))
        self.special = special_id(spec.vocab_size)

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        import numpy as np

        if max_new_tokens == 0:
            return [[] for _ in prompts]
        width = max(map(len, prompts))
        ids = np.array([list(p) + [self.special] * (width - len(p)) for p in prompts], dtype=np.int32)
        generator = _generator(self.og, self.model, width + max_new_tokens, len(prompts))
        generator.append_tokens(ids)
        out: list[list[int]] = [[] for _ in prompts]
        for step in range(max_new_tokens):
            if generator.is_done():  # one sequence that ended at EOS: feed it back (genai's multi-turn append), go on
                generator.append_tokens(np.array([[out[0][-1]]], dtype=np.int32))
            generator.generate_next_token()
            tokens = generator.get_next_tokens()
            for row, token in zip(out, tokens):
                row.append(int(token))
            stopped = [i for i, row in enumerate(out) if row[-1] == self.special]
            if len(prompts) > 1 and stopped and step < max_new_tokens - 1:
                raise RuntimeError(
                    f"onnxruntime-genai {GENAI_VERSION}: batch row(s) {stopped} stopped at EOS (id {self.special}) "
                    f"after {step + 1} of {max_new_tokens} tokens: genai ends a sequence at the model's eos_token_id "
                    "and fills the row with PAD from then on; a finished row of a batch cannot be resumed")
        return out

    def score(self, prompt: list[int], continuation: list[int]) -> torch.Tensor:
        """Logits [len(continuation), vocab]: the prompt appended (prefill), then each continuation token
        appended in turn, reading genai's last-position logits after each; row i predicts continuation[i]."""
        import numpy as np

        if not continuation:
            return torch.empty(0, self.spec.vocab_size)
        generator = _generator(self.og, self.model, len(prompt) + len(continuation))
        rows = []
        for i in range(len(continuation)):
            tokens = prompt if i == 0 else [continuation[i - 1]]
            generator.append_tokens(np.array([tokens], dtype=np.int32))
            rows.append(torch.from_numpy(np.array(generator.get_logits(), dtype=np.float32))
                        .reshape(-1)[-self.spec.vocab_size:])
        return torch.stack(rows)
