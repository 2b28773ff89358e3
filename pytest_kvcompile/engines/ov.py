"""OpenVINO through optimum-intel (``OVModelForCausalLM``, a stateful model: the KV cache lives inside the runtime's
state, not in Python) as the engine ``openvino``. optimum-intel and openvino are imported only when an engine is built.

Rules:

- ``OVModelForCausalLM.from_pretrained(checkpoint, export=True, compile=True, ov_config=OV_CONFIG)``:
  optimum-intel exports the transformers model to OpenVINO IR (stateful, its default) and compiles it for
  the CPU. The precision hint keeps OpenVINO's CPU plugin in float32: on a CPU with bfloat16 units it would otherwise
  run in bfloat16 (its default there), which a float32 run would then judge. Whatever the export refuses (a model its
  transformers range excludes, a config it cannot load) is ModelNotSupported with its reason.
- ``KV_CACHE_PRECISION: f16``: what the CPU plugin compiles with the f32 hint by default (read back from the
  compiled model: ``float16``), made explicit so the declaration holds on every CPU: ``kv_cache_dtype="float16"``,
  and the token checks allow the measured noise of a float16 KV cache (docs/engines/openvino.md, finding 1).
- ``generate`` is transformers' ``GenerationMixin.generate`` over the OpenVINO model: left-padded batch with an
  attention mask, ``GenerationConfig(do_sample=False, max_new_tokens=N, eos_token_id=None, pad_token_id=0)``.
  ``batching=True``.
- float32 only (the hint above); no ``score()`` (the stateful model exposes no teacher-forced path of its own);
  no ``kv_cache_bytes`` (the state is the runtime's).
- ``isolated=True``: native code runs in a process of its own (a crash fails one test).
- optimum-intel brings its own transformers (2.2.0: 5.5.4) and, through torchvision, torch 2.15 (a CUDA build from
  the registry, run on CPU): the recipe leaves them to pip's resolver, so this engine runs on those versions, not on
  the project's CI pins.
"""

from __future__ import annotations

import torch

from pytest_kvcompile.contract.engine import Declaration, ModelNotSupported, ModelSpec
from pytest_kvcompile.engines.recipe import Recipe

RECIPE = Recipe(packages=("optimum-intel==2.2.0", "openvino==2026.4.1"),
                note="optimum-intel exports the checkpoint to OpenVINO IR; it pulls its own torch and transformers.")
OV_CONFIG = {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f16"}


class OpenVINO:
    """optimum-intel ``OVModelForCausalLM`` (stateful OpenVINO model on CPU), greedy ``generate()``."""

    kv_declaration = Declaration(
        batching=True,
        devices=("cpu",),
        dtypes=("float32",),
        kv_cache_dtype="float16",  # OpenVINO's KV cache with the f32 hint (OV_CONFIG)
        requires=RECIPE.requirement("optimum.intel"),
        isolated=True,  # native code: a crash or hang fails one test, not the run (run/isolation.py)
        description="OpenVINO via optimum-intel OVModelForCausalLM (stateful: KV cache in the runtime, f16), float32",
    )

    def __init__(self, spec: ModelSpec):
        from importlib.metadata import version

        from optimum.intel import OVModelForCausalLM

        self.spec = spec
        try:
            self.model = OVModelForCausalLM.from_pretrained(spec.path, export=True, compile=True, ov_config=OV_CONFIG)
        except (ValueError, RuntimeError, KeyError, NotImplementedError) as exc:
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ModelNotSupported(f"optimum-intel {version('optimum-intel')} cannot export "
                                    f"{spec.config.model_type} to OpenVINO: {type(exc).__name__}: {reason}") from None

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        from transformers import GenerationConfig

        if not prompts or max_new_tokens == 0:
            return [[] for _ in prompts]
        longest = max(map(len, prompts))
        ids = torch.tensor([[0] * (longest - len(p)) + list(p) for p in prompts])
        mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])
        config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=0)
        return self.model.generate(input_ids=ids, attention_mask=mask, generation_config=config)[:, longest:].tolist()
