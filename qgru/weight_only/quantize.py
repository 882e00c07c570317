"""Quantizing one weight matrix for the weight-only mode (qgru/weight_only/format.py holds the
storage it produces): each group's grid (min/max, or a range search over shrunk ranges), then the
codes, rounded to nearest or by GPTQ against the calibration's second moments, and a few
coordinate-descent sweeps. docs/weight_only.md, "Choosing the grids and codes"."""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from .format import PackedWeight, WeightOnlyConfig, groups_of, pack_codes

SEARCH_SHRINK = tuple(1.0 - 0.04 * i for i in range(13))  # range factors tried per group: 1.0 ... 0.52
SEARCH_RUNS = 4  # grids (per group: the best SEARCH_RUNS ranges by the group's own error) rounded in full
CD_SWEEPS = 4  # coordinate-descent passes over the codes after rounding (each only lowers the error)
DAMP = 0.001  # dampening: M + DAMP * mean(diag M) * I, the objective the rounding and search minimize
# (0.01, GPTQ's usual value, gave 38.4 dB instead of 39.8 on the demo's w4g128; docs/weight_only.md)


def _grid(lo: torch.Tensor, hi: torch.Tensor, bits: int, symmetric: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """(scale float32, zp int64) of ranges [lo, hi] (lo <= 0 <= hi), any shape (module docstring)."""
    if symmetric:
        scale = torch.maximum(hi, -lo) / ((1 << (bits - 1)) - 1)
    else:
        scale = (hi - lo) / ((1 << bits) - 1)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale)).to(torch.float32)
    if symmetric:
        zp = torch.full_like(scale, 1 << (bits - 1), dtype=torch.int64)
    else:
        zp = torch.round(-lo / scale.double()).clamp(0, (1 << bits) - 1).to(torch.int64)
    return scale, zp


def _ranges(w: torch.Tensor, group_size: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(w padded to [N, G, g] float64, lo [N, G], hi [N, G]): each group's range widened to include 0."""
    N, K = w.shape
    g, G = groups_of(K, group_size)
    wp = torch.nn.functional.pad(w.detach().to(torch.float64), (0, G * g - K)).reshape(N, G, g)
    return wp, wp.amin(-1).clamp(max=0), wp.amax(-1).clamp(min=0)  # padded zeros lie inside any range with 0


def _shrinks(symmetric: bool) -> List[Tuple[float, float]]:
    """(factor of lo, factor of hi) pairs searched; (1, 1) first. Symmetric grids have one range."""
    if symmetric:
        return [(a, a) for a in SEARCH_SHRINK]
    return [(a, b) for a in SEARCH_SHRINK for b in SEARCH_SHRINK]


def group_params(w: torch.Tensor, bits: int, group_size: int, symmetric: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """(scale float32 [G, N], zp int64 [G, N]) of w [N, K] (float): each group's min/max grid.

    Asymmetric: the group's range widened to include 0, scale = (hi - lo) / (2^b - 1), zp =
    round(-lo / scale) (so 0 is exact). Symmetric: scale = max |w| / (2^(b-1) - 1), zp = 2^(b-1).
    An all-zero group gets scale 1."""
    _, lo, hi = _ranges(w, group_size)
    scale, zp = _grid(lo, hi, bits, symmetric)
    return scale.t().contiguous(), zp.t().contiguous()


def _code_range(bits: int, symmetric: bool) -> Tuple[int, int]:
    if symmetric:
        return 1 if bits > 1 else 0, (1 << bits) - 1
    return 0, (1 << bits) - 1


def damped(second_moment: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """M + DAMP * mean(diag M) * I in float64: what gptq rounding and the range search minimize
    (e M e^T per row, e the row's weight error); None where ``second_moment`` is None, not finite
    or has no positive diagonal."""
    if second_moment is None or not bool(torch.isfinite(second_moment).all()):
        return None
    M = second_moment.detach().double().clone()
    K = M.shape[0]
    mean_diag = float(M.diagonal().mean()) if K else 0.0
    if not mean_diag > 0:
        return None
    return M + DAMP * mean_diag * torch.eye(K, dtype=torch.float64, device=M.device)


def product_error(w: torch.Tensor, deq: torch.Tensor, M: Optional[torch.Tensor]) -> torch.Tensor:
    """Per row, e M e^T with e = deq - w (float64 [N]); M None: the identity (squared error)."""
    e = deq.double() - w.double()
    if M is None:
        return (e * e).sum(1)
    return ((e @ M.double()) * e).sum(1)


def _gptq(W: torch.Tensor, s_cols: torch.Tensor, z_cols: torch.Tensor, U: torch.Tensor, order: torch.Tensor,
          lo: int, hi: int) -> torch.Tensor:
    """GPTQ (OPTQ) codes of W [N, K] float64 on fixed grids (scale, zp per column, [N, K]): columns
    in ``order``; U the upper Cholesky factor of the inverse of the damped, permuted M."""
    W = W[:, order].clone()
    S, Z = s_cols[:, order], z_cols[:, order]
    Q = torch.empty_like(W)
    for j in range(W.shape[1]):
        Q[:, j] = torch.round(W[:, j] / S[:, j] + Z[:, j]).clamp(lo, hi)
        e = (W[:, j] - (Q[:, j] - Z[:, j]) * S[:, j]) / U[j, j]
        W[:, j + 1:] -= e.unsqueeze(1) * U[j, j + 1:].unsqueeze(0)
    q = torch.empty_like(Q)
    q[:, order] = Q
    return q


def _descend(w: torch.Tensor, q: torch.Tensor, s_cols: torch.Tensor, z_cols: torch.Tensor, M: torch.Tensor,
             lo: int, hi: int, sweeps: Optional[int] = None) -> torch.Tensor:
    """Coordinate descent on e M e^T (e = (q - z) s - w, per row) over the integer codes: each
    column in turn moves to its best code with the others fixed (the rounded minimum of a 1-D
    quadratic, clamped to the code range: never a higher error); ``sweeps`` passes at most."""
    q = q.clone()
    eM = (((q - z_cols) * s_cols - w) @ M)
    sweeps = CD_SWEEPS if sweeps is None else sweeps
    d = M.diagonal()
    for _ in range(sweeps):
        moved = False
        for j in range(w.shape[1]):
            s = s_cols[:, j]
            new = (q[:, j] + torch.round(-eM[:, j] / (s * d[j]))).clamp(lo, hi)
            delta = new - q[:, j]
            if bool((delta != 0).any()):
                moved = True
                q[:, j] = new
                eM += (delta * s).unsqueeze(1) * M[j].unsqueeze(0)
        if not moved:
            break
    return q


def quantize_weight(w: torch.Tensor, config: WeightOnlyConfig,
                    second_moment: Optional[torch.Tensor] = None) -> PackedWeight:
    """w [N, K] -> PackedWeight.

    Rounding: with ``second_moment`` M (E[v v^T] [K, K] of the operand the matrix multiplies) and
    ``config.weight_rounding == "gptq"``, GPTQ's column-by-column rounding (columns by decreasing
    M_jj, the grids fixed beforehand), then coordinate descent on the codes; both lower e M_d e^T,
    the expected squared error of the row's product w.v (M_d = M damped, ``damped``). Else nearest.

    Grids (``config.search``, the default): each group's range [lo, hi] shrunk by every pair of
    SEARCH_SHRINK factors (one factor for symmetric grids); per group the SEARCH_RUNS ranges with
    the least nearest-rounding error on the group's own block of M_d are kept; the matrix is
    rounded on each of those SEARCH_RUNS grids (the r-th best range of every group), on the
    min/max grid, and (to nearest) on the min/max grid again; each row keeps the grid and codes
    with the least e M_d e^T (float64). So a row's error is never above nearest rounding's on the
    min/max grid. Without search: the min/max grid (group_params)."""
    if w.dim() != 2 or not bool(torch.isfinite(w).all()):
        raise WeightOnlyError("quantize_weight: a finite 2-D weight matrix is needed")
    N, K = w.shape
    bits = config.bits
    g, G = groups_of(K, config.group_size)
    dev = w.device
    M = damped(second_moment.to(dev)) if second_moment is not None and config.weight_rounding == "gptq" else None
    lo, hi = _code_range(bits, config.symmetric)
    W = w.detach().double()
    idx = torch.arange(K, device=dev) // g
    wp, lo0, hi0 = _ranges(W, config.group_size)

    U = order = None
    if M is not None:
        order = torch.argsort(M.diagonal(), descending=True, stable=True)
        try:
            U = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(M[order][:, order])), upper=True)
        except RuntimeError:
            U = None

    def cols(scale, zp):  # [N, G] -> per column [N, K], float64
        return scale.double()[:, idx], zp.double()[:, idx]

    def nearest(scale, zp):
        s, z = cols(scale, zp)
        return torch.round(W / s + z).clamp(lo, hi)

    def rounded(scale, zp):  # the config's rounding on one grid
        if U is None:
            return nearest(scale, zp)
        s, z = cols(scale, zp)
        return _descend(W, _gptq(W, s, z, U, order, lo, hi), s, z, M, lo, hi)

    scale0, zp0 = _grid(lo0, hi0, bits, config.symmetric)  # [N, G]
    grids = [(scale0, zp0)]
    if config.search:
        # per group, every shrunk range's nearest-rounding error on the group's block of M_d
        blocks = None
        if M is not None:
            Mp = torch.nn.functional.pad(M, (0, G * g - K, 0, G * g - K))
            blocks = torch.stack([Mp[i * g:(i + 1) * g, i * g:(i + 1) * g] for i in range(G)])  # [G, g, g]
        mask = torch.ones(G * g, dtype=torch.float64, device=dev)
        mask[K:] = 0
        mask = mask.reshape(G, g)
        cand_s, cand_z, cand_e = [], [], []
        for a, b in _shrinks(config.symmetric):
            s, z = _grid(lo0 * a, hi0 * b, bits, config.symmetric)
            sd, zd = s.double().unsqueeze(-1), z.double().unsqueeze(-1)
            e = ((torch.round(wp / sd + zd).clamp(lo, hi) - zd) * sd - wp) * mask  # [N, G, g]
            err = (e * e).sum(-1) if blocks is None else torch.einsum("ngi,gij,ngj->ng", e, blocks, e)
            cand_s.append(s)
            cand_z.append(z)
            cand_e.append(err)
        best = torch.argsort(torch.stack(cand_e), dim=0, stable=True)[:SEARCH_RUNS]  # [R, N, G]
        S, Z = torch.stack(cand_s), torch.stack(cand_z)
        for r in range(best.shape[0]):
            grids.append((S.gather(0, best[r:r + 1])[0], Z.gather(0, best[r:r + 1])[0]))
    out_s, out_z, out_q, out_e = None, None, None, None
    tries = [(s, z, rounded) for s, z in grids]
    if U is not None:
        tries.append((scale0, zp0, nearest))  # the bound the search promises
    for s, z, how in tries:
        q = how(s, z)
        sc, zc = cols(s, z)
        deq = (q - zc) * sc.float().double()
        err = product_error(W, deq, M)
        if out_e is None:
            out_s, out_z, out_q, out_e = s, z, q, err
        else:
            better = err < out_e
            out_e = torch.where(better, err, out_e)
            b1 = better.unsqueeze(1)
            out_s, out_z, out_q = torch.where(b1, s, out_s), torch.where(b1, z, out_z), torch.where(b1, q, out_q)
    return PackedWeight(pack_codes(out_q.to(torch.int64), bits), out_s.t().contiguous(), out_z.t().contiguous().to(torch.uint8),
                        bits, g, K)
