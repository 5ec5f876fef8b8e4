"""The README's main job: the demo runs end to end under the emulator, for both arches."""

import pytest

from flyquant import demo


@pytest.mark.parametrize("arch", ["gfx950", "gfx942"])
def test_demo_passes_its_checks(arch, capsys):
    assert demo.main(["--arch", arch]) == 0
    out = capsys.readouterr().out
    assert f"compiled for {arch} run on the CPU" in out
    assert out.count("bit-exact") == 3 and "All checks passed" in out
    assert "moe_gemm2_a16w4_bf16_" in out and f"_{arch} ({arch})" in out
    # the MoE step is the whole layer: sorting, stage 1, stage 2 on flyquant's kernels
    assert "fused_moe" in out and "within the derived bound" in out
    assert "moe_sorting_" in out and "moe_gemm1_a16w4_silu_" in out
    # the training step's forward, dgrad and wgrad GEMMs ran on flyquant's grouped-GEMM kernels
    assert "MXFP8 training step" in out and "-> within" in out
    assert "mxfp8_grouped_mm_" in out and "mxfp8_grouped_mm_wgrad_" in out
    assert "GPT-OSS swap (transformers' GptOssForCausalLM" in out  # transformers is in the test extra


@pytest.mark.parametrize("variable, value, args, message", [
    ("FLYQUANT_ARCH", "gfx942", ["--arch", "gfx950"], "FLYQUANT_ARCH=gfx942 would compile every kernel for gfx942"),
    ("FLYQUANT_BACKEND", "reference", [], "FLYQUANT_BACKEND=reference: no kernel would run"),
])
def test_demo_refuses_variables_that_would_make_it_misreport(variable, value, args, message, monkeypatch, capsys):
    # FLYQUANT_ARCH had the demo print "compiled for gfx950" over gfx942 launches; the reference
    # backend had it compare the reference with itself and report every check passed
    monkeypatch.setenv(variable, value)
    with pytest.raises(SystemExit) as info:
        demo.main(args)
    assert info.value.code == 2 and message in capsys.readouterr().err
