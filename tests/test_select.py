"""The selector: where a call runs and why, forced backends, tuning table and overrides.

These tests are pure: they never launch a kernel.
"""

import json

import pytest
import torch

from flyquant import env, select, tuning


@pytest.fixture
def no_emulator(monkeypatch):
    """Plan as in a process where flyquant.emu was never enabled and no ROCm device exists."""
    monkeypatch.setattr(select, "_emulator_arch", lambda: None)
    monkeypatch.setattr(select, "rocm_device_present", lambda: False)


def test_cpu_without_emulator_uses_reference(no_emulator):
    t = select.resolve_target(torch.device("cpu"))
    assert t.arch is None and t.where == "cpu" and "flyquant.emu not enabled" in t.reason


def test_cpu_with_emulator_runs_kernels(monkeypatch):
    monkeypatch.setattr(select, "_emulator_arch", lambda: "gfx950")
    assert select.resolve_target(torch.device("cpu")).arch == "gfx950"
    monkeypatch.setenv("FLYQUANT_ARCH", "gfx942")
    t = select.resolve_target(torch.device("cpu"))
    assert (t.where, t.arch) == ("emulator", "gfx942")


def test_backend_reference_wins(monkeypatch):
    monkeypatch.setattr(select, "_emulator_arch", lambda: "gfx950")
    monkeypatch.setenv("FLYQUANT_BACKEND", "reference")
    t = select.resolve_target(torch.device("cpu"))
    assert t.arch is None and t.reason == "FLYQUANT_BACKEND=reference"


def test_forced_flydsl_on_cpu(no_emulator, monkeypatch):
    monkeypatch.setenv("FLYQUANT_BACKEND", "flydsl")
    with pytest.raises(select.BackendError, match="needs FLYQUANT_ARCH"):
        select.resolve_target(torch.device("cpu"))
    monkeypatch.setattr(select, "rocm_device_present", lambda: True)
    monkeypatch.setenv("FLYQUANT_ARCH", "gfx950")
    with pytest.raises(select.BackendError, match="ROCm device is present"):
        select.resolve_target(torch.device("cpu"))


def test_non_amd_device(monkeypatch, no_emulator):
    monkeypatch.setattr(torch.version, "hip", None)
    t = select.resolve_target(torch.device("cuda", 0))
    assert t.arch is None and "target AMD GPUs" in t.reason
    monkeypatch.setenv("FLYQUANT_BACKEND", "flydsl")
    with pytest.raises(select.BackendError, match="target AMD GPUs"):
        select.resolve_target(torch.device("cuda", 0))


def test_rocm_arch_detection(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", "7.0")
    monkeypatch.setattr(select, "_rocm_arch_of", lambda index: {0: "gfx942", 1: "gfx90a"}[index])
    assert select.resolve_target(torch.device("cuda", 0)) == select.Target("rocm", "gfx942", "ROCm device cuda:0 is gfx942")
    t = select.resolve_target(torch.device("cuda", 1))
    assert t.arch is None and "gfx90a has no flyquant kernels" in t.reason


def test_forced_arch_must_be_the_rocm_devices(monkeypatch):
    """FLYQUANT_ARCH other than the ROCm device's arch: kernels were compiled for FLYQUANT_ARCH and
    launched on the device (a gfx942 code object on a gfx950 or gfx90a), the plan saying "ROCm
    device cuda:0 is gfx950"; now an EnvError naming the variable, its value and the device's arch."""
    monkeypatch.setattr(torch.version, "hip", "7.0")
    monkeypatch.setattr(select, "_rocm_arch_of", lambda index: {0: "gfx942", 1: "gfx90a"}[index])
    monkeypatch.setenv("FLYQUANT_ARCH", "gfx942")
    assert select.resolve_target(torch.device("cuda", 0)).arch == "gfx942"  # the device's own: kept
    for index, arch in ((0, "gfx950"), (1, "gfx942")):
        monkeypatch.setenv("FLYQUANT_ARCH", arch)
        with pytest.raises(env.EnvError, match=f"FLYQUANT_ARCH='{arch}': expected the arch of ROCm device "
                                               f"cuda:{index}, {('gfx942', 'gfx90a')[index]}, or unset"):
            select.resolve_target(torch.device("cuda", index))
    monkeypatch.setenv("FLYQUANT_BACKEND", "reference")  # nothing compiled: the device's arch unread
    assert select.resolve_target(torch.device("cuda", 0)).arch is None


@pytest.mark.parametrize("var, value", [("FLYQUANT_BACKEND", "cuda"), ("FLYQUANT_ARCH", "gfx1100")])
def test_bad_environment_values(monkeypatch, var, value):
    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=var):
        select.resolve_target(torch.device("cpu"))


TUNED_SHAPE = {"tokens": 4, "topk": 4, "experts": 128, "model_dim": 2880, "inter_dim": 2880}


def test_tuning_table_and_overrides(tmp_path, monkeypatch):
    table = {"entries": [{"op": "moe_gemm2_a16w4", "arch": "gfx950",
                          "shape": TUNED_SHAPE, "config": {"tile_n": 256, "k_batch": 4}}]}
    path = tmp_path / "tuning.json"
    path.write_text(json.dumps(table))
    monkeypatch.setenv("FLYQUANT_TUNING", str(path))
    shuffled = dict(reversed(TUNED_SHAPE.items()))  # the key does not depend on the order
    assert tuning.tuned_config("moe_gemm2_a16w4", "gfx950", shuffled) == {"tile_n": 256, "k_batch": 4}
    assert tuning.tuned_config("moe_gemm2_a16w4", "gfx942", TUNED_SHAPE) == {}
    # token counts: the nearest tuned one's entry; the other fields: equal only
    assert tuning.tuned_config("moe_gemm2_a16w4", "gfx950", {**TUNED_SHAPE, "tokens": 8}) == {"tile_n": 256, "k_batch": 4}
    assert tuning.tuned_config("moe_gemm2_a16w4", "gfx950", {**TUNED_SHAPE, "topk": 1}) == {}
    monkeypatch.setenv("FLYQUANT_CONFIG", '{"tile_n": 64}')
    assert tuning.config_overrides() == {"tile_n": 64}
    monkeypatch.setenv("FLYQUANT_CONFIG", "[1]")
    with pytest.raises(ValueError, match="JSON object"):
        tuning.config_overrides()


def test_column_kernel_matrices_of_2_gib_go_to_the_reference(monkeypatch):
    """32x1, dual and 3D address one matrix with 32-bit offsets: a 2 GiB one is planned on the
    reference, with the reason (an error under FLYQUANT_BACKEND=flydsl); 1x32 launches such a
    tensor in row chunks. (Expanded views: shapes without the memory.)"""
    monkeypatch.setattr(select, "_emulator_arch", lambda: "gfx950")
    big = torch.empty(1, 1, dtype=torch.bfloat16).expand(32768, 32768)  # exactly 2 GiB
    for plan in (select.plan_mxfp8_quantize(big, 0, "rceil", None, None), select.plan_mxfp8_quantize_dual(big, "rceil"),
                 select.plan_mxfp8_quantize_3d(big.unsqueeze(0).expand(2, -1, -1), "rceil", 1, None)):
        assert plan.backend == "reference" and "below 2 GiB" in plan.reasons[-1], plan
    assert select.plan_mxfp8_quantize(big, 1, "rceil", None, None).backend == "flydsl"
    assert select.plan_mxfp8_quantize(big[:32736], 0, "rceil", None, None).backend == "flydsl"  # 32 rows less
    monkeypatch.setenv("FLYQUANT_BACKEND", "flydsl")
    with pytest.raises(select.BackendError, match="below 2 GiB"):
        select.plan_mxfp8_quantize_dual(big, "rceil")


def test_grouped_mm_outputs_of_2_gib_go_to_the_reference(monkeypatch):
    """A grouped GEMM whose output alone reaches 2 GiB (small operands: K 32) is planned on the
    reference: its offsets are 32-bit too. 2^30 outputs are 4 GiB in FP32 and 2 GiB in BF16; half
    as many rows fit."""
    from flyquant import select_grouped_mm

    monkeypatch.setattr(select, "_emulator_arch", lambda: "gfx950")
    cpu, m, n, k = torch.device("cpu"), 1 << 17, 1 << 13, 32
    for dtype in (torch.float32, torch.bfloat16):
        plan = select_grouped_mm.plan_grouped_mm_sizes("mxfp8_grouped_mm", cpu, dtype, m, n, k, 1)
        assert plan.backend == "reference" and "2 GiB" in plan.reasons[-1], plan
    assert select_grouped_mm.plan_grouped_mm_sizes("mxfp8_grouped_mm", cpu, torch.bfloat16, m // 2, n, k, 1).backend == "flydsl"
    # the weight gradient's output is (E, N, K): one expert's N x K
    plan = select_grouped_mm.plan_grouped_mm_sizes("mxfp8_grouped_mm_wgrad", cpu, torch.float32, 64, 1 << 14, 1 << 15, 2)
    assert plan.backend == "reference" and "2 GiB" in plan.reasons[-1], plan


def test_sorting_past_the_kernels_pair_limit_goes_to_the_reference(monkeypatch):
    """moe_sorting: MAX_PAIRS routed pairs are one launch, one more is the reference's."""
    from flyquant.kernels import moe_sorting as kernel

    monkeypatch.setattr(select, "_emulator_arch", lambda: "gfx950")
    for pairs, backend in ((kernel.MAX_PAIRS, "flydsl"), (kernel.MAX_PAIRS + 1, "reference")):
        ids = torch.zeros(1, 1, dtype=torch.int32).expand(pairs, 1)
        weights = torch.zeros(1, 1).expand(pairs, 1)
        assert select.plan_moe_sorting(ids, weights, 8, 32, None).backend == backend, pairs


def test_mxfp8_3d_plans_the_tiles_the_launcher_uses(monkeypatch):
    """3D plans carry the launch's configuration: N = 64 takes 64-row tiles with 32 x 1 blocks but
    128-row ones with 32 x 32 blocks; the transposed view with 32 x 32 blocks is the column kernel's
    3d_t variant on the contiguous (E, K, N) tensor, 64 (FP32: 32) rows x 128 columns."""
    monkeypatch.setattr(select, "_emulator_arch", lambda: "gfx950")
    w = torch.empty(1, dtype=torch.bfloat16).expand(2, 64, 256).contiguous()
    assert select.plan_mxfp8_quantize_3d(w, "rceil", 1, None).config["tile_rows"] == 64
    assert select.plan_mxfp8_quantize_3d(w, "rceil", 32, None).config["tile_rows"] == 128
    for dtype, rows in ((torch.bfloat16, 64), (torch.float32, 32)):
        view = torch.empty(2, 256, 96, dtype=dtype).transpose(1, 2)  # (E, N = 96, K = 256)
        plan = select.plan_mxfp8_quantize_3d(view, "floor", 32, "tcgen05")
        assert plan.kernel.startswith("mxfp8_3d_t_k32_tcgen05_floor") and plan.config["scale_block_k"] == 32
        assert (plan.config["tile_rows"], plan.config["tile_cols"], plan.config["grid"]) == (rows, 128, (1, 256 // rows, 2))
        assert select.plan_mxfp8_quantize_3d(view, "floor", 1, None).kernel.startswith("mxfp8_1x32")


def test_moe_plan_carries_waves(monkeypatch):
    """The plan names the waves per workgroup: the kernel's default for the chosen tiles and split
    (GPT-OSS-like, 1 token: 16x128 tiles, split-K 3, 2 waves), unless FLYQUANT_CONFIG forces it."""
    monkeypatch.setattr(select, "_emulator_arch", lambda: "gfx950")
    a2 = torch.empty(1, dtype=torch.bfloat16).expand(4, 2880)
    w2 = torch.empty(1, dtype=torch.uint8).expand(128, 3072, 1536)
    plan = select.plan_moe_gemm2_a16w4(a2, w2, 4, 16, 2880, 2880, torch.bfloat16, False)
    assert plan.config == {"tile_m": 16, "tile_n": 128, "k_batch": 3, "waves": 2}
    monkeypatch.setenv("FLYQUANT_CONFIG", '{"waves": 1}')
    plan = select.plan_moe_gemm2_a16w4(a2, w2, 4, 16, 2880, 2880, torch.bfloat16, False)
    assert plan.config["waves"] == 1 and "_w1x1_" in plan.kernel


def test_moe_block_m_off_the_row_tiles_goes_to_the_reference(monkeypatch):
    """A caller's block_m that no row tile divides (8) is the reference's, with the reason."""
    monkeypatch.setattr(select, "_emulator_arch", lambda: "gfx950")
    a2 = torch.empty(1, dtype=torch.bfloat16).expand(4, 2880)
    w2 = torch.empty(1, dtype=torch.uint8).expand(128, 3072, 1536)
    plan = select.plan_moe_gemm2_a16w4(a2, w2, 4, 8, 2880, 2880, torch.bfloat16, False)
    assert plan.backend == "reference" and "block_m must be a multiple of 16" in plan.reasons[-1]


@pytest.mark.parametrize("arch", ["gfx950", "gfx942"])
def test_mxfp8_plans_name_the_launched_kernel(arch):
    """explain()'s kernel name is the launched kernel's up to its tile suffixes, for every MXFP8
    quantize variant (scale layouts, 32 x 32 blocks, token groups, +0 zeros, the transposed 3D view:
    plans once left out the _k32, layout and _offs parts of the column kernels' names) and the
    MXFP4 ones."""
    import flyquant as fq
    import flyquant.emu as emu

    emu.enable(arch)
    x = torch.randn(256, 128).to(torch.bfloat16)
    w = torch.randn(2, 64, 256).to(torch.bfloat16)
    offs = torch.tensor([128, 256], dtype=torch.int32)  # 32x1 token groups: multiples of 128 rows
    calls = [(fq.mxfp8_quantize, (x,), {}), (fq.mxfp8_quantize, (x,), dict(scale_layout="mfma", signed_zeros=False)),
             (fq.mxfp8_quantize, (x, 0), {}), (fq.mxfp8_quantize, (x, 0), dict(offs=offs)),
             (fq.mxfp8_quantize, (x, 0), dict(offs=offs, scale_layout="tcgen05")),
             (fq.mxfp8_quantize, (x, 0), dict(scale_layout="mfma")), (fq.mxfp8_quantize_dual, (x,), {}),
             (fq.mxfp8_quantize_3d, (w,), {}), (fq.mxfp8_quantize_3d, (w,), dict(scale_block_k=32)),
             (fq.mxfp8_quantize_3d, (w,), dict(scale_layout="mfma")),
             (fq.mxfp8_quantize_3d, (w.transpose(1, 2).contiguous().transpose(1, 2),), dict(scale_block_k=32)),
             (fq.mxfp8_quantize_3d, (w.transpose(1, 2).contiguous().transpose(1, 2),), {}),
             # K (96) filling no whole row tile of the layout: the plain 1x32 kernel, scales laid out after it
             # (the plans named the layout kernel, "scales written in the mfma layout by the kernel")
             (fq.mxfp8_quantize_3d, (w[:, :, :96].transpose(1, 2).contiguous().transpose(1, 2),),
              dict(scale_layout="mfma")),
             (fq.mxfp8_quantize_3d, (w[:, :, :96].transpose(1, 2).contiguous().transpose(1, 2),),
              dict(scale_layout="tcgen05")),
             (fq.mxfp4_quantize, (x,), {}), (fq.mxfp4_quantize, (x, 0), {}),
             (fq.mxfp4_quantize, (x,), dict(scale_layout="mfma", shuffle="a4w4")), (fq.mxfp4_quantize_dual, (x,), {}),
             (fq.mxfp4_quantize_3d, (w,), dict(shuffle="a16w4", gate_up=True))]
    for fn, args, kwargs in calls:
        plan = fq.explain(fn, *args, **kwargs)
        with emu.record() as launches:
            fn(*args, **kwargs)
        assert plan.backend == "flydsl" and len(launches) == 1, (fn.__name__, kwargs, plan)
        kernel = launches[0].kernel
        assert kernel == plan.kernel or kernel.startswith(plan.kernel + "_"), (kernel, plan.kernel)
