"""The MXFP4 rows of bench/quantize.py (issue 14's targets), apart from its MXFP8 cases and driver.

Kinds, each through the public API (so the selector's choice runs) and checked byte for byte,
strides included, against flyquant.reference in the run:

    fp4_1x32      fq.mxfp4_quantize(x, axis=-1)                        rowwise
    fp4_32x1      fq.mxfp4_quantize(x, axis=0)                         columnwise (cast-transpose)
    fp4_dual      fq.mxfp4_quantize_dual(x)                            both, one read of x
    fp4_a4w4      fq.mxfp4_quantize(x, -1, scale_layout="mfma", shuffle="a4w4")   gemm_a4w4's layouts
    fp4_3d_a16w4  fq.mxfp4_quantize_3d(w, shuffle="a16w4")             (E, N, K) expert weights

Modes floor, rceil and even (aiter's dynamic_mxfp4_quant rounding; --quick runs only even).
Every MXFP4 case brings the MXFP8 1x32 case of the same 2D shape (a 3D shape flattened to
(E*N, K)) and the same mode (even: floor, whose scale even's is with one rounding add before
it), so that "wave-instructions per element <= our MXFP8 1x32's" is evaluated on each row, and
the MXFP8 case writing the same orientations (fp4_32x1: 32x1, fp4_dual: dual; the others 1x32
again), whose ratio is reported beside it ("vs fp8 same"; no target).

The minimum bytes (`bytes_moved`) are the input read once and each output tensor written once,
at the sizes the API returns them (trailing blocks padded to 32 elements; the "mfma" scale
layout padded to 256 rows and 8 columns, as aiter's e8m0_shuffle pads).
"""

from __future__ import annotations

import contextlib
import fractions
import math

import torch

import flyquant as fq
from flyquant import reference, select

KINDS_2D = ("fp4_1x32", "fp4_32x1", "fp4_dual", "fp4_a4w4")
KINDS_3D = ("fp4_3d_a16w4",)
KINDS = KINDS_2D + KINDS_3D
MODES = ("floor", "rceil", "even")
QUICK_MODES = ("even",)  # the mode aiter's Triton MXFP4 quantize (the --vs aiter peer) computes
FP8_MODE = {"floor": "floor", "rceil": "rceil", "even": "floor"}  # the MXFP8 1x32 row each mode is held to
# (axis, scale_layout) of each output the kind writes: what the minimum bytes count
OUTPUTS = {
    "fp4_1x32": ((-1, None),),
    "fp4_32x1": ((0, None),),
    "fp4_dual": ((-1, None), (0, None)),
    "fp4_a4w4": ((-1, "mfma"),),
    "fp4_3d_a16w4": ((-1, None),),
}
# modelled mode, shapes above --max-elements: the dimension kept whole (quantize.reduced_shape), the
# one each kind quantizes along: the a16w4 layout is tiled along K (its store coalescing depends on
# K), and aiter's wrapper picks its blocks by the length of the quantized dimension (the fp4_32x1 peer)
KEEP = {"fp4_32x1": "m", "fp4_3d_a16w4": "k"}


@contextlib.contextmanager
def waves_of_full_launch(fraction: fractions.Fraction):
    """Plan and run a reduced input (`fraction` of the full one's elements, exact: a float's
    rounding moved row_tiles' threshold across a whole wave count) with the full launch's
    wave length: the shuffles' waves grow while the launch keeps _mxfp4_shuffles.LONG_WAVES_PER_CU
    waves per CU, a threshold scaled here by the reduction, so the emulated launch's waves take
    the full one's steps (its per-element figures, not the reduced launch's)."""
    from flyquant.kernels import _mxfp4_shuffles as sh

    full = sh.LONG_WAVES_PER_CU
    sh.LONG_WAVES_PER_CU = full * fraction
    try:
        yield
    finally:
        sh.LONG_WAVES_PER_CU = full


MIN_TRAFFIC_KINDS = ("fp4_dual", "fp4_a4w4", "fp4_3d_a16w4")  # the dual and shuffled variants
TRAFFIC_TARGET = 1.02  # bytes moved within 2% of the minimum
PEER_TARGET = 0.6  # ours <= 0.6x the best Triton MXFP4 quantize's wave-instructions per element
TARGETS = (
    "wave-instructions per element <= our MXFP8 1x32's on the same shape",
    f"<= {PEER_TARGET}x the best peer Triton MXFP4 quantize's (--vs aiter)",
    f"global traffic <= {TRAFFIC_TARGET}x the minimum for {', '.join(MIN_TRAFFIC_KINDS)}",
)


def default_modes(quick: bool) -> tuple:
    return QUICK_MODES if quick else MODES


def api_call(kind: str, mode: str, x: torch.Tensor):
    if kind == "fp4_dual":
        return fq.mxfp4_quantize_dual(x, scaling_mode=mode)
    if kind == "fp4_3d_a16w4":
        return fq.mxfp4_quantize_3d(x, scaling_mode=mode, shuffle="a16w4")
    if kind == "fp4_a4w4":
        return fq.mxfp4_quantize(x, axis=-1, scaling_mode=mode, scale_layout="mfma", shuffle="a4w4")
    return fq.mxfp4_quantize(x, axis=OUTPUTS[kind][0][0], scaling_mode=mode)


def reference_call(kind: str, mode: str, x: torch.Tensor):
    if kind == "fp4_dual":
        return reference.mxfp4_quantize_dual(x, mode)
    if kind == "fp4_3d_a16w4":
        return reference.mxfp4_quantize_3d(x, mode, shuffle="a16w4")
    if kind == "fp4_a4w4":
        return reference.mxfp4_quantize(x, -1, mode, scale_layout="mfma", shuffle="a4w4")
    return reference.mxfp4_quantize(x, OUTPUTS[kind][0][0], mode)


def plan(kind: str, mode: str, x: torch.Tensor) -> select.Plan:
    if kind == "fp4_dual":
        return select.plan_mxfp4_quantize_dual(x, mode)
    if kind == "fp4_3d_a16w4":
        return select.plan_mxfp4_quantize(x, -1, mode, "a16w4", op="mxfp4_quantize_3d")
    if kind == "fp4_a4w4":
        return select.plan_mxfp4_quantize(x, -1, mode, "a4w4", scale_layout="mfma")
    return select.plan_mxfp4_quantize(x, OUTPUTS[kind][0][0], mode)


def bytes_moved(kind: str, shape: tuple, dtype: torch.dtype) -> int:
    """The input read once and every output written once, at the API's output sizes."""
    x = torch.empty(1, dtype=dtype, device="meta").expand(shape)  # shapes only: no memory
    outputs = [t for axis, layout in OUTPUTS[kind] for t in reference.mxfp4_quantize_empty(x, axis, layout)]
    return math.prod(shape) * dtype.itemsize + sum(t.numel() * t.element_size() for t in outputs)


# the MXFP8 kind writing the same orientations as an MXFP4 kind (the rest: rowwise, 1x32)
SAME_ORIENTATIONS = {"fp4_32x1": "32x1", "fp4_dual": "dual"}


def fp8_partners(kind: str, shape: tuple, mode: str) -> list[tuple]:
    """(kind, shape, mode) of the two MXFP8 cases an MXFP4 case is shown beside: 1x32, which issue
    14 holds every MXFP4 kind to, and the kind writing the same orientations (reported, no target)."""
    flat = (math.prod(shape[:-1]), shape[-1])
    return [(k, flat, FP8_MODE[mode]) for k in ("1x32", SAME_ORIENTATIONS.get(kind, "1x32"))]


def annotate(row: dict, fp8_rows: list) -> None:
    """Adds to an MXFP4 row our MXFP8 figures on the same shape (fp8_partners' rows, None where
    not measured): 1x32's, and the same orientations' (the best peer's: peers.annotate_best)."""
    for key, fp8_row in zip(("vs_fp8_1x32", "vs_fp8_same"), fp8_rows):
        if fp8_row and fp8_row.get("status") == "ok":
            row[key] = row["instr_per_element"] / fp8_row["instr_per_element"]
    if "vs_fp8_1x32" in row:
        row["fp8_1x32_instr_per_element"] = fp8_rows[0]["instr_per_element"]


def target_misses(row: dict) -> list[str]:
    """Issue 14's targets this MXFP4 row misses (annotate and peers.annotate_best first)."""
    misses = []
    if row.get("vs_fp8_1x32") is not None and row["vs_fp8_1x32"] > 1:
        misses.append(f"wave-instructions per element {row['vs_fp8_1x32']:.3f}x our MXFP8 1x32 "
                      f"{FP8_MODE[row['mode']]}'s on the same shape (target <= 1)")
    if row.get("vs_best_peer") is not None and row["vs_best_peer"] > PEER_TARGET:
        misses.append(f"wave-instructions per element {row['vs_best_peer']:.2f}x {row['best_peer']}'s "
                      f"(target <= {PEER_TARGET}x)")
    if row["kind"] in MIN_TRAFFIC_KINDS and row["traffic_vs_compulsory"] > TRAFFIC_TARGET:
        misses.append(f"global traffic {row['traffic_vs_compulsory']:.3f}x the minimum (target <= {TRAFFIC_TARGET})")
    return misses


def hardware_baselines(kind: str, mode: str) -> list:
    """[(name, callable(x) or None, why)]: aiter's Triton MXFP4 quantize where it has the case."""
    if kind not in ("fp4_1x32", "fp4_32x1") or mode != "even":
        return [("aiter triton", None, f"aiter's Triton MXFP4 quantize has no {kind} {mode} kernel")]
    try:
        from aiter.ops.triton.quant import dynamic_mxfp4_quant
    except Exception as exc:
        return [("aiter triton", None, f"{type(exc).__name__}: {exc}")]
    if kind == "fp4_1x32":
        return [("aiter triton", lambda x: dynamic_mxfp4_quant(x, "even"), None)]
    return [("aiter triton", lambda x: dynamic_mxfp4_quant(x.t(), "even"), None)]
