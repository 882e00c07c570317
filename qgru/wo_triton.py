"""Triton kernels of the weight-only mode (seed 003's w248a16_matmul, issue 33): packed 2/4/8-bit
weights are dequantized group by group in registers and multiplied with float16 / bfloat16 /
float32 activations into float32 accumulators.

* ``wo_matmul(x [M, K], p)``: x . dequantize(p)^T with tl.dot, for W.x over a whole sequence
  (M = T * B rows at once). Tiles of BLOCK_K inputs: each input k reads word row k // per, shifts
  by (k % per) * bits, and subtracts / scales by its group's zero point and scale, as stored
  (qgru/weight_only.py); the float32 weight is rounded to the activations' dtype before the dot,
  as the golden forward rounds it.
* ``gru_step``: one time step of one layer direction, R.h fused with the gates: each program
  owns BLOCK_H hidden units of one batch row, computes their three rows of R.h (dequantizing R
  in registers), adds gi = W.x + b_ih and b_hh, applies the gates and writes h_t and the output
  (t >= length: the state is kept and the output is 0, for PackedSequence input).

Triton is optional (``pip install qgru[triton]``) and imported only when this module is. The
kernels run on CUDA; with ``TRITON_INTERPRET=1`` set before this module is imported they run on
CPU tensors in Triton's interpreter (how the tests check them on machines without a GPU).
Written for triton 3.6 (torch 2.11, the GPU machines) and 3.9 (the registry's, used by the tests).
"""
from __future__ import annotations

import os
from typing import Optional, Sequence, Tuple

import torch

try:
    import triton
    import triton.language as tl
    _IMPORT_ERROR = ""
except Exception as e:  # noqa: BLE001 - ImportError, or a broken installation
    triton = tl = None
    _IMPORT_ERROR = f"triton is not importable ({type(e).__name__}: {e})"

from .weight_only import PackedWeight, WOLayer, WeightOnlyError

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def why_unavailable() -> str:
    """'' when the kernels can run CUDA tensors here, else why not."""
    if _IMPORT_ERROR:
        return _IMPORT_ERROR
    if not INTERPRET and not torch.cuda.is_available():
        return "no CUDA device"
    return ""


if triton is not None:
    @triton.jit
    def _wo_matmul_kernel(x_ptr, codes_ptr, scale_ptr, zp_ptr, y_ptr, M, N, K, group, stride_xm,
                          BITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, FP32: tl.constexpr, BF16: tl.constexpr, DOT_IN_FP32: tl.constexpr):
        PER: tl.constexpr = 32 // BITS
        MASK: tl.constexpr = (1 << BITS) - 1
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok = rm < M
        n_ok = rn < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            k_ok = rk < K
            x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            kn_ok = k_ok[:, None] & n_ok[None, :]
            words = tl.load(codes_ptr + (rk // PER)[:, None] * N + rn[None, :], mask=kn_ok, other=0)
            g = rk // group
            zp = tl.load(zp_ptr + g[:, None] * N + rn[None, :], mask=kn_ok, other=0).to(tl.int32)
            sc = tl.load(scale_ptr + g[:, None] * N + rn[None, :], mask=kn_ok, other=0.0)
            q = (words >> ((rk % PER) * BITS)[:, None]) & MASK
            w = (q - zp).to(tl.float32) * sc  # [BLOCK_K, BLOCK_N], as stored
            if FP32:
                acc += tl.dot(x, w, input_precision="ieee")
            elif BF16:
                # w rounded to the nearest bfloat16 (ties to even) in integer bits: Triton 3.9's
                # interpreter truncates in .to(tl.bfloat16) where the GPU rounds to nearest; the
                # rounded value converts to bfloat16 exactly under either
                wb = w.to(tl.uint32, bitcast=True)
                w = ((wb + 0x7FFF + ((wb >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
                if DOT_IN_FP32:  # the same products: 16-bit x 16-bit is exact in float32
                    acc += tl.dot(x.to(tl.float32), w, input_precision="ieee")
                else:
                    acc += tl.dot(x, w.to(tl.bfloat16))
            else:
                acc += tl.dot(x, w.to(x.dtype))
        tl.store(y_ptr + rm[:, None] * N + rn[None, :], acc, mask=m_ok[:, None] & n_ok[None, :])

    @triton.jit
    def _gru_step_kernel(gi_ptr, h_ptr, codes_ptr, scale_ptr, zp_ptr, bhh_ptr, len_ptr, out_ptr, hout_ptr,
                         t, H, group, HAS_BIAS: tl.constexpr, BITS: tl.constexpr, ROUND: tl.constexpr,
                         BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr):
        PER: tl.constexpr = 32 // BITS
        MASK: tl.constexpr = (1 << BITS) - 1
        b = tl.program_id(1)
        rj = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
        j_ok = rj < H
        N = 3 * H
        acc_r = tl.zeros((BLOCK_H,), dtype=tl.float32)
        acc_z = tl.zeros((BLOCK_H,), dtype=tl.float32)
        acc_n = tl.zeros((BLOCK_H,), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            k_ok = rk < H
            hk = tl.load(h_ptr + b * H + rk, mask=k_ok, other=0.0)
            m2 = k_ok[:, None] & j_ok[None, :]
            wrow = (rk // PER)[:, None] * N
            grow = (rk // group)[:, None] * N
            sh = ((rk % PER) * BITS)[:, None]
            for gate in tl.static_range(3):
                col = gate * H + rj[None, :]
                words = tl.load(codes_ptr + wrow + col, mask=m2, other=0)
                zp = tl.load(zp_ptr + grow + col, mask=m2, other=0).to(tl.int32)
                sc = tl.load(scale_ptr + grow + col, mask=m2, other=0.0)
                w = (((words >> sh) & MASK) - zp).to(tl.float32) * sc
                if ROUND == 1:
                    w = w.to(tl.float16).to(tl.float32)
                elif ROUND == 2:  # to the nearest bfloat16 in integer bits, as in _wo_matmul_kernel
                    wb = w.to(tl.uint32, bitcast=True)
                    w = ((wb + 0x7FFF + ((wb >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
                part = tl.sum(w * hk[:, None], axis=0)
                if gate == 0:
                    acc_r += part
                elif gate == 1:
                    acc_z += part
                else:
                    acc_n += part
        if HAS_BIAS:
            acc_r += tl.load(bhh_ptr + rj, mask=j_ok, other=0.0)
            acc_z += tl.load(bhh_ptr + H + rj, mask=j_ok, other=0.0)
            acc_n += tl.load(bhh_ptr + 2 * H + rj, mask=j_ok, other=0.0)
        gi = gi_ptr + b * N
        r = tl.sigmoid(tl.load(gi + rj, mask=j_ok, other=0.0) + acc_r)
        z = tl.sigmoid(tl.load(gi + H + rj, mask=j_ok, other=0.0) + acc_z)
        npre = tl.load(gi + 2 * H + rj, mask=j_ok, other=0.0) + r * acc_n
        n = 2.0 * tl.sigmoid(2.0 * npre) - 1.0  # tanh
        h_old = tl.load(h_ptr + b * H + rj, mask=j_ok, other=0.0)
        h_new = (1.0 - z) * n + z * h_old
        valid = t < tl.load(len_ptr + b)
        tl.store(hout_ptr + b * H + rj, tl.where(valid, h_new, h_old), mask=j_ok)
        tl.store(out_ptr + b * H + rj, tl.where(valid, h_new, 0.0), mask=j_ok)


def _need():
    why = why_unavailable()
    if why:
        raise WeightOnlyError(f"qgru.wo_triton: {why}")


def wo_matmul(x: torch.Tensor, p: PackedWeight, BLOCK_M: int = 16, BLOCK_N: int = 64, BLOCK_K: int = 32) -> torch.Tensor:
    """x [M, K] (float16, bfloat16 or float32) . dequantize(p)^T -> [M, N] float32."""
    _need()
    if x.dim() != 2 or x.shape[1] != p.K:
        raise WeightOnlyError(f"wo_matmul: x must be [M, {p.K}], got {list(x.shape)}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise WeightOnlyError(f"wo_matmul: x must be float16, bfloat16 or float32, got {x.dtype}")
    if BLOCK_K % (32 // p.bits):
        raise WeightOnlyError("wo_matmul: BLOCK_K must be a multiple of the codes per word")
    x = x.contiguous()
    M, N = x.shape[0], p.N
    y = torch.empty(M, N, dtype=torch.float32, device=x.device)
    if M == 0 or N == 0:
        return y
    grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N))
    _wo_matmul_kernel[grid](x, p.codes, p.scale, p.zp, y, M, N, p.K, p.group, x.stride(0),
                            BITS=p.bits, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                            FP32=x.dtype == torch.float32, BF16=x.dtype == torch.bfloat16,
                            # Triton 3.9's interpreter computes tl.dot of bfloat16 operands wrongly
                            # (garbage of magnitude 1e10; float16 is right): it gets the float32 form
                            DOT_IN_FP32=INTERPRET and x.dtype == torch.bfloat16)
    return y


_ROUND = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def gru_direction(gi: torch.Tensor, h0: torch.Tensor, R: PackedWeight, b_hh: Optional[torch.Tensor],
                  lengths: torch.Tensor, reverse: bool, dtype: torch.dtype,
                  BLOCK_H: int = 32, BLOCK_K: int = 32) -> Tuple[torch.Tensor, torch.Tensor]:
    """One layer direction: gi [T, B, 3H] float32 (W.x + b_ih), h0 [B, H] -> (out [T, B, H], h_T) float32."""
    _need()
    T, B, _ = gi.shape
    H = R.K
    gi = gi.contiguous()
    out = torch.empty(T, B, H, dtype=torch.float32, device=gi.device)
    h = [h0.to(torch.float32, copy=True).contiguous(), torch.empty(B, H, dtype=torch.float32, device=gi.device)]
    bias = b_hh if b_hh is not None else h[0]  # not read without HAS_BIAS
    grid = (triton.cdiv(H, BLOCK_H), B)
    for s in range(T):
        t = T - 1 - s if reverse else s
        _gru_step_kernel[grid](gi[t], h[s % 2], R.codes, R.scale, R.zp, bias, lengths, out[t], h[(s + 1) % 2],
                               t, H, R.group, HAS_BIAS=b_hh is not None, BITS=R.bits, ROUND=_ROUND[dtype],
                               BLOCK_H=BLOCK_H, BLOCK_K=BLOCK_K)
    return out, h[T % 2]


def gru_forward(layers: Sequence[Sequence[WOLayer]], x: torch.Tensor, hx: Optional[torch.Tensor],
                dtype: torch.dtype, lengths: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """The weight-only GRU on x [T, B, I] (time-major) with Triton: W.x for the whole sequence,
    then the fused step kernel. Returns (output [T, B, D*H], h_n) in float32."""
    _need()
    T, B, _ = x.shape
    D = len(layers[0])
    H = layers[0][0].R.K
    if lengths is None:
        lengths = torch.full((B,), T, dtype=torch.int32, device=x.device)
    lengths = lengths.to(device=x.device, dtype=torch.int32)
    inp = x
    h_n = []
    for li, row in enumerate(layers):
        outs = []
        for d, p in enumerate(row):
            gi = wo_matmul(inp.reshape(T * B, -1).to(dtype), p.W).view(T, B, 3 * H)
            if p.b_ih is not None:
                gi += p.b_ih.to(dtype).to(torch.float32)
            b_hh = p.b_hh.to(dtype).to(torch.float32) if p.b_hh is not None else None
            h0 = hx[li * D + d].to(dtype).to(torch.float32) if hx is not None else \
                torch.zeros(B, H, dtype=torch.float32, device=x.device)
            o, h = gru_direction(gi, h0, p.R, b_hh, lengths, d == 1, dtype)
            outs.append(o)
            h_n.append(h)
        inp = outs[0] if D == 1 else torch.cat(outs, -1)
    return inp, torch.stack(h_n)


class GraphedForward:
    """gru_forward replayed as a CUDA graph (the T step launches recorded once per input shape),
    so that a long sequence costs the GPU's launch latency per step instead of Triton's host-side
    launch time. Opt-in (WeightOnlyGRU.cuda_graph = True) and NOT yet run on a GPU (none where it
    was written): inputs are copied into static buffers, the graph is replayed, the outputs are
    cloned. One graph per (T, B, input dtype, has h0, has lengths); the weights are read from the
    layers' buffers as they were at capture (replace the module's buffers -> call reset())."""

    def __init__(self):
        self._graphs = {}

    def reset(self) -> None:
        self._graphs.clear()

    def __call__(self, layers, x: torch.Tensor, hx: Optional[torch.Tensor], dtype: torch.dtype,
                 lengths: Optional[torch.Tensor] = None):
        _need()
        if not x.is_cuda:
            raise WeightOnlyError("GraphedForward: CUDA tensors only")
        key = (tuple(x.shape), x.dtype, hx is not None, lengths is not None, dtype)
        entry = self._graphs.get(key)
        if entry is None:
            static = {"x": x.clone(), "hx": None if hx is None else hx.clone(),
                      "len": None if lengths is None else lengths.to(device=x.device, dtype=torch.int32).clone()}
            side = torch.cuda.Stream(device=x.device)
            side.wait_stream(torch.cuda.current_stream(x.device))
            with torch.cuda.stream(side):  # compile the kernels and warm the allocator outside the capture
                gru_forward(layers, static["x"], static["hx"], dtype, static["len"])
            torch.cuda.current_stream(x.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = gru_forward(layers, static["x"], static["hx"], dtype, static["len"])
            entry = self._graphs[key] = (graph, static, out)
        graph, static, out = entry
        static["x"].copy_(x)
        if hx is not None:
            static["hx"].copy_(hx)
        if lengths is not None:
            static["len"].copy_(lengths.to(device=x.device, dtype=torch.int32))
        graph.replay()
        return out[0].clone(), out[1].clone()
