"""Triton kernels of the weight-only mode (seed 003's w248a16_matmul): packed 2/4/8-bit
weights are dequantized group by group in registers and multiplied with float16 / bfloat16 /
float32 activations into float32 accumulators.

* ``wo_matmul(x [M, K], p)``: x . dequantize(p)^T with tl.dot, for W.x over a whole sequence
  (M = T * B rows at once). Tiles of BLOCK_K inputs: each input k reads word row k // per, shifts
  by (k % per) * bits, and subtracts / scales by its group's zero point and scale, as stored
  (qgru/weight_only/format.py); the float32 weight is rounded to the activations' dtype before the dot,
  as the golden forward rounds it.
* ``gru_step``: one time step of one layer direction, R.h fused with the gates: each program
  owns BLOCK_H hidden units of one batch row, computes their three rows of R.h (dequantizing R
  in registers), adds gi = W.x + b_ih and b_hh, applies the gates and writes h_t and the output
  (t >= length: the state is kept and the output is 0, for PackedSequence input).
* ``fused_gru_direction``: the whole time loop of one layer direction in ONE launch. Program p owns
  a block of batch rows and every hidden unit of them, so a step depends only on what the program
  wrote itself and no grid-wide barrier is needed (none would run under the interpreter, which
  runs the programs one after another). The state goes through a global scratch [2, B, H]
  (double-buffered, a tl.debug_barrier between the steps); R's packed codes are read and
  dequantized in registers every step (they stay in L2). B < 16: one batch row per program, each
  word's codes multiplied and summed in registers; B >= 16: 16 rows per program and tl.dot (16-bit
  modules: the float32 state split into two float16 or three bfloat16 parts, so the tensor-core
  products stay exact; float32: input_precision "ieee"). GPU speed NOT yet measured.

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

from .format import PackedWeight, WOLayer, WeightOnlyError

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

    @triton.jit
    def _gru_seq_kernel(gi_ptr, h_ptr, codes_ptr, scale_ptr, zp_ptr, bhh_ptr, len_ptr, out_ptr,
                        T, B, H, group, REVERSE: tl.constexpr, HAS_BIAS: tl.constexpr, BITS: tl.constexpr,
                        ROUND: tl.constexpr, DOT: tl.constexpr, DOT_IN_FP32: tl.constexpr, ONE_GROUP: tl.constexpr,
                        BLOCK_B: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr):
        """The whole time loop of one layer direction in one launch (fused_gru_direction). Program
        p owns batch rows [p * BLOCK_B, (p + 1) * BLOCK_B) and every hidden unit of them, so a step
        depends only on what the program itself wrote: no grid-wide barrier. The state goes through
        the scratch h_ptr [2, B, H] float32 (step s reads buffer s % 2 and writes the other; buffer 0
        holds h0), with a barrier between the steps (the program's threads see each other's writes)."""
        PER: tl.constexpr = 32 // BITS
        MASK: tl.constexpr = (1 << BITS) - 1
        KW: tl.constexpr = BLOCK_K // PER  # word rows per K tile
        MAGIC: tl.constexpr = 0x4B000000  # the bits of 2^23: (2^23 + q) as float32 is exact for q < 2^23
        N = 3 * H
        J = (H + PER - 1) // PER  # word rows of R
        BH = B * H
        b0 = tl.program_id(0) * BLOCK_B
        rb = b0 + tl.arange(0, BLOCK_B)
        b_ok = rb < B
        lens = tl.load(len_ptr + rb, mask=b_ok, other=0)
        rb64 = rb.to(tl.int64)
        sh = (tl.arange(0, PER) * BITS).to(tl.uint32)[None, :, None]  # [1, PER, 1]: code i of a word at bit BITS * i
        ROW_FAST: tl.constexpr = ONE_GROUP and not DOT
        ci = tl.arange(0, PER)
        HI = ((ci * BITS + BITS) > 23)[None, :, None]  # codes read from the word shifted down 16
        pos = ci * BITS - 16 * ((ci * BITS + BITS) > 23).to(tl.int32)  # their bit offsets there
        PMASK = ((MASK << pos) | MAGIC).to(tl.uint32)[None, :, None]
        P2 = ((pos + 127) << 23).to(tl.float32, bitcast=True)[None, :, None]  # 2^pos
        P2INV = ((127 - pos) << 23).to(tl.float32, bitcast=True)[None, :, None]  # 2^-pos
        for s in range(T):
            if REVERSE:
                t = T - 1 - s
            else:
                t = s
            cur = h_ptr + (s % 2) * BH
            nxt = h_ptr + ((s + 1) % 2) * BH
            valid = t < lens  # [BLOCK_B]
            row = t * B + rb64  # [BLOCK_B] int64: rows of gi and out
            for j0 in range(0, H, BLOCK_H):
                rj = j0 + tl.arange(0, BLOCK_H)
                j_ok = rj < H
                if DOT:
                    acc_r = tl.zeros((BLOCK_B, BLOCK_H), dtype=tl.float32)
                    acc_z = tl.zeros((BLOCK_B, BLOCK_H), dtype=tl.float32)
                    acc_n = tl.zeros((BLOCK_B, BLOCK_H), dtype=tl.float32)
                else:  # one row (BLOCK_B == 1): the codes of a word summed in registers, word rows once per tile
                    acc_r = tl.zeros((KW, PER, BLOCK_H), dtype=tl.float32)
                    acc_z = tl.zeros((KW, PER, BLOCK_H), dtype=tl.float32)
                    acc_n = tl.zeros((KW, PER, BLOCK_H), dtype=tl.float32)
                for k0 in range(0, H, BLOCK_K):
                    kw = k0 // PER + tl.arange(0, KW)  # [KW] word rows
                    rk = (k0 + tl.arange(0, KW)[:, None] * PER + tl.arange(0, PER)[None, :])  # [KW, PER] inputs
                    k_ok = rk < H
                    wmask = (kw < J)[:, None, None] & j_ok[None, None, :]  # [KW, 1, BLOCK_H]
                    if DOT:
                        rk2 = k0 + tl.arange(0, BLOCK_K)
                        hk = tl.load(cur + rb[:, None] * H + rk2[None, :], mask=b_ok[:, None] & (rk2 < H)[None, :],
                                     other=0.0)  # [BLOCK_B, BLOCK_K]
                        if ROUND == 1:  # h = hi + lo in float16 (22 significant bits): two exact-product dots
                            h_hi = hk.to(tl.float16)
                            h_lo = (hk - h_hi.to(tl.float32)).to(tl.float16)
                        elif ROUND == 2:
                            if not DOT_IN_FP32:  # h = h1 + h2 + h3 exactly, each a bfloat16 (truncations in bits)
                                hb = hk.to(tl.uint32, bitcast=True)
                                h1 = (hb & 0xFFFF0000).to(tl.float32, bitcast=True)
                                r1 = hk - h1
                                h2 = (r1.to(tl.uint32, bitcast=True) & 0xFFFF0000).to(tl.float32, bitcast=True)
                                h3 = r1 - h2
                                h1 = h1.to(tl.bfloat16)
                                h2 = h2.to(tl.bfloat16)
                                h3 = h3.to(tl.bfloat16)
                    else:
                        hk = tl.load(cur + b0 * H + rk, mask=k_ok, other=0.0)[:, :, None]  # [KW, PER, 1]
                    for gate in tl.static_range(3):
                        col = gate * H + rj  # [BLOCK_H]
                        words = tl.load(codes_ptr + kw[:, None, None] * N + col[None, None, :], mask=wmask, other=0)
                        u = words.to(tl.uint32, bitcast=True)
                        if ONE_GROUP:  # the tile lies in one group: one scale and zero point per column
                            g = k0 // group
                            zp = tl.load(zp_ptr + g * N + col, mask=j_ok, other=0).to(tl.float32)[None, None, :]
                            sc = tl.load(scale_ptr + g * N + col, mask=j_ok, other=0.0)[None, None, :]
                        else:
                            gk = (rk // group)[:, :, None] * N + col[None, None, :]
                            m3 = k_ok[:, :, None] & j_ok[None, None, :]
                            zp = tl.load(zp_ptr + gk, mask=m3, other=0).to(tl.float32)
                            sc = tl.load(scale_ptr + gk, mask=m3, other=0.0)
                        if ROW_FAST:
                            # no shift per code: code i is masked where it lies, at bit pos_i of the low 23
                            # bits or (codes that end above bit 23) of the word shifted down 16, each under
                            # the exponent bits of 2^23, so the float is 2^23 + q 2^pos_i exactly; minus
                            # 2^23 + zp 2^pos_i is (q - zp) 2^pos_i exactly, and times scale 2^-pos_i the
                            # same single rounding as float32(q - zp) * scale
                            src = tl.where(HI, (u >> 16) | MAGIC, (u & 0x7FFFFF) | MAGIC)  # [KW, PER, BLOCK_H]
                            qm = (src & PMASK).to(tl.float32, bitcast=True)  # 2^23 + q 2^pos
                            w = (qm - (zp * P2 + 8388608.0)) * (sc * P2INV)
                        else:
                            q = (u >> sh) & MASK  # [KW, PER, BLOCK_H]
                            qm = (q | MAGIC).to(tl.float32, bitcast=True)  # 2^23 + q
                            # (2^23 + q) - (2^23 + zp) = q - zp exactly; times the scale: the stored float32 weight
                            w = (qm - (zp + 8388608.0)) * sc
                        if ROUND == 1:
                            w = w.to(tl.float16).to(tl.float32)
                        elif ROUND == 2:  # to the nearest bfloat16 in integer bits, as in _wo_matmul_kernel
                            wb = w.to(tl.uint32, bitcast=True)
                            w = ((wb + 0x7FFF + ((wb >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
                        if DOT:
                            w2 = tl.reshape(w, (BLOCK_K, BLOCK_H))
                            if gate == 0:
                                acc = acc_r
                            elif gate == 1:
                                acc = acc_z
                            else:
                                acc = acc_n
                            if ROUND == 0:
                                acc = tl.dot(hk, w2, acc, input_precision="ieee")
                            elif ROUND == 1:
                                w16 = w2.to(tl.float16)  # exact: already rounded to float16
                                acc = tl.dot(h_hi, w16, acc)
                                acc = tl.dot(h_lo, w16, acc)
                            elif DOT_IN_FP32:  # the interpreter's bfloat16 dot is wrong: the same products in float32
                                acc = tl.dot(hk, w2, acc, input_precision="ieee")
                            else:
                                wbf = w2.to(tl.bfloat16)  # exact: already rounded to bfloat16
                                acc = tl.dot(h1, wbf, acc)
                                acc = tl.dot(h2, wbf, acc)
                                acc = tl.dot(h3, wbf, acc)
                            if gate == 0:
                                acc_r = acc
                            elif gate == 1:
                                acc_z = acc
                            else:
                                acc_n = acc
                        else:
                            if gate == 0:
                                acc_r += hk * w
                            elif gate == 1:
                                acc_z += hk * w
                            else:
                                acc_n += hk * w
                if DOT:
                    ar, az, an = acc_r, acc_z, acc_n  # [BLOCK_B, BLOCK_H]
                else:
                    ar = tl.sum(tl.sum(acc_r, axis=1), axis=0)[None, :]  # [1, BLOCK_H]
                    az = tl.sum(tl.sum(acc_z, axis=1), axis=0)[None, :]
                    an = tl.sum(tl.sum(acc_n, axis=1), axis=0)[None, :]
                if HAS_BIAS:
                    ar += tl.load(bhh_ptr + rj, mask=j_ok, other=0.0)[None, :]
                    az += tl.load(bhh_ptr + H + rj, mask=j_ok, other=0.0)[None, :]
                    an += tl.load(bhh_ptr + 2 * H + rj, mask=j_ok, other=0.0)[None, :]
                m2 = b_ok[:, None] & j_ok[None, :]
                gi = gi_ptr + row[:, None] * N + rj[None, :]
                r = tl.sigmoid(tl.load(gi, mask=m2, other=0.0) + ar)
                z = tl.sigmoid(tl.load(gi + H, mask=m2, other=0.0) + az)
                npre = tl.load(gi + 2 * H, mask=m2, other=0.0) + r * an
                n = 2.0 * tl.sigmoid(2.0 * npre) - 1.0  # tanh
                hofs = rb[:, None] * H + rj[None, :]
                h_old = tl.load(cur + hofs, mask=m2, other=0.0)
                h_new = (1.0 - z) * n + z * h_old
                ok = valid[:, None]
                tl.store(nxt + hofs, tl.where(ok, h_new, h_old), mask=m2)
                tl.store(out_ptr + row[:, None] * H + rj[None, :], tl.where(ok, h_new, 0.0), mask=m2)
            tl.debug_barrier()  # this step's h (every tile, every thread) before the next step reads it


def _need():
    why = why_unavailable()
    if why:
        raise WeightOnlyError(f"qgru.weight_only.triton_kernels: {why}")


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


# "auto" runs the fused-sequence kernel except for small batches of wide layers, where its one
# program per batch row (one SM dequantizing all of R every step) is estimated slower than the
# per-step kernel's grid over hidden units: an estimate from instruction counts, NOT yet measured
# on a GPU (docs/weight_only.md; scripts/weight_only.py measures both).
FUSED_DOT_BATCH = 16  # batch rows per program of the fused kernel's tl.dot form (B >= this)
FUSED_MAX_HIDDEN_SMALL_BATCH = 512
# "auto" runs the per-step kernel until a same-run GPU benchmark shows the fused one faster (both
# match the golden forward on an H200, the fused one since 2026-11-28, when it was also slower at
# every shape but one: BENCHMARKS.md); then "auto" takes the rule below (FUSED_BY_DEFAULT = True)
FUSED_BY_DEFAULT = False
KERNELS = ("auto", "fused", "step")


def choose_kernel(H: int, B: int, kernel: str = "auto") -> str:
    """Which recurrent kernel gru_forward runs for hidden size H and batch B: "fused" (one launch
    per layer direction, fused_gru_direction) or "step" (one launch per time step, gru_direction)."""
    if kernel not in KERNELS:
        raise WeightOnlyError(f"qgru.weight_only.triton_kernels: kernel must be one of {KERNELS}, got {kernel!r}")
    if kernel != "auto":
        return kernel
    if not FUSED_BY_DEFAULT:
        return "step"
    return "fused" if B >= FUSED_DOT_BATCH or H <= FUSED_MAX_HIDDEN_SMALL_BATCH else "step"


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def fused_blocks(H: int, B: int, bits: int, group: int, dtype: torch.dtype) -> dict:
    """The fused kernel's launch shape. B < FUSED_DOT_BATCH: one batch row per program (the
    elementwise form), BLOCK_H = 32 * num_warps hidden units (up to 256 and 8 warps), so each
    thread owns one column and accumulates its products in registers (compiled for sm_90 with
    triton 3.9: 195 registers, no spills, no shared memory, about 9.3 instructions per weight in
    the inner loop); B >= FUSED_DOT_BATCH: 16 rows per program and
    tl.dot (fp16 / bf16: 64 x 32 tiles, float32: 32 x 16; no spills). BLOCK_K divides the group
    size where it can (one scale and zero point per column and tile: the ONE_GROUP form).
    NOT yet tuned on a GPU (scripts/weight_only.py --only-gpu --gpu-sweep compares shapes)."""
    per = 32 // bits
    dot = B >= FUSED_DOT_BATCH
    lo = max(per, 16) if dot else per
    bk = max(lo, min((16 if dtype == torch.float32 else 32) if dot else 32, _pow2(H)))
    while bk > lo and group % bk:
        bk //= 2
    if dot:
        return dict(BLOCK_B=FUSED_DOT_BATCH, BLOCK_H=32 if dtype == torch.float32 else 64, BLOCK_K=bk, num_warps=4)
    bh = max(16, min(256, _pow2(H)))
    return dict(BLOCK_B=1, BLOCK_H=bh, BLOCK_K=bk, num_warps=max(1, min(8, bh // 32)))


def fused_gru_direction(gi: torch.Tensor, h0: torch.Tensor, R: PackedWeight, b_hh: Optional[torch.Tensor],
                        lengths: torch.Tensor, reverse: bool, dtype: torch.dtype, BLOCK_B: Optional[int] = None,
                        BLOCK_H: Optional[int] = None, BLOCK_K: Optional[int] = None,
                        num_warps: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """One layer direction in ONE launch (the time loop inside the kernel): gi [T, B, 3H] float32
    (W.x + b_ih), h0 [B, H], lengths [B] int32 -> (out [T, B, H], h_T) float32, as gru_direction.
    Block sizes default to fused_blocks(); BLOCK_B 1 is the elementwise form, >= 16 the tl.dot form."""
    _need()
    T, B, _ = gi.shape
    H = R.K
    dev = gi.device
    cfg = fused_blocks(H, B, R.bits, R.group, dtype)
    for k, v in (("BLOCK_B", BLOCK_B), ("BLOCK_H", BLOCK_H), ("BLOCK_K", BLOCK_K), ("num_warps", num_warps)):
        if v is not None:
            cfg[k] = v
    per = 32 // R.bits
    bb, bh, bk = cfg["BLOCK_B"], cfg["BLOCK_H"], cfg["BLOCK_K"]
    if any(v & (v - 1) for v in (bb, bh, bk)) or bk % per or (bb != 1 and (bb < 16 or bh < 16 or bk < 16)):
        raise WeightOnlyError(f"fused_gru_direction: block sizes must be powers of two, BLOCK_K a multiple of {per}, "
                              f"and BLOCK_B 1 or >= 16 with BLOCK_H, BLOCK_K >= 16 (tl.dot); got {cfg}")
    if T * B >= 2 ** 31 or 2 * B * H >= 2 ** 31:
        raise WeightOnlyError(f"fused_gru_direction: T * B ({T * B}) and 2 * B * H ({2 * B * H}) must be below 2^31")
    out = torch.empty(T, B, H, dtype=torch.float32, device=dev)
    h = torch.empty(2, B, H, dtype=torch.float32, device=dev)  # the state's scratch: h0, then alternating
    h[0].copy_(h0)
    if T == 0 or B == 0 or H == 0:
        return out, h[0]
    gi = gi.contiguous()
    lengths = lengths.to(device=dev, dtype=torch.int32).contiguous()
    bias = b_hh if b_hh is not None else h  # not read without HAS_BIAS
    _gru_seq_kernel[(triton.cdiv(B, bb),)](
        gi, h, R.codes, R.scale, R.zp, bias, lengths, out, T, B, H, R.group,
        REVERSE=bool(reverse), HAS_BIAS=b_hh is not None, BITS=R.bits, ROUND=_ROUND[dtype], DOT=bb != 1,
        DOT_IN_FP32=INTERPRET and dtype == torch.bfloat16, ONE_GROUP=R.group % bk == 0,
        BLOCK_B=bb, BLOCK_H=bh, BLOCK_K=bk, num_warps=cfg["num_warps"])
    return out, h[T % 2]


def gru_forward(layers: Sequence[Sequence[WOLayer]], x: torch.Tensor, hx: Optional[torch.Tensor],
                dtype: torch.dtype, lengths: Optional[torch.Tensor] = None,
                kernel: str = "auto", blocks: Optional[dict] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """The weight-only GRU on x [T, B, I] (time-major) with Triton: W.x for the whole sequence,
    then the recurrence: ``kernel`` "fused" (one launch per layer direction), "step" (one launch
    per time step) or "auto" (choose_kernel); ``blocks`` overrides fused_blocks() (BLOCK_B,
    BLOCK_H, BLOCK_K, num_warps) for the fused kernel. Returns (output [T, B, D*H], h_n) in float32."""
    _need()
    T, B, _ = x.shape
    D = len(layers[0])
    H = layers[0][0].R.K
    if lengths is None:
        lengths = torch.full((B,), T, dtype=torch.int32, device=x.device)
    lengths = lengths.to(device=x.device, dtype=torch.int32)
    kind = choose_kernel(H, B, kernel)
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
            if kind == "fused":
                o, h = fused_gru_direction(gi, h0, p.R, b_hh, lengths, d == 1, dtype, **(blocks or {}))
            else:
                o, h = gru_direction(gi, h0, p.R, b_hh, lengths, d == 1, dtype)
            outs.append(o)
            h_n.append(h)
        inp = outs[0] if D == 1 else torch.cat(outs, -1)
    return inp, torch.stack(h_n)


class GraphedForward:
    """gru_forward replayed as a CUDA graph (the T step launches recorded once per input shape),
    so that a long sequence costs the GPU's launch latency per step instead of Triton's host-side
    launch time. Opt-in (WeightOnlyGRU.cuda_graph = True); on an H200 (2026-11-28) its replays equal
    the plain calls for both kernels (tests/test_weight_only.py, test_triton_on_cuda_matches_golden): inputs are copied into static buffers, the graph is replayed, the outputs are
    cloned. One graph per (T, B, input dtype, has h0, has lengths); the weights are read from the
    layers' buffers as they were at capture (replace the module's buffers -> call reset())."""

    def __init__(self):
        self._graphs = {}

    def reset(self) -> None:
        self._graphs.clear()

    def __call__(self, layers, x: torch.Tensor, hx: Optional[torch.Tensor], dtype: torch.dtype,
                 lengths: Optional[torch.Tensor] = None, kernel: str = "auto"):
        _need()
        if not x.is_cuda:
            raise WeightOnlyError("GraphedForward: CUDA tensors only")
        key = (tuple(x.shape), x.dtype, hx is not None, lengths is not None, dtype, kernel)
        entry = self._graphs.get(key)
        if entry is None:
            static = {"x": x.clone(), "hx": None if hx is None else hx.clone(),
                      "len": None if lengths is None else lengths.to(device=x.device, dtype=torch.int32).clone()}
            side = torch.cuda.Stream(device=x.device)
            side.wait_stream(torch.cuda.current_stream(x.device))
            with torch.cuda.stream(side):  # compile the kernels and warm the allocator outside the capture
                gru_forward(layers, static["x"], static["hx"], dtype, static["len"], kernel)
            torch.cuda.current_stream(x.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = gru_forward(layers, static["x"], static["hx"], dtype, static["len"], kernel)
            entry = self._graphs[key] = (graph, static, out)
        graph, static, out = entry
        static["x"].copy_(x)
        if hx is not None:
            static["hx"].copy_(hx)
        if lengths is not None:
            static["len"].copy_(lengths.to(device=x.device, dtype=torch.int32))
        graph.replay()
        return out[0].clone(), out[1].clone()
