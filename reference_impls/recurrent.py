"""What the recurrent layers of the hybrid models share (bamba.py's Mamba2, qwen3_next.py's Gated DeltaNet): the
causal depthwise conv over a kept window, and the pieces of a scan computed over a call's t tokens at once (one
chunk), so a whole prompt, a prefill chunk and a decode step run the same code, compiled once with t dynamic.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def segment_sum(a):
    """[..., t] -> [..., t, t]: out[i, j] = a[j+1] + ... + a[i] for j <= i, -inf above the diagonal (summed with
    cumsum over masked copies, not as a difference of cumsums: stable where the sums are long)."""
    t = a.size(-1)
    i = torch.arange(t, device=a.device)
    below, on_or_below = i[:, None] > i[None, :], i[:, None] >= i[None, :]
    sums = a[..., None, :].expand(*a.shape[:-1], t, t).transpose(-1, -2).masked_fill(~below, 0).cumsum(-2)
    return sums.masked_fill(~on_or_below, float("-inf"))


def contract(x, y):
    """x [..., l, k] @ y [..., k, r] as a product summed over k: inductor fuses it into one reduction, where its bmm
    lowering guards on whether an unbacked size is 1 (`is_preferred_layout_as_bmm_input`) and fails."""
    return (x[..., :, :, None] * y[..., None, :, :]).sum(-2)


def causal_conv(x, past, conv1d: nn.Conv1d, every: bool = False):
    """The depthwise causal conv of x [b, t, channels] after the window `past` [b, K-1, channels] (None: zeros), as K
    shifted products (inductor lowers conv1d with a static length only). Returns the conv's output [b, t, channels]
    (before its activation) and the window after the t tokens, a fresh tensor (a view carries the call's length in its
    strides, which the next graph guards on); `every`: the window after each token, [b, t, K-1, channels]."""
    kernel, t = conv1d.kernel_size[0], x.size(1)
    # a first call pads instead of starting from zeros (inductor's constant folding cannot size a zeros tensor of
    # an unbacked batch: "Could not guard on data-dependent expression Eq(2048*u0, 0)")
    inputs = torch.cat((past, x), dim=1) if past is not None else F.pad(x, (0, 0, kernel - 1, 0))
    weight = conv1d.weight[:, 0]  # [channels, K]
    out = sum(inputs.narrow(1, k, t) * weight[:, k] for k in range(kernel))
    if conv1d.bias is not None:
        out = out + conv1d.bias
    if every:  # after token l the window holds inputs l+1 .. l+K-1
        return out, torch.stack([inputs.narrow(1, 1 + j, t) for j in range(kernel - 1)], dim=2)
    return out, inputs.narrow(1, t, kernel - 1).clone(memory_format=torch.contiguous_format)


@torch.library.custom_op("reference_impls::unit_lower_solve", mutates_args=())
def unit_lower_solve(a: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
    """x with (I + a) x = rhs, a [..., t, t] strictly lower triangular (what is on or above its diagonal is not read),
    rhs [..., t, r]: `torch.linalg.solve_triangular` as an opaque op, whose meta function guards on sizes a compiled
    engine leaves unbacked ("Could not guard on data-dependent expression Eq(4*u0*u1**2, 0)")."""
    eye = torch.eye(a.size(-1), dtype=a.dtype, device=a.device)
    solved = torch.linalg.solve_triangular(a.tril(-1) + eye, rhs, upper=False, unitriangular=True)
    return solved.contiguous()  # LAPACK's is column-major; the fake below says contiguous


@unit_lower_solve.register_fake
def _(a, rhs):
    return torch.empty_like(rhs, memory_format=torch.contiguous_format)


__all__ = ["causal_conv", "contract", "segment_sum", "unit_lower_solve"]
