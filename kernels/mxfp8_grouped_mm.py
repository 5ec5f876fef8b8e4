"""MXFP8 grouped GEMMs for MoE training (forward and dgrad; weight gradient): what they compute,
how the work is split, their configuration and torch-facing launchers. The FlyDSL kernel, how
each arch feeds its MFMAs and why every access stays inside its tensor: _grouped_mm_kernel.py.

Math. a (M, K) and b (E, N, K) hold OCP E4M3 (float8_e4m3fn) elements with one E8M0 scale per 32
along K (a_scale (M, K / 32), b_scale (E, N, K / 32), row-major: what fq.mxfp8_quantize(x) and a
3D quantize along K return); offs (E,) int32 are the token groups' end rows. For every group g and
row m in [offs[g - 1], offs[g]) (offs[-1] = 0):

    out[m, n] = sum_k a[m, k] 2^(sa[m, k / 32] - 127) * b[g, n, k] 2^(sb[g, n, k / 32] - 127)

in FP32, rounded once to out's dtype. Rows at or past offs[E - 1] are written as 0. E4M3 x E4M3
products and their power-of-two scales are exact in FP32 (up to underflow and overflow), so the
only roundings are the FP32 sums (differing in order from any reference) and the output's.

Work split. Grid (m-tiles of M, n-tiles of N): a workgroup computes rows [row0, row0 + tile_m) x a
tile_n range of columns, with waves_m x waves_n waves of 16-row x 16-column MFMA blocks. The
groups overlapping its rows are found on the device (offs never leaves it: no host
synchronisation): one ballot per 64 groups counts the groups that end at or before row0 and those
that end before the tile's end, and the workgroup computes its tile once per overlapping group,
with the rows of other groups masked (their A loads read 0, their stores are dropped). A group
boundary inside a tile costs one more pass over K for that tile.

Weight gradient (GroupedMMConfig.wgrad, launcher grouped_mm_wgrad): x (M, K) and y (M, N) quantized
along M in blocks of 32 (fq.mxfp8_quantize(t, axis=0): the (K, M) and (N, M) transposes
row-major, scales (K, M / 32) and (N, M / 32)), group sizes multiples of 32:

    out[g, n, k] = sum over rows m of group g of y[m, n] x[m, k]   (dequantized, FP32)

The same main loop with y^T as A (rows n), x^T as B (columns k) and the reduction over the
group's rows of M: grid (n-tiles, k-tiles, groups), the group's first row in the steps' scalar
offsets, a run-time step count, and the last partial step's chunks past the group masked (an
empty group's matrix is 0). Row-major scales only. gfx950: the forward's software pipeline (one
helper) over the run-time count: its loop runs every step pair but the last, whose loads past the
last step are clamped to it. Tiles: 128x128, or on gfx950 128x320 / 128x256 / 128x192 where the
selector finds them (select_grouped_mm.grouped_mm_wgrad_tiles).

Constraints (the selector sends other shapes to the reference, with the reason): K a multiple of
32, N a multiple of 16, every tensor (each expert's weights) below 2 GiB, on gfx942 K <= 43648.
gfx950's operands staged in LDS (the forward only): tile_m and tile_n multiples of 32 (8-row
groups, as many per wave), two stages of (tile_m + tile_n) 128-byte rows within the LDS (160 KiB:
tile_m + tile_n <= 640).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flyquant import toolchain
from flyquant.arch import arch_info

from ._grouped_mm_kernel import build_grouped_mm


@dataclass(frozen=True)
class GroupedMMConfig:
    arch: str
    out_dtype: torch.dtype
    n: int  # N (a multiple of 16)
    k: int  # K (a multiple of 32)
    experts: int
    tile_m: int = 64
    tile_n: int = 128
    waves_m: int = 2
    waves_n: int = 2
    scale_layout: str | None = None  # None (row-major) | "mfma" (aiter's e8m0_shuffle)
    wgrad: bool = False  # the weight-gradient GEMM (module doc): n = N (y's columns), k = K (x's)
    signed_zeros: bool = True  # False: no -0 bytes, NaN codes only in NaN-scale blocks (gfx942 reads them as they are)
    lds_stage: bool = False  # gfx950's forward: operands staged in LDS (_grouped_mm_kernel) instead of loaded by each wave

    def __post_init__(self):  # the promise matters only where FP8 is FNUZ: elsewhere one kernel for both
        if not arch_info(self.arch).fnuz_fp8:
            object.__setattr__(self, "signed_zeros", True)

    @property
    def name(self) -> str:
        out = "bf16" if self.out_dtype == torch.bfloat16 else "f32"
        kind = "mxfp8_grouped_mm_wgrad" if self.wgrad else "mxfp8_grouped_mm"
        return (f"{kind}_{self.arch}_{out}_n{self.n}_k{self.k}_e{self.experts}"
                f"_{self.tile_m}x{self.tile_n}_w{self.waves_m}x{self.waves_n}"
                f"{'_smfma' if self.scale_layout == 'mfma' else ''}{'' if self.signed_zeros else '_pz'}"
                f"{'_lds' if self.lds_stage else ''}")


@toolchain.launcher_cache
def _cached_launcher(cfg: GroupedMMConfig):
    return build_grouped_mm(cfg)


def grouped_mm(a, a_scale, b, b_scale, offs, *, arch: str, out=None, out_dtype=torch.bfloat16,
               scale_layout=None, tile_m: int = 128, tile_n: int = 128, signed_zeros: bool = True, lds_stage: bool = False):
    """Launch the MXFP8 grouped GEMM for `arch` on the tensors' device (CPU: the emulator), on
    torch's current stream, without a host synchronisation. Returns out (M, N).
    scale_layout None: a_scale (M, K/32), b_scale (E, N, K/32); "mfma": a_scale aiter's
    e8m0_shuffle of the (M, K/32) scales, b_scale that of each expert's (N, K/32), stacked."""
    info = arch_info(arch)
    m, k = a.shape
    experts, n, _ = b.shape
    a, b, a_scale, b_scale, offs = (t.contiguous() for t in (a, b, a_scale, b_scale, offs))
    if out is None:
        out = torch.empty(m, n, dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return out
    bs_expert_bytes = b_scale[0].numel()  # not stride(0): any if E = 1
    cfg = GroupedMMConfig(arch=info.name, out_dtype=out.dtype, n=n, k=k, experts=experts, tile_m=tile_m, tile_n=tile_n,
                          scale_layout=scale_layout, signed_zeros=signed_zeros, lds_stage=lds_stage)
    stream = toolchain.stream(a)
    with toolchain.target(info.name, a.device):
        _cached_launcher(cfg)(a.data_ptr(), a_scale.data_ptr(), b.data_ptr(), b_scale.data_ptr(), offs.data_ptr(),
                              out.data_ptr(), m, bs_expert_bytes, -(-m // tile_m), stream=stream)
    return out


def grouped_mm_wgrad(x, x_scale, y, y_scale, offs, *, arch: str, out=None, out_dtype=torch.bfloat16,
                     tile_m: int = 128, tile_n: int = 128, signed_zeros: bool = True):
    """Launch the MXFP8 weight-gradient grouped GEMM (module doc) for `arch`: out (E, N, K),
    out[g] = y[g rows]^T x[g rows], x (M, K) and y (M, N) quantized along M as
    fq.mxfp8_quantize(t, axis=0) returns them (data stride (1, M): the (K, M) and (N, M)
    transposes row-major, scales (K, M/32) and (N, M/32)); group sizes multiples of 32. On
    torch's current stream, no host synchronisation. Returns out."""
    info = arch_info(arch)
    m, k = x.shape
    n = y.shape[1]
    experts = offs.shape[0]
    if out is None:
        out = torch.empty(experts, n, k, dtype=out_dtype, device=x.device)
    if out.numel() == 0:
        return out
    x_t, y_t = x.t().contiguous(), y.t().contiguous()  # no copy for mxfp8_quantize(t, axis=0)'s outputs
    x_scale, y_scale, offs = x_scale.contiguous(), y_scale.contiguous(), offs.contiguous()
    cfg = GroupedMMConfig(arch=info.name, out_dtype=out.dtype, n=n, k=k, experts=experts, tile_m=tile_m, tile_n=tile_n,
                          wgrad=True, signed_zeros=signed_zeros)
    stream = toolchain.stream(x)
    with toolchain.target(info.name, x.device):
        _cached_launcher(cfg)(y_t.data_ptr(), y_scale.data_ptr(), x_t.data_ptr(), x_scale.data_ptr(), offs.data_ptr(),
                              out.data_ptr(), m, 0, -(-n // tile_m), stream=stream)
    return out
