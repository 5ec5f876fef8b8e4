"""What each supported AMD Instinct architecture has, in one table.

Kernels, the selector, the toolchain's occupancy estimate and the benchmarks read these facts
from here; nothing else hard-codes them.
"""

from __future__ import annotations

from dataclasses import dataclass

WAVE_SIZE = 64
SIMDS_PER_CU = 4
# CDNA3/CDNA4: 512 registers per lane per SIMD, shared by VGPRs and AGPRs (unified file).
REGS_PER_SIMD_LANE = 512
REG_ALLOC_GRANULE = 8
MAX_WAVES_PER_SIMD = 8


@dataclass(frozen=True)
class ArchInfo:
    name: str
    product: str
    compute_units: int
    lds_bytes_per_cu: int
    fp8_flavour: str  # bytes the hardware FP8 conversions produce
    hw_fp4_to_bf16: bool  # v_cvt_scalef32_pk_bf16_fp4 exists
    hw_f32_to_bf16: bool  # v_cvt_pk_bf16_f32 exists (else LLVM rounds in integer ops)
    buffer_pk_add_bf16: bool  # buffer_atomic_pk_add_bf16 exists (else only the global one)
    ieee_minmax_f32: bool  # v_minimum3_f32 / v_maximum3_f32 exist (IEEE minimum / maximum: NaN in, NaN out)
    bf16_mfma: str  # the bf16 MFMA the GEMM feeds
    hbm_tb_per_s: float

    @property
    def fnuz_fp8(self) -> bool:
        """FP8 is FNUZ here (gfx942): 0x80 is NaN, not -0."""
        return self.fp8_flavour == "fnuz"


ARCHS = {
    "gfx942": ArchInfo(
        name="gfx942",
        product="MI300X",
        compute_units=304,
        lds_bytes_per_cu=64 * 1024,
        fp8_flavour="fnuz",
        hw_fp4_to_bf16=False,
        hw_f32_to_bf16=False,
        buffer_pk_add_bf16=False,
        ieee_minmax_f32=False,
        bf16_mfma="v_mfma_f32_16x16x16_bf16",
        hbm_tb_per_s=5.3,
    ),
    "gfx950": ArchInfo(
        name="gfx950",
        product="MI355X",
        compute_units=256,
        lds_bytes_per_cu=160 * 1024,
        fp8_flavour="ocp",
        hw_fp4_to_bf16=True,
        hw_f32_to_bf16=True,
        buffer_pk_add_bf16=True,
        ieee_minmax_f32=True,
        bf16_mfma="v_mfma_f32_16x16x32_bf16",
        hbm_tb_per_s=8.0,
    ),
}


def arch_info(arch: str) -> ArchInfo:
    """The table entry for `arch`, or a ValueError naming the supported ones."""
    try:
        return ARCHS[arch]
    except KeyError:
        raise ValueError(f"unsupported arch {arch!r}: flyquant kernels target {sorted(ARCHS)}") from None


def occupancy(arch: str, vgprs: int, agprs: int, lds_bytes: int, waves_per_workgroup: int) -> int:
    """Workgroups that fit on one CU at once, limited by registers and LDS."""
    info = arch_info(arch)
    # On gfx90a+ the AGPRs start at accum_offset (VGPRs rounded up to 4); allocation in granules.
    regs = -(-vgprs // 4) * 4 + agprs
    regs = max(REG_ALLOC_GRANULE, -(-regs // REG_ALLOC_GRANULE) * REG_ALLOC_GRANULE)
    waves_per_simd = min(MAX_WAVES_PER_SIMD, REGS_PER_SIMD_LANE // regs)
    by_regs = waves_per_simd * SIMDS_PER_CU // waves_per_workgroup
    by_lds = info.lds_bytes_per_cu // lds_bytes if lds_bytes else by_regs
    return min(by_regs, by_lds)
