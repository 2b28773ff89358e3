"""Does a built-in engine compile and run on CUDA in a dtype, and with which attention? One case per process.

    python benchmarks/gpu_compile_check.py ENGINE MODEL DTYPE VARIANT

Prints one line, ``OK ...`` (seconds, dynamo compiles and CUDA graph captures after a 3-call warmup, over 4 more
calls of other shapes) or ``FAIL ...`` with the error's key lines (the guard, the framework culprit, the lowering
target). VARIANT swaps the reference models' attention (reference_impls/model.py: Attention.attend) for a
diagnosis, '+'-joined: ``sdpa`` (as shipped), ``explicit`` (matmul + float32 softmax, as transformers' eager),
``math_kernel`` / ``eff_math`` (SDPA restricted to those backends), ``no_gqa`` (KV heads expanded, no enable_gqa),
``pad2`` (prompts padded to >= 2 columns with torch._check, so an unbacked width is never 1).

Made for docs/gpu-results.md's finding 3 (the reference engines guard ``Eq(u0, 1)`` inside SDPA in 16-bit on CUDA,
torch 2.11) and finding 2 (``KeyError: 'unbacked_bindings'`` lowering the eviction prefill); issue 30's GPU session
ran 20 cases side by side (both fixed since: .ci/gpu-session now runs the suites of every reference engine
instead). DIAG_DEVICE=cpu runs the same on the CPU (a quick check that a case is well formed).
"""
import os
import sys
import time
import traceback

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoConfig

import reference_impls.model as M
from pytest_kvcompile.contract import registry
from pytest_kvcompile.contract.engine import ModelSpec
from pytest_kvcompile.models import zoo
from pytest_kvcompile.recompiles.recorder import CompileRecorder

if len(sys.argv) != 5:
    raise SystemExit(__doc__)
engine_name, model, dtype, variant = sys.argv[1:5]

def explicit(self, q, k, v, mask):
    b, h, t, d = q.shape
    kvh = k.size(1)
    q = q.view(b, kvh, h // kvh, t, d)
    scale = self.scale if self.scale is not None else d ** -0.5
    logits = (q @ k[:, :, None].transpose(-1, -2)) * scale
    w = logits.masked_fill(~mask[:, :, None], -torch.inf).softmax(dim=-1, dtype=torch.float32)
    return (w.to(v.dtype) @ v[:, :, None]).reshape(b, h, t, d)

def math_kernel(self, q, k, v, mask):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel([SDPBackend.MATH]):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=True)

def eff_math(self, q, k, v, mask):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=True)

def no_gqa(self, q, k, v, mask):
    b, h, t, d = q.shape
    kvh, n = k.size(1), k.size(2)
    k = k[:, :, None].expand(b, kvh, h // kvh, n, d).reshape(b, h, n, d)
    v = v[:, :, None].expand(b, kvh, h // kvh, n, d).reshape(b, h, n, d)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)

for part in variant.split("+"):
    if part in ("explicit", "math_kernel", "eff_math", "no_gqa"):
        M.Attention.attend = globals()[part]
    elif part == "pad2":
        import reference_impls.compiled_dynamic as CD
        import reference_impls.static_cache as SC
        orig_left_pad = CD.left_pad
        def left_pad2(prompts, device, orig_left_pad=orig_left_pad):
            tokens, valid = orig_left_pad(prompts, device)
            return (F.pad(tokens, (1, 0)), F.pad(valid, (1, 0))) if tokens.size(1) < 2 else (tokens, valid)
        CD.left_pad = left_pad2
        def prefill(model, tokens, valid):
            torch._check(tokens.size(1) >= 2)
            return model(tokens, valid)
        def decode(model, tokens, valid, cache):
            torch._check(valid.size(1) >= 3)
            return model(tokens, valid, cache)
        CD.prefill, CD.decode = prefill, decode
        def sprefill(model, tokens, pad):
            width = tokens.size(1)
            torch._check(width >= 2)
            model.reset(pad, width)
            return model(tokens, torch.arange(width, device=tokens.device))
        SC.prefill = sprefill
        orig_sp = SC.StaticCache._prefill
        def _prefill(self, prompts, steps, orig_sp=orig_sp):
            if max(map(len, prompts)) < 2:
                prompts = [[SC.PAD_ID] * (2 - len(p)) + list(p) for p in prompts]  # diagnosis only: the pad is real
            return orig_sp(self, prompts, steps)
        SC.StaticCache._prefill = _prefill
    elif part != "sdpa":
        raise SystemExit(f"unknown variant {part}")

cache = Path(os.environ.get("KVCOMPILE_CACHE_DIR", ".kvcompile-cache"))
path = zoo.checkpoint(model, cache / "zoo")
spec = ModelSpec(model, path, AutoConfig.from_pretrained(path), device=os.environ.get("DIAG_DEVICE", "cuda"),
                 dtype=getattr(torch, dtype))
t0 = time.time()
tag = f"{engine_name} {model} {dtype} {variant}"
try:
    ref = registry.resolve(engine_name)
    g = torch.Generator().manual_seed(0)

    def P(n):
        return torch.randint(1, 200, (n,), generator=g).tolist()

    with CompileRecorder() as rec:
        eng = ref.build(spec, "inductor")
        eng.generate([P(5)], 4)
        eng.generate([P(1)], 4)
        eng.generate([P(3), P(9), P(1)], 4)
        rec.mark_warmup_done()
        outs = [eng.generate([P(n) for n in lengths], 6) for lengths in [(7,), (1,), (2, 30), (64, 3, 11)]]
    print(f"OK   {tag}: {time.time()-t0:.0f}s, compiles after warmup {len(rec.post_warmup_events)}, "
          f"captures {len(rec.captures)} (after warmup {len(rec.post_warmup_captures)})", flush=True)
except Exception as e:
    msg = "".join(traceback.format_exception_only(type(e), e))
    lines = [line for line in msg.splitlines() if line.strip()]
    marks = ("Error", "Eq(", "culprit", "File \"", "target:", "guard", "Caused")
    keep = [line for line in lines if any(k in line for k in marks)]
    print(f"FAIL {tag}: {time.time()-t0:.0f}s\n    " + "\n    ".join((lines[:6] + keep[:30])[:40]), flush=True)
