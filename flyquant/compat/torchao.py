"""torchao 0.18's FlyDSL MXFP8 quantize ops, served by flyquant.

Same names, signatures and return contracts as
``torchao.prototype.moe_training.kernels.mxfp8.quant.mxfp8_quantize_{2d_1x32,2d_32x1,3d}_flydsl``,
so torchao's MXFP8 MoE training can call flyquant without changing call sites. Differences, all
in the direction of doing more: both scale modes on gfx942 and gfx950, ``offs`` and
``blocked_scale_output`` are implemented (torchao 0.18 raises NotImplementedError), no M % 32
requirement beyond the quantized dimension, and CPU tensors work (reference or emulator).
``stage_count`` has no meaning on AMD (no TMA pipeline) and is accepted for parity.
"""

from __future__ import annotations

import torch

from .. import api
from ..formats import MX_BLOCK


def _mode(scaling_mode) -> str:
    # torchao passes strings; accept its ScaleCalculationMode enum too.
    return str(getattr(scaling_mode, "value", scaling_mode)).lower()


def _block(block_size: int) -> None:
    if block_size != MX_BLOCK:
        raise ValueError(f"block_size must be {MX_BLOCK} (the MX block), got {block_size}")


def mxfp8_quantize_2d_1x32_flydsl(
    x: torch.Tensor,
    block_size: int = 32,
    scaling_mode: str = "rceil",
    stage_count: int = 2,
    offs: torch.Tensor = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, K) -> e4m3fn data (M, K) row-major, e8m0 scales (M, K/32)."""
    _block(block_size)
    return api.mxfp8_quantize(x, axis=-1, scaling_mode=_mode(scaling_mode), offs=offs)


def mxfp8_quantize_2d_32x1_flydsl(
    x: torch.Tensor,
    block_size: int = 32,
    scaling_mode: str = "rceil",
    stage_count: int = 2,
    blocked_scale_output: bool = False,
    offs: torch.Tensor = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, K) -> e4m3fn data (M, K) with stride (1, M), e8m0 scales (K, M/32), or torchao's
    blocked (tcgen05) scales with blocked_scale_output=True (per token group when offs is given)."""
    _block(block_size)
    layout = "tcgen05" if blocked_scale_output else None
    return api.mxfp8_quantize(x, axis=0, scaling_mode=_mode(scaling_mode), scale_layout=layout, offs=offs)


def mxfp8_quantize_3d_flydsl(
    x: torch.Tensor,
    block_size: int = 32,
    scale_block_dim1: int = 32,
    scale_block_dim2: int = 1,
    scaling_mode: str = "rceil",
    stage_count: int = 2,
    blocked_scale_output: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(E, N, K) along N -> data stride (N*K, 1, N), scales (E, N/32, K) (or K/32 with
    scale_block_dim2=32), or torchao's blocked scales (E, rows * cols) with blocked_scale_output."""
    _block(block_size)
    if scale_block_dim1 != MX_BLOCK:
        raise ValueError(f"scale_block_dim1 must be {MX_BLOCK}, got {scale_block_dim1}")
    layout = "tcgen05" if blocked_scale_output else None
    return api.mxfp8_quantize_3d(x, scaling_mode=_mode(scaling_mode), scale_block_k=scale_block_dim2,
                                 scale_layout=layout)
