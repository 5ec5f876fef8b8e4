"""Every kernel builder's configurations compile to distinct FlyDSL cache entries.

FlyDSL's compile cache (in memory and on disk) keys a @flyc.jit launcher on its source, its
helpers' sources and the scalar values (int, str, bool, ...) its functions close over; other
objects in a closure, such as a config dataclass, are not part of the key. A builder that read a
config field only through such an object inside the kernel would let two configurations that
differ in that field share one binary: the second would silently run the first's code. (The
grouped GEMM's signed_zeros did, until it became a scalar local.) So for each builder, changing
any one field must change the key.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from flydsl.compiler import jit_function

from flyquant.kernels import _a16w4_common as a16w4
from flyquant.kernels import _a16w4_main_loop as main_loop
from flyquant.kernels import _mx_col, moe_sorting, mxfp4_quantize, mxfp4_quantize_cols, mxfp4_quantize_dual
from flyquant.kernels import mxfp8_grouped_mm, mxfp8_quantize_2d


def cache_key(launcher) -> str:
    """The key FlyDSL files a builder's fresh @flyc.jit launcher under."""
    return jit_function._jit_function_cache_key(launcher.func)


def assert_distinct(build, base: dict, variants: list[dict]) -> None:
    keys = {cache_key(build(**base))}
    for change in variants:
        key = cache_key(build(**{**base, **change}))
        assert key not in keys, f"{build.__name__}: {change} compiles to a cache key seen before"
        keys.add(key)


def config_builder(builder, config_cls):
    def build(**fields):
        return builder(config_cls(**fields))

    build.__name__ = builder.__name__
    return build


GEMM2_BASE = dict(arch="gfx950", out_dtype=torch.bfloat16, tile_m=16, tile_n=128, k_batch=1, wn=2, wk=1,
                  model_dim=256, inter_dim=1024, w_n=256, w_k=1024, a_stride=1024, topk=4, block_m=16,
                  apply_weights=True, bias_dtype=None, stage=2, activation="", out_stride=256)
GEMM1_BASE = {**GEMM2_BASE, "stage": 1, "activation": "swiglu_oai", "apply_weights": False, "out_stride": 128}


def test_every_field_of_a_config_is_in_the_key():
    fields = {f.name for f in dataclasses.fields(mxfp8_grouped_mm.GroupedMMConfig)}
    grouped = [dict(arch="gfx950"), dict(out_dtype=torch.float32), dict(n=512), dict(k=2048), dict(experts=3),
               dict(tile_m=128), dict(tile_n=256), dict(waves_m=1), dict(waves_n=1), dict(scale_layout="mfma"),
               dict(wgrad=True), dict(signed_zeros=False), dict(arch="gfx950", lds_stage=True)]
    assert {k for v in grouped for k in v} == fields  # a new field needs a case here
    assert_distinct(config_builder(mxfp8_grouped_mm.build_grouped_mm, mxfp8_grouped_mm.GroupedMMConfig),
                    dict(arch="gfx942", out_dtype=torch.bfloat16, n=256, k=1024, experts=2), grouped)

    build = config_builder(main_loop.build_moe_gemm2_a16w4, a16w4.Gemm2Config)
    stage2 = [dict(arch="gfx942"), dict(out_dtype=torch.float32), dict(tile_m=32), dict(tile_n=256), dict(k_batch=2),
              dict(wn=1), dict(wk=2), dict(model_dim=512), dict(inter_dim=960), dict(w_n=512), dict(w_k=2048),
              dict(a_stride=2048), dict(topk=2), dict(block_m=32), dict(apply_weights=False),
              dict(bias_dtype=torch.bfloat16), dict(bias_dtype=torch.float32), dict(windowed=True),
              dict(out_stride=512)]
    stage1 = [dict(activation="silu"), dict(activation="gelu"), dict(alpha=1.5), dict(limit=6.0),
              dict(apply_weights=True), dict(stage=2, activation="")]
    assert {k for v in stage2 + stage1 for k in v} == {f.name for f in dataclasses.fields(a16w4.Gemm2Config)}
    assert_distinct(build, GEMM2_BASE, stage2)
    assert_distinct(build, GEMM1_BASE, stage1)

    sort_fields = {f.name for f in dataclasses.fields(moe_sorting.SortSpec)}
    sorting = [dict(arch="gfx942"), dict(experts=16), dict(topk=2), dict(block_m=32), dict(id_bytes=8),
               dict(weight="bf16"), dict(mask_bytes=1), dict(waves=2)]
    assert {k for v in sorting for k in v} == sort_fields
    assert_distinct(config_builder(moe_sorting.build_moe_sorting, moe_sorting.SortSpec),
                    dict(arch="gfx950", experts=8, topk=4, block_m=16, id_bytes=4, weight="f32", mask_bytes=0,
                         waves=4), sorting)


@pytest.mark.parametrize("build, base, variants", [
    (mxfp8_quantize_2d.build_1x32, dict(arch="gfx942", dtype="bf16", mode="floor"),
     [dict(arch="gfx950"), dict(dtype="fp16"), dict(dtype="fp32"), dict(mode="rceil"), dict(scale_layout="mfma"),
      dict(scale_layout="tcgen05"), dict(waves=2), dict(signed_zeros=False)]),
    (_mx_col.build_col, dict(arch="gfx942", dtype="bf16", mode="floor", kind="32x1"),
     [dict(arch="gfx950"), dict(dtype="fp32"), dict(mode="rceil"), dict(kind="3d"), dict(kind="dual"),
      dict(scale_layout="mfma"), dict(grouped=True), dict(waves=2), dict(tile_rows=64), dict(signed_zeros=False)]),
    (mxfp4_quantize.build_rows, dict(arch="gfx942", dtype="bf16", mode="floor", tail=False),
     [dict(arch="gfx950"), dict(dtype="fp16"), dict(mode="even"), dict(tail=True), dict(shuffle="a16w4"),
      dict(shuffle="a16w4_gate_up"), dict(shuffle="a4w4", k_align=128), dict(waves=2)]),
    (mxfp4_quantize.build_rows, dict(arch="gfx950", dtype="bf16", mode="floor", tail=False, shuffle="a4w4", k_align=256),
     [dict(k_align=128), dict(k_align=64), dict(scale_layout="mfma"), dict(padded=True)]),
    (mxfp4_quantize_cols.build_cols, dict(arch="gfx942", dtype="bf16", mode="floor", odd=False),
     [dict(arch="gfx950"), dict(dtype="fp32"), dict(mode="rceil"), dict(odd=True), dict(waves=2)]),
    (mxfp4_quantize_dual.build_dual, dict(arch="gfx942", dtype="bf16", mode="floor", tail=False),
     [dict(arch="gfx950"), dict(dtype="fp16"), dict(mode="even"), dict(tail=True)]),
], ids=["mxfp8_1x32", "mxfp8_col", "mxfp4_rows", "mxfp4_rows_a4w4", "mxfp4_cols", "mxfp4_dual"])
def test_every_builder_argument_is_in_the_key(build, base, variants):
    assert_distinct(build, base, variants)
