"""The golden forward of a weight-only GRU: the definition every path is tested against
(float64, dequantized weights rounded to the module's dtype; docs/weight_only.md)."""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from .format import WOLayer, dequantize


def golden_forward(layers: Sequence[Sequence[WOLayer]], x: torch.Tensor, h0: Optional[torch.Tensor] = None,
                   lengths: Optional[torch.Tensor] = None, dtype: torch.dtype = torch.float32
                   ) -> Tuple[torch.Tensor, torch.Tensor]:
    """The definition of a weight-only GRU's forward, in float64: dequantize the stored weights
    (``dequantize``), round them, the biases and the input to the module's ``dtype`` (what its
    kernels read; each layer's input too), then the float GRU of torch.nn.GRU in float64 (the state
    between steps is not rounded).

    x [T, B, I] time-major, h0 [L * D, B, H] or None, lengths [B] (steps t >= lengths[b] of
    sequence b are padding: its state is not updated and its output is 0, as for a PackedSequence).
    Returns (output [T, B, D * H], h_n [L * D, B, H]), float64."""
    T, B, _ = x.shape
    D = len(layers[0])
    H = layers[0][0].R.K
    f64 = torch.float64
    dev = x.device

    def as_module(t):  # what the module's kernels read: the value in the module's dtype
        return t.to(dtype).to(f64)

    inp = x
    valid = torch.ones(T, B, 1, dtype=torch.bool, device=dev) if lengths is None else \
        (torch.arange(T, device=dev).unsqueeze(1) < lengths.to(dev).unsqueeze(0)).unsqueeze(-1)
    h_n = []
    for li, row in enumerate(layers):
        inp = as_module(inp)  # each layer reads its input in the module's dtype
        outs = []
        for d, p in enumerate(row):
            W, R = as_module(dequantize(p.W)), as_module(dequantize(p.R))
            b_ih = as_module(p.b_ih) if p.b_ih is not None else torch.zeros(3 * H, dtype=f64, device=dev)
            b_hh = as_module(p.b_hh) if p.b_hh is not None else torch.zeros(3 * H, dtype=f64, device=dev)
            h = torch.zeros(B, H, dtype=f64, device=dev) if h0 is None else as_module(h0[li * D + d])
            out = torch.zeros(T, B, H, dtype=f64, device=dev)
            for t in (range(T) if d == 0 else reversed(range(T))):
                gi = inp[t] @ W.t() + b_ih
                gh = h @ R.t() + b_hh
                r = torch.sigmoid(gi[:, :H] + gh[:, :H])
                z = torch.sigmoid(gi[:, H:2 * H] + gh[:, H:2 * H])
                n = torch.tanh(gi[:, 2 * H:] + r * gh[:, 2 * H:])
                h_new = (1 - z) * n + z * h
                h = torch.where(valid[t], h_new, h)
                out[t] = torch.where(valid[t], h_new, torch.zeros_like(h_new))
            outs.append(out)
            h_n.append(h)
        inp = torch.cat(outs, -1)
    return inp, torch.stack(h_n)
