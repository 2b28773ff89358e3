"""Draft models for speculative decoding, derived from the checkpoint under test (contract/speculative.py).

- `perturb`: every weight outside the norms moved by ``noise * std(weight) * N(0, 1)`` from a seeded generator, in
  sorted-name order: the same architecture, so the draft's own cache takes the target's path, but it disagrees with the
  target often (the default drafts of hf-assisted and ref-speculative).
- `head_swapped`: a checkpoint whose output head has the rows of two tokens swapped and nothing else changed: its
  logits are the target's with the two swapped, so its greedy draft is the target's own choice except where that is
  one of the two. The suite picks the two from the oracle's continuation, so it knows where every draft is rejected
  (oracles/speculation.py: `choose_swap`).
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import torch

from pytest_kvcompile.contract.engine import ModelSpec
from pytest_kvcompile.models.checkpoints import pretrained
from pytest_kvcompile.models.zoo import built_once


def perturb(model: torch.nn.Module, noise: float, seed: int) -> torch.nn.Module:
    """`model` (in place) with every parameter outside the norms perturbed (module docstring); returns it."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if "norm" not in name and param.numel() > 1:
                shift = torch.randn(param.shape, generator=generator, dtype=torch.float32)
                param.add_((noise * param.float().std().cpu() * shift).to(param.dtype).to(param.device))
    return model


def head_swapped(spec: ModelSpec, root: Path, a: int, b: int) -> ModelSpec:
    """A checkpoint under `root`: `spec`'s, with rows a and b of its output head swapped (a tied head is untied first:
    the input embeddings stay the target's). Built once (zoo.built_once)."""
    def build(tmp: Path) -> None:
        model = pretrained(spec.path, torch.float32)
        head = model.get_output_embeddings()
        model.config.tie_word_embeddings = False
        weight = head.weight.detach().clone()
        weight[[a, b]] = weight[[b, a]]
        head.weight = torch.nn.Parameter(weight)
        model.save_pretrained(tmp)

    where = hashlib.sha256(str(Path(spec.path).resolve()).encode()).hexdigest()[:8]
    final = built_once(Path(root) / f"{Path(spec.path).name}-{where}-swap{a}-{b}", build)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(final, local_files_only=True)
    return dataclasses.replace(spec, name=f"{spec.name}/draft-swap-{a}-{b}", path=final, config=config)
