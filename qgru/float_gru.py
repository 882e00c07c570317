"""The float reference GRU, step by step, with the same tensors as the integer model.

Used during calibration (observers see x, h, Wx, Rh and the gate pre-activations exactly where the
integer model will quantize them) and as the float side of accuracy measurements. Matches
torch.nn.GRU to float32 rounding (tests/test_dropin.py).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from .observers import Observer, SecondMoment


def float_direction(w_ih: torch.Tensor, w_hh: torch.Tensor, b_ih: Optional[torch.Tensor],
                    b_hh: Optional[torch.Tensor], x: torch.Tensor, h0: torch.Tensor,
                    lengths: Optional[torch.Tensor] = None,
                    observers: Optional[Dict[str, Observer]] = None,
                    trace: Optional[Dict[str, List[torch.Tensor]]] = None,
                    moments: Optional[Dict[str, SecondMoment]] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """One direction over time: x [T, N, I], h0 [N, H] -> (outputs [T, N, H], h_n [N, H]).

    ``trace`` (optional, for qgru.compare): a dict to which every step appends its float Wx, Rh,
    r_pre, r, z_pre, z, g_pre, g and h (the new state, before any padding mask): the same names
    as golden.gru_step's trace. Tracing changes no result. ``moments`` (optional, calibration):
    "x" and "h" SecondMoment accumulators, fed every valid row of the operands of W and R (x[t],
    and the state h entering step t).
    """
    H = w_hh.shape[1]
    if lengths is not None:
        lengths = lengths.to(x.device)  # a PackedSequence's lengths are on the CPU, whatever x's device
    Wx = x @ w_ih.t()
    if b_ih is not None:
        Wx = Wx + b_ih
    h = h0
    outs = []
    obs = observers or {}

    def see(name, v, valid):
        if name in obs:
            obs[name].observe(v if valid is None else v[valid])

    for t in range(x.shape[0]):
        valid = None if lengths is None else (t < lengths)
        Rh = h @ w_hh.t()
        if b_hh is not None:
            Rh = Rh + b_hh
        r_pre = Wx[t, :, :H] + Rh[:, :H]
        z_pre = Wx[t, :, H:2 * H] + Rh[:, H:2 * H]
        r = torch.sigmoid(r_pre)
        z = torch.sigmoid(z_pre)
        g_pre = Wx[t, :, 2 * H:] + r * Rh[:, 2 * H:]
        g = torch.tanh(g_pre)
        h_new = (1 - z) * g + z * h
        if trace is not None:
            for name, v in (("Wx", Wx[t]), ("Rh", Rh), ("r_pre", r_pre), ("r", r), ("z_pre", z_pre),
                            ("z", z), ("g_pre", g_pre), ("g", g), ("h", h_new)):
                trace.setdefault(name, []).append(v)
        if obs:
            see("x", x[t], valid)
            see("h", h, valid)
            see("Wx", Wx[t], valid)
            see("Rh", Rh, valid)
            see("r_pre", r_pre, valid)
            see("z_pre", z_pre, valid)
            see("g_pre", g_pre, valid)
        if valid is not None:
            h_new = torch.where(valid.unsqueeze(1), h_new, h)
        h = h_new
        outs.append(h)
    if obs:
        see("h", h, None)
    out = torch.stack(outs) if outs else x.new_zeros((0,) + tuple(h0.shape))
    if moments and outs:
        h_in = torch.cat([h0.unsqueeze(0), out[:-1]])  # the state each step multiplies by R
        if lengths is not None:
            valid = torch.arange(x.shape[0], device=x.device).unsqueeze(1) < lengths.to(x.device).unsqueeze(0)
            x_rows, h_rows = x[valid], h_in[valid]
        else:
            x_rows, h_rows = x, h_in
        if "x" in moments:
            moments["x"].observe(x_rows)
        if "h" in moments:
            moments["h"].observe(h_rows)
    return out, h
