"""The float reference GRU, step by step, with the same tensors as the integer model.

Used during calibration (observers see x, h, Wx, Rh and the gate pre-activations exactly where the
integer model will quantize them) and as the float side of accuracy measurements. Matches
torch.nn.GRU to float32 rounding (tests/test_dropin.py).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from .observers import Observer


def float_direction(w_ih: torch.Tensor, w_hh: torch.Tensor, b_ih: Optional[torch.Tensor],
                    b_hh: Optional[torch.Tensor], x: torch.Tensor, h0: torch.Tensor,
                    lengths: Optional[torch.Tensor] = None,
                    observers: Optional[Dict[str, Observer]] = None,
                    trace: Optional[Dict[str, List[torch.Tensor]]] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """One direction over time: x [T, N, I], h0 [N, H] -> (outputs [T, N, H], h_n [N, H]).

    ``trace`` (optional, for qgru.compare): a dict to which every step appends its float Wx, Rh,
    r_pre, r, z_pre, z, g_pre, g and h (the new state, before any padding mask): the same names
    as golden.gru_step's trace. Tracing changes no result.
    """
    H = w_hh.shape[1]
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
    return out, h
