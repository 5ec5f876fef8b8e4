"""Configuration and input hardening (issue 21, findings 10-12): every FLYQUANT_* variable and
config file is checked when read, with an error naming the variable, the bad value and the
expected form; the kernel cache is private to its user; launching is thread-safe.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

import flyquant as fq
from flyquant import env, reference, select

# --- offs ------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["reference", "flydsl"])
@pytest.mark.parametrize("axis, scale_layout", [(0, "tcgen05"), (0, None), (-1, None)])
def test_non_contiguous_offs_is_refused_on_both_backends(monkeypatch, backend, axis, scale_layout):
    """offs as a strided view ([128, 256] every other element) is refused by name on both
    backends (the 32x1 + tcgen05 kernel used to fail inside FlyDSL); its contiguous copy works."""
    monkeypatch.setenv("FLYQUANT_BACKEND", backend)
    x = torch.randn(256, 64, dtype=torch.bfloat16)
    offs = torch.tensor([128, 0, 256, 0], dtype=torch.int32)[::2]
    assert fq.explain(fq.mxfp8_quantize, x, axis=axis, scale_layout=scale_layout).backend == backend
    with pytest.raises(ValueError, match=r"offs must be contiguous \(stride 1\), got stride 2"):
        fq.mxfp8_quantize(x, axis=axis, scale_layout=scale_layout, offs=offs)
    data, scales = fq.mxfp8_quantize(x, axis=axis, scale_layout=scale_layout, offs=offs.contiguous())
    ref_data, ref_scales = reference.mxfp8_quantize(x, axis, "rceil", scale_layout, offs.contiguous())
    torch.testing.assert_close(data.view(torch.uint8), ref_data.view(torch.uint8), rtol=0, atol=0)
    torch.testing.assert_close(scales.view(torch.uint8), ref_scales.view(torch.uint8), rtol=0, atol=0)


# --- FLYQUANT_BACKEND / FLYQUANT_ARCH / unknown variables --------------------------------------


@pytest.mark.parametrize("var, value, expected", [
    ("FLYQUANT_BACKEND", "cuda", "one of auto|reference|flydsl"),
    ("FLYQUANT_ARCH", "gfx1100", "one of gfx942|gfx950"),
])
def test_bad_choice_names_variable_value_and_choices(monkeypatch, var, value, expected):
    monkeypatch.setenv(var, value)
    with pytest.raises(env.EnvError) as info:
        select.resolve_target(torch.device("cpu"))
    assert str(info.value) == f"{var}={value!r}: expected {expected}"


def test_unknown_flyquant_variable_warns_with_the_known_ones(monkeypatch):
    monkeypatch.setenv("FLYQUANT_BAKCEND", "reference")  # misspelt: would be ignored silently
    monkeypatch.setattr(env, "_warned", set())
    with pytest.warns(RuntimeWarning, match=r"FLYQUANT_BAKCEND ignored; known: FLYQUANT_BACKEND, FLYQUANT_ARCH"):
        select.resolve_target(torch.device("cpu"))


# --- FLYQUANT_CONFIG ---------------------------------------------------------------------------

KNOWN_CONFIG = "known: tile_m, tile_n, k_batch, waves"


@pytest.mark.parametrize("raw, message", [
    ('{"tile_n": 64', r"FLYQUANT_CONFIG='\{\"tile_n\": 64': expected a JSON object .*Expecting ',' delimiter"),
    ("[1]", r"FLYQUANT_CONFIG='\[1\]': expected a JSON object of MoE configuration fields"),
    ('"tile_n"', r"expected a JSON object of MoE configuration fields"),
    ('{"tilen": 64}', rf"FLYQUANT_CONFIG='.*': unknown key\(s\) 'tilen'; {KNOWN_CONFIG}"),
    ('{"tile_n": "64"}', r"FLYQUANT_CONFIG='.*': tile_n = \"64\": expected a positive integer"),
    ('{"waves": 0}', r"waves = 0: expected a positive integer"),
    ('{"k_batch": 2.5}', r"k_batch = 2.5: expected a positive integer"),
    ('{"k_batch": true}', r"k_batch = true: expected a positive integer"),
    ('{"tile_m": null}', r"tile_m = null: expected a positive integer"),
])
def test_bad_config_is_an_error_naming_it(monkeypatch, raw, message):
    """Each used to be a bare JSONDecodeError / silently ignored key / TypeError at launch."""
    monkeypatch.setenv("FLYQUANT_CONFIG", raw)
    with pytest.raises(env.EnvError, match=message):
        select.config_overrides()


MOE_SHAPE = {"tokens": 4, "topk": 4, "experts": 128, "model_dim": 2880, "inter_dim": 2880}


def _moe_plan():
    a2 = torch.empty(1, dtype=torch.bfloat16).expand(16, 2880)  # 4 tokens x topk 4, no memory
    w2 = torch.empty(1, dtype=torch.uint8).expand(128, 3072, 1536)
    return select.plan_moe_gemm2_a16w4(a2, w2, 4, 64, 2880, 2880, torch.bfloat16, False)


@pytest.mark.parametrize("raw, message", [
    ('{"tile_n": 96}', "FLYQUANT_CONFIG='{\"tile_n\": 96}': tile_n = 96: expected one of 64, 128, 256"),
    ('{"waves": 3}', "waves = 3: expected one of 1, 2, 4"),
    ('{"tile_m": 8}', "tile_m = 8: expected one of 16, 32, 64"),
])
def test_config_values_outside_the_kernels_are_refused_when_planning(monkeypatch, raw, message):
    monkeypatch.setattr(select, "_emulator_arch", lambda: "gfx950")
    assert _moe_plan().backend == "flydsl"
    monkeypatch.setenv("FLYQUANT_CONFIG", raw)
    with pytest.raises(env.EnvError, match=re.escape(message)):
        _moe_plan()


# --- FLYQUANT_TUNING ---------------------------------------------------------------------------


def _entry(**changes):
    e = {"op": "moe_gemm2_a16w4", "arch": "gfx950", "shape": dict(MOE_SHAPE), "config": {"tile_n": 256}}
    e.update(changes)
    return e


@pytest.mark.parametrize("table, message", [
    ("{not json", r"the file is not JSON \(Expecting property name"),
    ([], r"FLYQUANT_TUNING='.*' = \[\]: expected a JSON object, e.g. \{\"entries\": \[...\]\}"),
    ({}, r"missing key\(s\) 'entries' \(required: entries\)"),
    ({"entries": [], "version": 2}, r"unknown key\(s\) 'version'; known: entries"),
    ({"entries": {}}, r"entries must be a JSON list, got dict"),
    ({"entries": [7]}, r"entries\[0\] = 7: expected a JSON object"),
    ({"entries": [{"op": "moe_gemm2_a16w4"}]}, r"entries\[0\]: missing key\(s\) 'arch', 'shape', 'config'"),
    ({"entries": [_entry(cfg={})]}, r"entries\[0\]: unknown key\(s\) 'cfg'; known: op, arch, shape, config, median_us"),
    ({"entries": [_entry(op="moe_gemm1")]}, r"entries\[0\]\.op = \"moe_gemm1\": expected one of moe_gemm2_a16w4"),
    ({"entries": [_entry(arch="gfx90a")]}, r"entries\[0\]\.arch = \"gfx90a\": expected one of gfx942, gfx950"),
    ({"entries": [_entry(shape=[4, 4])]}, r"entries\[0\]\.shape = \[4, 4\]: expected a JSON object"),
    ({"entries": [_entry(shape={"tokens": 4})]}, r"entries\[0\]\.shape: missing key\(s\) 'topk', 'experts'"),
    ({"entries": [_entry(shape={**MOE_SHAPE, "batch": 1})]}, r"\.shape: unknown key\(s\) 'batch'; known: tokens, topk"),
    ({"entries": [_entry(shape={**MOE_SHAPE, "tokens": "4"})]}, r"entries\[0\]\.shape: tokens = \"4\": expected a positive"),
    ({"entries": [_entry(config={"tile": 64})]}, rf"entries\[0\]\.config: unknown key\(s\) 'tile'; {KNOWN_CONFIG}"),
    ({"entries": [_entry(config={"k_batch": -1})]}, r"entries\[0\]\.config: k_batch = -1: expected a positive integer"),
    ({"entries": [_entry(), _entry(median_us=3.0)]}, r"entries\[0\] and entries\[1\] are both for \('moe_gemm2_a16w4'"),
])
def test_bad_tuning_table_is_an_error_naming_it(tmp_path, monkeypatch, table, message):
    """Bad JSON, wrong types, missing and unknown keys: each used to be a bare JSONDecodeError,
    AttributeError, KeyError or TypeError, or an entry silently never matched."""
    path = tmp_path / "tuning.json"
    path.write_text(table if isinstance(table, str) else json.dumps(table))
    monkeypatch.setenv("FLYQUANT_TUNING", str(path))
    with pytest.raises(env.EnvError, match=message):
        select.tuned_config("moe_gemm2_a16w4", "gfx950", MOE_SHAPE)


def test_tuning_table_that_cannot_be_read(tmp_path, monkeypatch):
    monkeypatch.setenv("FLYQUANT_TUNING", str(tmp_path / "missing.json"))
    with pytest.raises(env.EnvError, match=r"FLYQUANT_TUNING='.*missing.json': expected the path of a JSON tuning table .*No such file"):
        select.tuned_config("moe_gemm2_a16w4", "gfx950", MOE_SHAPE)
    monkeypatch.setenv("FLYQUANT_TUNING", str(tmp_path))
    with pytest.raises(env.EnvError, match=r"reading it failed: .*Is a directory"):
        select.tuned_config("moe_gemm2_a16w4", "gfx950", MOE_SHAPE)


def test_tuned_values_outside_the_kernels_are_refused_when_planning(tmp_path, monkeypatch):
    monkeypatch.setattr(select, "_emulator_arch", lambda: "gfx950")
    path = tmp_path / "tuning.json"
    path.write_text(json.dumps({"entries": [_entry(config={"tile_n": 512}, median_us=1.5)]}))
    monkeypatch.setenv("FLYQUANT_TUNING", str(path))
    assert select.tuned_config("moe_gemm2_a16w4", "gfx950", MOE_SHAPE) == {"tile_n": 512}  # well-formed
    with pytest.raises(env.EnvError, match=r"FLYQUANT_TUNING='.*' for \{'tokens': 4, .*\}: tile_n = 512: expected one of 64, 128, 256"):
        _moe_plan()
