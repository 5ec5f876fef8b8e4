"""A16W4 MoE stage 1's epilogue (kernels/moe_gemm1_a16w4.py's STAGE1_DOC): the activation of
each (gate, up) column pair from the accumulators, in FP32 from the hardware exp2 and reciprocal
(no device library), rounded to bf16 and stored to a2.

Two forms, chosen per wave at run time (stage1_epilogue):
- dense (store_activation): every lane computes its own accumulators' activations, 4 columns of
  each (gate, up) block pair of its token row, from registers;
- sparse (store_activation_sparse), when at most SPARSE_ROWS of the tile's rows hold a routed
  pair: the wave writes its live rows' g and u (and each row's a2 row and routing weight) to LDS,
  compacted to slots in row order, and reads them back two columns per lane, so the activation,
  the bias and the stores run on the live rows only. Routed tokens are spread over the experts,
  so at small and medium token counts most tiles are mostly padding rows (GPT-OSS, 16 tokens
  x top-4 over 128 experts: about one live row in a 16-row tile), and the dense form spent most
  of the epilogue on them. The form needs Gemm2Config.sparse_lds_bytes of LDS (about 9.5 KiB at
  tile_n 256); a config whose wk reduction leaves no room for it has the dense form only.
Both forms compute the same FP32 operations per element in the same order, so a nonzero finite
or infinite result has the same bits in either (tests/test_moe_gemm1_kernel.py). On gfx950 the
sparse form clamps with IEEE minimum / maximum, which return a NaN operand and order -0 below +0,
where the dense form puts back a canonical NaN and v_med3 does not order zeros: a NaN may differ
in sign and payload, and a zero in sign (swiglu_oai with limit = 0).
"""

from __future__ import annotations

import flydsl.expr as fx
from flydsl._mlir.dialects import arith, llvm
from flydsl.expr import range_constexpr, rocdl
from flydsl.expr.typing import T
from flydsl.expr.typing import Vector as Vec

from flyquant.formats import F32_MAX

from . import _mx_common as mx
from ._a16w4_common import (
    ACTIVATIONS, MFMA_MN, OOB, PERM_ODD_HALVES, SPARSE_ROWS, SPARSE_SLOTS, TOKEN_BITS, WAVE, _ballot, _load,
    _perm, _rsrc, _zext,
)
from ._mx_common import i32_bits


# ---- stage-1 activations from the hardware exp2 and reciprocal (no device library) ----------

LOG2E = 1.4426950408889634
GELU_2C = 2 * 0.7978845608028654  # 1 + tanh(y) = 2 sigmoid(2y), y = sqrt(2/pi) (g + 0.044715 g^3)
GELU_CUBIC = 0.044715


def _pairs(f, xs):
    """f on the 2-vectors (x0, x1), (x2, x3), .. of the lists in xs (the first one a list; the
    others lists too, or 2-vector constants): FP32 multiplies and adds on 2-vectors are
    v_pk_mul_f32 / v_pk_add_f32, one instruction per two elements."""
    out = []
    for j in range(0, len(xs[0]), 2):
        v = Vec(f(*[Vec.from_elements(x[j:j + 2], fx.Float32) if isinstance(x, list) else x for x in xs]))
        out += [fx.Float32(v[0]), fx.Float32(v[1])]
    return out


def _any_nonfinite_pair(accs):
    """Whether an element of the 4 x f32 vectors `accs` ((g, u) blocks in turn) may be NaN or Inf:
    one packed FMA t = g u + t per two elements (NaN in, NaN out; an Inf gives Inf or NaN, and so
    may an overflow of finite values: a false alarm costs only the exact branch), then whether
    t0 + t1 is not finite."""
    t = Vec.filled(2, 0.0, fx.Float32)
    for j in range(0, len(accs), 2):
        g, u = Vec(accs[j]), Vec(accs[j + 1])
        for h in range(2):
            pair = lambda v: Vec.from_elements([v[2 * h], v[2 * h + 1]], fx.Float32)  # noqa: E731
            t = Vec(fx.math.fma(pair(g), pair(u), t))
    s = fx.Float32(t[0]) + fx.Float32(t[1])
    d = (s - s).ir_value()  # 0, or NaN when s is not finite
    return fx.Boolean(arith.cmpf(arith.CmpFPredicate.UNO, d, d))


def _sigmoids(zs, scale: float):
    """sigmoid(scale * z) per element of zs = 1 / (1 + 2^(z * (-scale log2 e))) by v_exp_f32 and
    v_rcp_f32, the two constants folded into one multiply: +-inf give 1 / 0 exactly, NaN stays
    NaN. The multiply and the add are packed."""
    c = Vec.filled(2, -scale * LOG2E, fx.Float32)
    one = Vec.filled(2, 1.0, fx.Float32)
    e = [fx.Float32(rocdl.exp2(T.f32, z.ir_value())) for z in _pairs(lambda z: z * c, [zs])]
    return [fx.Float32(rocdl.rcp(T.f32, d.ir_value())) for d in _pairs(lambda d: d + one, [e])]


def _activation(kind: str, gs, us, alpha: float, limit: float, finite: bool = False, nan_clamps: bool = False):
    """act(g, u) in FP32 for the lists gs, us (flyquant.reference.moe_activation's formulas), the
    multiplies and adds on element pairs. swiglu_oai: (u + 1) g s as fma(u, g s, g s) (one
    rounding fewer than the formula's), which is inf - inf = NaN for u < 0 where t = g s is
    infinite and the formula gives an infinity: t is finite or NaN unless g = +inf passes the clamp
    (limit = inf) or g = -inf has a sigmoid of 1 (alpha < 0), so those configurations take
    (u + 1) t. Its clamps are v_med3_f32, which return another operand for a NaN, so an unordered
    compare of (g, u) per element puts the NaN back, and +-inf clamp as torch's do; `finite`: the
    caller knows every g and u is finite, so neither is needed and g's lower bound can be -FLT_MAX
    (a med3 with -inf is folded to a minnum, which adds a canonicalizing v_max per element);
    `nan_clamps` (gfx950): the clamps are IEEE minimum and maximum (v_minimum3_f32 /
    v_maximum3_f32), which return a NaN operand, so no compare is needed."""
    mul = lambda a, b: a * b  # noqa: E731
    if kind == "silu":
        return _pairs(mul, [_pairs(mul, [gs, _sigmoids(gs, 1.0)]), us])
    if kind == "gelu":  # g (g^2 c + 1) = g + c g^3: one multiply-add
        cubic, one = Vec.filled(2, GELU_CUBIC, fx.Float32), Vec.filled(2, 1.0, fx.Float32)
        zs = _pairs(lambda g: g * (g * g * cubic + one), [gs])
        return _pairs(mul, [_pairs(mul, [gs, _sigmoids(zs, GELU_2C)]), us])
    if kind == "swiglu_oai":
        lim = fx.Float32(limit).ir_value()
        one = Vec.filled(2, 1.0, fx.Float32)
        if limit == float("inf") or alpha < 0:  # t may be infinite (docstring)
            gate_up = lambda u, t: (u + one) * t  # noqa: E731
        else:
            gate_up = lambda u, t: fx.math.fma(u, t, t)  # noqa: E731
        if nan_clamps:
            gc = [fx.Float32(arith.minimumf(g.ir_value(), lim)) for g in gs]
            uc = [fx.Float32(arith.maximumf(arith.minimumf(u.ir_value(), lim), fx.Float32(-limit).ir_value())) for u in us]
        else:
            med3 = lambda x, lo: fx.Float32(rocdl.fmed3(T.f32, x.ir_value(), fx.Float32(lo).ir_value(), lim))  # noqa: E731
            gc = [med3(g, -F32_MAX if finite else float("-inf")) for g in gs]
            uc = [med3(u, -limit) for u in us]
        act = _pairs(gate_up, [uc, _pairs(mul, [gc, _sigmoids(gc, alpha)])])
        if not (finite or nan_clamps):
            nan = [fx.Boolean(arith.cmpf(arith.CmpFPredicate.UNO, g.ir_value(), u.ir_value())) for g, u in zip(gs, us)]
            act = [n.select(fx.Float32(float("nan")), a) for n, a in zip(nan, act)]
        return act
    raise ValueError(f"activation must be one of {ACTIVATIONS}, got {kind!r}")


def _bf16_words_not_nan(vals):
    """bf16(v) of an even number of FP32 values none of which is NaN, two per dword (nearest even:
    bits + 0x7FFF + bit 16, then the high halves by v_perm_b32). Without v_cvt_pk_bf16_f32
    (gfx942) LLVM's conversion also quiets NaN: 5.5 instructions per element, this 2.5. +-Inf
    stays +-Inf (its mantissa is 0, so the carry never reaches the exponent)."""
    rounded = []
    for v in vals:
        b = v.bitcast(fx.Int32)
        rounded.append(b + i32_bits(0x7FFF) + (b.shrui(fx.Int32(16)) & fx.Int32(1)))
    return [_perm(rounded[i + 1], rounded[i], PERM_ODD_HALVES) for i in range(0, len(vals), 2)]


def store_activation(accs, toks, rids, live, row0, col_wave, kl, l16, sorted_weights, ids_bytes, out, out_bytes,
                     mb: int, nb: int, topk: int, n_cols: int, n_tail: bool, out_row_bytes: int, apply_weights: bool,
                     act: str, alpha: float, limit: float, hw_bf16: bool):
    """Stage 1's epilogue: a2[t * topk + slot, j] = bf16(act(g_j, u_j) (* w_r)) from registers (the
    caller has added the bias to g and u).

    The wave's nb 16-column blocks come in (gate, up) pairs (virtual blocks 2j, 2j + 1 of the
    gate_up shuffle are gate rows and up rows 16j .. 16j + 15), so lane (kl, l16) holds g and u
    of the same four output columns 16j + 4kl .. + 3 of token row l16: the activation needs no
    exchange. Stores are 8 bytes (4 bf16) per lane and pair, through a buffer over a2; a row
    without a pair and a pair past n_cols (2 inter_dim) get the OOB offset (the store is dropped).
    swiglu_oai's clamps drop a NaN and its finite form is cheaper (_activation), so the words
    take that form unless a packed FMA chain over every (g, u) of the wave meets a NaN or an
    Inf: that rare branch puts NaN back per element and clamps Inf. The finite form's values are
    not NaN (weights, which may be, aside), so without `hw_bf16` it rounds them to bf16 in fewer
    integer ops (_bf16_words_not_nan)."""
    gcol = col_wave.shrui(fx.Int32(1)) + kl * 4  # this lane's first output column of the wave's pair 0
    n_pairs = nb // 2
    wts = []
    if apply_weights:
        w_rsrc_rows = _rsrc(sorted_weights, ids_bytes)
        wts = [_load(w_rsrc_rows, (row0 + m * MFMA_MN + l16) << 2, 0, 1).bitcast(fx.Float32) for m in range_constexpr(mb)]

    def words(finite):
        """The bf16 pairs of every (row block, pair): 2 dwords each, in (row block, pair) order."""
        out_words = []
        for m in range_constexpr(mb):
            for p in range_constexpr(n_pairs):
                g, u = Vec(accs[m * nb + 2 * p]), Vec(accs[m * nb + 2 * p + 1])
                vals = _activation(act, [fx.Float32(g[i]) for i in range_constexpr(4)],
                                   [fx.Float32(u[i]) for i in range_constexpr(4)], alpha, limit, finite)
                if apply_weights:
                    vals = [v * wts[m] for v in vals]
                if finite and act == "swiglu_oai" and not (apply_weights or hw_bf16):
                    out_words += _bf16_words_not_nan(vals)
                else:
                    packed = Vec(Vec.from_elements(vals, fx.Float32).to(fx.BFloat16).bitcast(fx.Int32))
                    out_words += [packed[0], packed[1]]
        return out_words

    if act == "swiglu_oai":
        odd = _any_nonfinite_pair(accs)
        packed = [fx.Int32(v) for v in mx.if_else(mx.wave_any(odd.ir_value()), lambda: words(False), lambda: words(True),
                                                  types=[T.i32] * (2 * mb * n_pairs))]
    else:
        packed = words(True)
    out_rsrc = _rsrc(out, out_bytes)
    for m in range_constexpr(mb):
        a2_row = toks[m] * topk + rids[m].shrui(fx.Int32(TOKEN_BITS))
        row_off = live[m].select(a2_row * out_row_bytes + gcol * 2, fx.Int32(OOB))
        for p in range_constexpr(n_pairs):
            off = row_off
            if n_tail:  # a pair past n_cols (wave-uniform): dropped
                off = (col_wave + 2 * p * MFMA_MN < n_cols).select(row_off, fx.Int32(OOB))
            w = 2 * (m * n_pairs + p)
            mx.store(Vec.from_elements(packed[w:w + 2], fx.Int32), out_rsrc, off + p * MFMA_MN * 2)


# ---- the sparse form ----------------------------------------------------------------------------

def _lds_f32(vec, addr):
    llvm.StoreOp(vec, mx.lds_ptr(addr.ir_value()), alignment=16)


def store_activation_sparse(accs, toks, rids, live, masks, counts, lane, col_wave, kl, l16, wave_lds,
                            sorted_weights, row0, ids_bytes, out, out_bytes, bias_cols, mb: int, nb: int, topk: int,
                            n_cols: int, n_tail: bool, out_row_bytes: int, apply_weights: bool, act: str,
                            alpha: float, limit: float, nan_clamps: bool):
    """Stage 1's epilogue for a tile of at most SPARSE_ROWS live rows (module docstring). masks,
    counts: the live rows of each 16-row block (wave-uniform bit masks by l16, and their sizes);
    wave_lds: this wave's LDS (sparse_lds_bytes / wn bytes); bias_cols(c): the bias of the gate and
    up columns c, c + 1 of the wave (2-vectors of f32), or None. A live row's rank r among the
    tile's live rows is its slot: g of wave column j at slot r, word j, u at word W + j (W = the
    wave's nb / 2 * 16 output columns), and the slot's a2 row (its byte offset) and weight after the
    SPARSE_SLOTS slots. Iteration i, lane L reads slot i * 128 / W + L / (W / 2) at columns c,
    c + 1 = 2 (L % (W / 2)): with W <= 128 (MAX_WAVE_N gives 64), c is the same in every
    iteration."""
    width = nb // 2 * MFMA_MN
    half = width // 2  # lanes per slot in an iteration
    if half > WAVE:
        raise ValueError(f"the sparse epilogue takes at most {2 * WAVE} output columns per wave, got {width}")
    slot_bytes = 8 * width
    info = wave_lds + SPARSE_SLOTS * slot_bytes
    info_dwords = 2 if apply_weights else 1
    if apply_weights:
        w_rsrc = _rsrc(sorted_weights, ids_bytes)
    # every slot's a2 row offset starts past the buffer (lanes past the slots: the spare one), so a
    # slot past the live rows stores nothing without a compare per iteration; live rows overwrite theirs
    mx.lds_store(fx.Int32(OOB), (info + fx.min(lane, fx.Int32(SPARSE_ROWS)) * 16).ir_value())
    before = fx.Int32(0)
    for m in range_constexpr(mb):
        rank = fx.Int32(fx.math.ctpop(masks[m] & ((fx.Int32(1) << l16) - 1))) + before  # v_bfe, v_bcnt
        slot = live[m].select(rank, fx.Int32(SPARSE_ROWS))
        at = wave_lds + slot * slot_bytes + kl * 16
        for p in range_constexpr(nb // 2):
            _lds_f32(accs[m * nb + 2 * p], at + p * 4 * MFMA_MN)
            _lds_f32(accs[m * nb + 2 * p + 1], at + (width + p * MFMA_MN) * 4)
        words = [(toks[m] * topk + rids[m].shrui(fx.Int32(TOKEN_BITS))) * out_row_bytes]
        if apply_weights:
            words.append(_load(w_rsrc, (row0 + m * MFMA_MN + (lane & (MFMA_MN - 1))) << 2, 0, 1))
        mx.lds_store(Vec.from_elements(words, fx.Int32) if apply_weights else words[0], (info + slot * 16).ir_value())
        before = before + counts[m]
    mx.lds_exchange_fence()

    c = (lane & (half - 1)) * 2
    col_ok = None
    if n_tail:  # a pair past n_cols: dropped
        col_ok = col_wave + (c.shrui(fx.Int32(4)) << 5) < n_cols
    biases = bias_cols(c) if bias_cols is not None else None
    out_rsrc = _rsrc(out, out_bytes)
    col_bytes = ((col_wave.shrui(fx.Int32(1)) + c) * 2)
    rows_per_iter = 2 * WAVE // width
    for i in range_constexpr(-(-SPARSE_ROWS // rows_per_iter)):

        def body(i=i):
            s = lane.shrui(fx.Int32(half.bit_length() - 1)) + i * rows_per_iter
            at = wave_lds + s * slot_bytes + c * 4
            g = Vec(mx.lds_load(2, at.ir_value())).bitcast(fx.Float32)
            u = Vec(mx.lds_load(2, (at + width * 4).ir_value())).bitcast(fx.Float32)
            row = mx.lds_load(info_dwords, (info + s * 16).ir_value())
            if biases is not None:
                g, u = Vec(g + biases[0]), Vec(u + biases[1])
            vals = _activation(act, [fx.Float32(g[0]), fx.Float32(g[1])], [fx.Float32(u[0]), fx.Float32(u[1])],
                               alpha, limit, nan_clamps=nan_clamps)
            off = fx.Int32(Vec(row)[0] if apply_weights else row) + col_bytes  # past the buffer: dropped
            if apply_weights:
                wt = fx.Int32(Vec(row)[1]).bitcast(fx.Float32)
                vals = [v * wt for v in vals]
            if n_tail:
                off = col_ok.select(off, fx.Int32(OOB))
            packed = Vec(Vec.from_elements(vals, fx.Float32).to(fx.BFloat16).bitcast(fx.Int32))
            mx.store(packed[0], out_rsrc, off)

        mx.if_then((fx.Int32(i * rows_per_iter) < before).ir_value(), body) if i else body()


def stage1_epilogue(accs, with_bias, toks, rids, live, lane, col_wave, kl, l16, wave_lds, sorted_weights, row0,
                    ids_bytes, out, out_bytes, bias_cols, mb: int, nb: int, topk: int, n_cols: int, n_tail: bool,
                    out_row_bytes: int, apply_weights: bool, act: str, alpha: float, limit: float, hw_bf16: bool,
                    nan_clamps: bool):
    """Stage 1's epilogue (module docstring): the sparse form when wave_lds is given (the launcher
    has the LDS for it) and at most SPARSE_ROWS of the tile's rows are live, else the dense one on
    with_bias(accs)."""

    def dense():
        store_activation(with_bias(accs), toks, rids, live, row0, col_wave, kl, l16, sorted_weights, ids_bytes, out,
                         out_bytes, mb, nb, topk, n_cols, n_tail, out_row_bytes, apply_weights, act, alpha, limit,
                         hw_bf16)

    if wave_lds is None:
        dense()
        return
    # live depends on the row (l16) only: the ballot's low 16 bits are the block's row mask
    masks = [fx.Int32(_ballot(live[m])) & 0xFFFF for m in range_constexpr(mb)]
    counts = [fx.Int32(fx.math.ctpop(mask)) for mask in masks]
    total = counts[0]
    for n in counts[1:]:
        total = total + n

    def sparse():
        store_activation_sparse(accs, toks, rids, live, masks, counts, lane, col_wave, kl, l16, wave_lds,
                                sorted_weights, row0, ids_bytes, out, out_bytes, bias_cols, mb, nb, topk, n_cols,
                                n_tail, out_row_bytes, apply_weights, act, alpha, limit, nan_clamps)

    mx.if_else((total <= SPARSE_ROWS).ir_value(), sparse, dense)


def bias_cols(bias, bias_stride, expert, col_wave, row_elems: int, bias_bytes: int):
    """The sparse form's bias: c -> the expert's bias at the gate columns (col_wave / 2 + c, + 1)
    and the up columns row_elems / 2 past them (2-vectors of f32, bf16 widened exactly)."""
    b_rsrc = _rsrc(bias + _zext(expert) * _zext(bias_stride) * bias_bytes, fx.Int64(row_elems * bias_bytes))

    def at(c):
        col = col_wave.shrui(fx.Int32(1)) + c
        pairs = []
        for first in (0, row_elems // 2):
            if bias_bytes == 4:
                w = _load(b_rsrc, (col + first) * 4, 0, 2)
                vals = [w[0].bitcast(fx.Float32), w[1].bitcast(fx.Float32)]
            else:  # bf16 = the high half of an f32
                w = _load(b_rsrc, (col + first) * 2, 0, 1)
                vals = [(w << 16).bitcast(fx.Float32), (w & i32_bits(0xFFFF0000)).bitcast(fx.Float32)]
            pairs.append(Vec.from_elements(vals, fx.Float32))
        return pairs

    return at
