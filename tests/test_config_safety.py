"""Configuration and input hardening (issue 21, findings 10-12): every FLYQUANT_* variable and
config file is checked when read, with an error naming the variable, the bad value and the
expected form; the kernel cache is private to its user; launching is thread-safe.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

import flyquant as fq
import flyquant.emu as emu
from flyquant import env, reference, select, toolchain, tuning
from flyquant.emu import interp, runtime

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
    # json keeps the last of a repeated key: this forced tile_n 64, silently
    ('{"tile_n": 128, "tile_n": 64}', r"FLYQUANT_CONFIG='.*': key\(s\) 'tile_n' given twice in one JSON object"),
])
def test_bad_config_is_an_error_naming_it(monkeypatch, raw, message):
    """Each used to be a bare JSONDecodeError / silently ignored key / TypeError at launch."""
    monkeypatch.setenv("FLYQUANT_CONFIG", raw)
    with pytest.raises(env.EnvError, match=message):
        tuning.config_overrides()


MOE_SHAPE = {"tokens": 4, "topk": 4, "experts": 128, "model_dim": 2880, "inter_dim": 2880}


def _moe_plan():
    a2 = torch.empty(1, dtype=torch.bfloat16).expand(16, 2880)  # 4 tokens x topk 4, no memory
    w2 = torch.empty(1, dtype=torch.uint8).expand(128, 3072, 1536)
    return select.plan_moe_gemm2_a16w4(a2, w2, 4, 64, 2880, 2880, torch.bfloat16, False)


@pytest.mark.parametrize("raw, message", [
    ('{"tile_n": 96}', "FLYQUANT_CONFIG='{\"tile_n\": 96}': tile_n = 96: expected one of 64, 128, 256"),
    ('{"waves": 3}', "waves = 3: expected one of 1, 2, 4"),
    ('{"tile_m": 8}', "tile_m = 8: expected one of 16, 32, 64"),
    # past the shape's K iterations: the launcher's ValueError named its k_batch argument
    ('{"k_batch": 13}', "k_batch = 13: expected at most ceil(inter_dim / 256) = 12 for inter_dim = 2880"),
])
def test_config_values_outside_the_kernels_are_refused_when_planning(monkeypatch, raw, message):
    monkeypatch.setattr(select, "_emulator_arch", lambda: "gfx950")
    assert _moe_plan().backend == "flydsl"
    monkeypatch.setenv("FLYQUANT_CONFIG", raw)
    with pytest.raises(env.EnvError, match=re.escape(message)):
        _moe_plan()



def _moe_stage1_plan():
    x = torch.empty(1, dtype=torch.bfloat16).expand(4, 2880)
    w1 = torch.empty(1, dtype=torch.uint8).expand(128, 6144, 1536)
    return select.plan_moe_gemm1_a16w4(x, w1, 4, 64, 2880, 2880, False, "swiglu_oai")


@pytest.mark.parametrize("raw, plan", [('{"tile_m": 16, "tile_n": 256, "waves": 1}', _moe_plan),  # 256 columns on one wave
                                       ('{"tile_m": 64, "tile_n": 128, "waves": 1}', _moe_stage1_plan)])  # 128 accumulators a lane
def test_config_values_that_fit_no_wave_split_are_refused_when_planning(monkeypatch, raw, plan):
    """Tiles and waves each among the kernels' but not together: explain() showed the plan, and the
    launch failed with the kernel's "no wave split fits" ValueError, naming neither the variable nor
    the op's config (in fused_moe, after moe_sorting had zeroed the output)."""
    monkeypatch.setattr(select, "_emulator_arch", lambda: "gfx950")
    assert plan().backend == "flydsl"
    monkeypatch.setenv("FLYQUANT_CONFIG", raw)
    with pytest.raises(env.EnvError, match=re.escape(f"FLYQUANT_CONFIG={raw!r}: tile ") + ".*no wave split fits"):
        plan()

@pytest.mark.parametrize("stage", [1, 2])
def test_forced_tile_m_not_dividing_block_m_is_refused(monkeypatch, stage):
    """A tile_m FLYQUANT_CONFIG forces that does not divide the caller's block_m (a stage op called
    with its own sort): the plan ran the largest tile dividing block_m instead (64 forced, 16-row
    tiles run), the variable silently ignored. One that divides it is kept."""
    monkeypatch.setattr(select, "_emulator_arch", lambda: "gfx950")
    x = torch.empty(1, dtype=torch.bfloat16).expand(16 if stage == 2 else 4, 2880)
    w = torch.empty(1, dtype=torch.uint8).expand(128, 6144 if stage == 1 else 3072, 1536)
    plan = (lambda bm: select.plan_moe_gemm1_a16w4(x, w, 4, bm, 2880, 2880, False, "swiglu_oai")) if stage == 1 else \
        (lambda bm: select.plan_moe_gemm2_a16w4(x, w, 4, bm, 2880, 2880, torch.bfloat16, False))
    monkeypatch.setenv("FLYQUANT_CONFIG", '{"tile_m": 64}')
    assert plan(128).config["tile_m"] == 64
    for block_m in (16, 32, 96):
        with pytest.raises(env.EnvError, match=re.escape("FLYQUANT_CONFIG='{\"tile_m\": 64}': tile_m = 64 does not "
                                                         f"divide the caller's block_m = {block_m}")):
            plan(block_m)
    monkeypatch.delenv("FLYQUANT_CONFIG")
    assert plan(16).config["tile_m"] == 16  # the selector's own tile: fitted to block_m, as before
    # a block_m no row tile divides (moe_sorting and the reference take any): planned on the
    # reference with the reason (the kernel was planned and its launcher refused the call), and
    # refused up front when the kernel is forced
    for block_m in (1, 8, 24):
        ref = plan(block_m)
        assert ref.backend == "reference" and f"block_m must be a multiple of 16, got {block_m}" in " ".join(ref.reasons)
        monkeypatch.setenv("FLYQUANT_BACKEND", "flydsl")
        with pytest.raises(select.BackendError, match=f"block_m must be a multiple of 16, got {block_m}"):
            plan(block_m)
        monkeypatch.delenv("FLYQUANT_BACKEND")


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
    (json.dumps({"entries": [_entry()]}).replace('"tile_n": 256', '"tile_n": 256, "tile_n": 64'),
     r"FLYQUANT_TUNING='.*': key\(s\) 'tile_n' given twice in one JSON object"),
])
def test_bad_tuning_table_is_an_error_naming_it(tmp_path, monkeypatch, table, message):
    """Bad JSON, wrong types, missing and unknown keys: each used to be a bare JSONDecodeError,
    AttributeError, KeyError or TypeError, or an entry silently never matched."""
    path = tmp_path / "tuning.json"
    path.write_text(table if isinstance(table, str) else json.dumps(table))
    monkeypatch.setenv("FLYQUANT_TUNING", str(path))
    with pytest.raises(env.EnvError, match=message):
        tuning.tuned_config("moe_gemm2_a16w4", "gfx950", MOE_SHAPE)


def test_tuning_table_that_cannot_be_read(tmp_path, monkeypatch):
    monkeypatch.setenv("FLYQUANT_TUNING", str(tmp_path / "missing.json"))
    with pytest.raises(env.EnvError, match=r"FLYQUANT_TUNING='.*missing.json': expected an absolute path: a JSON tuning table .*No such file"):
        tuning.tuned_config("moe_gemm2_a16w4", "gfx950", MOE_SHAPE)
    monkeypatch.setenv("FLYQUANT_TUNING", str(tmp_path))
    with pytest.raises(env.EnvError, match=r"reading it failed: .*Is a directory"):
        tuning.tuned_config("moe_gemm2_a16w4", "gfx950", MOE_SHAPE)
    # a relative path would name a different file in every working directory
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tuning.json").write_text('{"entries": []}')
    monkeypatch.setenv("FLYQUANT_TUNING", "tuning.json")
    with pytest.raises(env.EnvError, match=r"FLYQUANT_TUNING='tuning.json': expected an absolute path \(a JSON tuning table"):
        tuning.tuned_config("moe_gemm2_a16w4", "gfx950", MOE_SHAPE)


def test_tuned_values_outside_the_kernels_are_refused_when_planning(tmp_path, monkeypatch):
    monkeypatch.setattr(select, "_emulator_arch", lambda: "gfx950")
    path = tmp_path / "tuning.json"
    path.write_text(json.dumps({"entries": [_entry(config={"tile_n": 512}, median_us=1.5)]}))
    monkeypatch.setenv("FLYQUANT_TUNING", str(path))
    assert tuning.tuned_config("moe_gemm2_a16w4", "gfx950", MOE_SHAPE) == {"tile_n": 512}  # well-formed
    with pytest.raises(env.EnvError, match=r"FLYQUANT_TUNING='.*': entries\[0\] \(moe_gemm2_a16w4, gfx950, \{.*'tokens': 4, "
                                           r".*\}\): tile_n = 512: expected one of 64, 128, 256"):
        _moe_plan()
    # helper-66: a bad entry for another token count (or another shape) was an error only when a batch
    # of that size arrived; the table is now checked whole at the first plan, naming the entry
    for config, message in (({"tile_n": 512}, "tile_n = 512"),
                            ({"tile_m": 16, "tile_n": 256, "waves": 1, "k_batch": 1}, "no wave split fits")):
        other = _entry(shape=dict(MOE_SHAPE, tokens=128), config=config)
        path.write_text(json.dumps({"entries": [_entry(), other]}))
        os.utime(path, (1, len(message)))  # a new mtime: re-read
        with pytest.raises(env.EnvError, match=r"entries\[1\] \(moe_gemm2_a16w4, gfx950, \{.*'tokens': 128, .*" + message):
            _moe_plan()


def test_tuned_entries_apply_at_the_nearest_tuned_token_count_and_explain_says_so(tmp_path, monkeypatch):
    """helper-66: an entry applied only at exactly its token count (a sweep's 1, 2, 4, ...: a batch
    of 3 or 5 took first principles) and explain() never named the table. Now the entry of the
    nearest tuned token count by ratio applies, within a factor of 2 (a tie: the fewer tokens; a
    table of large batches does not drive a 1-token decode), and the plan says which entry gave
    which fields; FLYQUANT_CONFIG's forced fields too, not also as the table's."""
    monkeypatch.setattr(select, "_emulator_arch", lambda: "gfx950")
    path = tmp_path / "tuning.json"
    entries = [_entry(shape=dict(MOE_SHAPE, tokens=t), config={"tile_n": n, "k_batch": kb})
               for t, n, kb in ((2, 64, 4), (8, 128, 2))]
    path.write_text(json.dumps({"entries": entries}))
    monkeypatch.setenv("FLYQUANT_TUNING", str(path))
    for tokens, want, index in ((1, (64, 4), 0), (3, (64, 4), 0), (5, (128, 2), 1), (16, (128, 2), 1)):
        assert tuning.tuned_entry("moe_gemm2_a16w4", "gfx950", dict(MOE_SHAPE, tokens=tokens))[::2] == (
            index, dict(zip(("tile_n", "k_batch"), want)))
    assert tuning.tuned_entry("moe_gemm2_a16w4", "gfx950", dict(MOE_SHAPE, tokens=17)) is None  # past 2x of 8
    plan = _moe_plan()  # 4 tokens: 2 and 8 are as near; the fewer
    assert (plan.config["tile_n"], plan.config["k_batch"]) == (64, 4)
    assert "tile_n, k_batch from FLYQUANT_TUNING entries[0] (tuned at 2 tokens, the nearest)" in plan.reasons
    assert tuning.tuned_entry("moe_gemm2_a16w4", "gfx950", dict(MOE_SHAPE, experts=64)) is None  # other fields: exact
    monkeypatch.setenv("FLYQUANT_CONFIG", '{"waves": 1, "tile_n": 128}')
    reasons = _moe_plan().reasons
    assert "waves, tile_n forced by FLYQUANT_CONFIG" in reasons
    assert "k_batch from FLYQUANT_TUNING entries[0] (tuned at 2 tokens, the nearest)" in reasons


def test_a_tuned_stage1_entry_whose_tile_m_does_not_divide_the_sort_is_not_used(tmp_path, monkeypatch):
    """helper-66: fused_moe sorts with stage 2's block_m; a stage-1 entry timed at tile_m 32 was run
    at 16 with its tile_n and waves (a config nobody timed), silently. The entry is now left out,
    with the reason in the plan."""
    monkeypatch.setattr(select, "_emulator_arch", lambda: "gfx950")
    path = tmp_path / "tuning.json"
    path.write_text(json.dumps({"entries": [_entry(op="moe_gemm1_a16w4",
                                                   config={"tile_m": 32, "tile_n": 256, "waves": 4})]}))
    monkeypatch.setenv("FLYQUANT_TUNING", str(path))
    x = torch.empty(1, dtype=torch.bfloat16).expand(4, 2880)
    w1 = torch.empty(1, dtype=torch.uint8).expand(128, 2 * 3072, 1440)

    def plan(block_m):
        return select.plan_moe_gemm1_a16w4(x, w1, 4, block_m, 2880, 2880, False, "silu")

    assert (plan(32).config["tile_m"], plan(32).config["tile_n"], plan(32).config["waves"]) == (32, 256, 4)
    untuned = plan(16)
    assert untuned.config["tile_m"] == 16 and (untuned.config["tile_n"], untuned.config["waves"]) != (256, 4)
    assert any("entries[0] (tuned at 4 tokens) not used: its tile_m 32 does not divide the sort's block_m 16" in r
               for r in untuned.reasons), untuned.reasons


# --- FLYQUANT_EMU / FLYQUANT_EMU_MAX_WAVE_INSTRUCTIONS ----------------------------------------


@pytest.mark.parametrize("value", ["abc", "0", "-1", "2.5", "1e6", "+5", "5_000", "\u0665"])
def test_max_wave_instructions_must_be_a_positive_integer(monkeypatch, value):
    monkeypatch.setenv("FLYQUANT_EMU_MAX_WAVE_INSTRUCTIONS", value)
    with pytest.raises(env.EnvError, match=re.escape(f"FLYQUANT_EMU_MAX_WAVE_INSTRUCTIONS={value!r}: expected a positive integer")):
        interp.max_wave_instructions()
    monkeypatch.setenv("FLYQUANT_EMU_MAX_WAVE_INSTRUCTIONS", " 1000 ")
    assert interp.max_wave_instructions() == 1000
    monkeypatch.delenv("FLYQUANT_EMU_MAX_WAVE_INSTRUCTIONS")
    assert interp.max_wave_instructions() == interp.DEFAULT_MAX_WAVE_INSTRUCTIONS


@pytest.mark.parametrize("variables, message", [
    ({"FLYQUANT_EMU_MAX_WAVE_INSTRUCTIONS": "abc"}, "FLYQUANT_EMU_MAX_WAVE_INSTRUCTIONS='abc': expected a positive integer"),
    ({"FLYQUANT_EMU": "gfx951"}, "FLYQUANT_EMU='gfx951': expected one of gfx942|gfx950"),
    ({"FLYQUANT_EMU": "1"}, "FLYQUANT_EMU='1': expected one of gfx942|gfx950"),
])
def test_emulator_variables_fail_when_the_emulator_is_enabled(variables, message):
    """A bad value stops `import flyquant` (FLYQUANT_EMU enables the emulator there) with the
    variable's name, before any launch (the wave limit used to fail inside the first launch)."""
    code = "import flyquant; print('imported')"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "FLYQUANT_EMU": "gfx950", **variables})
    assert result.returncode != 0 and "imported" not in result.stdout
    assert f"flyquant.env.EnvError: {message}" in result.stderr, result.stderr[-2000:]


def test_execute_refuses_a_non_positive_wave_budget():
    for budget in (0, -1, 2.0):
        with pytest.raises(ValueError, match=re.escape(f"max_wave_instructions must be a positive int, got {budget!r}")):
            interp.execute(_NoKernels(), "k", (1, 1, 1), (64, 1, 1), 0, 0, None, max_wave_instructions=budget)


class _NoKernels:
    """A stand-in code object: execute checks its budget before it looks at the kernel."""

    arch = "gfx950"
    kernels = {"k": None}


# --- the kernel cache is private (finding 12) ---------------------------------------------------


def _mode(path) -> int:
    return os.stat(path).st_mode & 0o7777


def test_new_cache_directories_are_created_0700(tmp_path, monkeypatch):
    """Every directory flyquant creates, missing parents of FLYQUANT_CACHE_DIR included, is 0700,
    whatever the umask (they used to be 0755)."""
    root = tmp_path / "new" / "cache"
    monkeypatch.setenv("FLYQUANT_CACHE_DIR", str(root))
    old_umask = os.umask(0o002)
    try:
        assert toolchain.cache_dir() == root
        kernels = toolchain.kernel_cache_dir()
        stub = runtime.stub_path()
    finally:
        os.umask(old_umask)
    created = [tmp_path / "new", root, root / "flydsl", kernels, root / "emu", stub.parent]
    assert [oct(_mode(p)) for p in created] == [oct(0o700)] * len(created)
    assert kernels.startswith(str(root / "flydsl"))


def test_cache_works_under_umask_002(tmp_path, monkeypatch):
    """Under umask 002 (RHEL's default; helper-79): the emulator's stub is built 0700, not refused as
    group-writable, and the group-writable entries FlyDSL creates in the kernel cache lose their
    group write bit where no one else can reach them (the cache's own 0700 directories); under a
    directory others can search they are still refused."""
    root = tmp_path / "cache"
    monkeypatch.setenv("FLYQUANT_CACHE_DIR", str(root))
    monkeypatch.setattr(toolchain, "_checked", {})
    old_umask = os.umask(0o002)
    try:
        stub = runtime.build_stub()
        kernels = Path(toolchain.kernel_cache_dir())
        (kernels / "launch_x").mkdir()
        (kernels / "launch_x" / "k.pkl").write_bytes(b"")
        toolchain._checked.clear()
        assert Path(toolchain.kernel_cache_dir()) == kernels
    finally:
        os.umask(old_umask)
    assert _mode(stub) == 0o700 and _mode(kernels / "launch_x") == 0o755 and _mode(kernels / "launch_x" / "k.pkl") == 0o644
    os.chmod(kernels / "launch_x", 0o775)
    for level in (root, root / "flydsl", kernels):
        os.chmod(level, 0o755)  # others may search: a group-writable entry is refused
    toolchain._checked.clear()
    with pytest.raises(toolchain.CacheDirError, match="group or others can write it"):
        toolchain.kernel_cache_dir()


def test_kernel_cache_that_cannot_be_locked_is_refused(tmp_path, monkeypatch):
    """FlyDSL opens `<entry>.lock` for writing and flocks it even to read: a cache it cannot write
    (a read-only image) or lock (a filesystem without flock: 600 s of silent retries, helper-79) is
    a CacheDirError naming the fix, before anything compiles; FLYDSL_RUNTIME_ENABLE_CACHE=0 skips it."""
    import errno
    import fcntl

    monkeypatch.setenv("FLYQUANT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(toolchain, "_lockable", set())
    cache = toolchain.kernel_cache_dir()
    real_open = os.open

    def read_only(path, *args):
        if str(path).startswith(cache):
            raise PermissionError(errno.EACCES, "Permission denied")
        return real_open(path, *args)

    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    for patch, words in ((("open", read_only), "cannot write in the kernel cache"),
                         (("flock", no_flock), "does not support flock")):
        module = os if patch[0] == "open" else fcntl
        with monkeypatch.context() as m:
            m.setattr(module, *patch)
            with pytest.raises(toolchain.CacheDirError, match=words + ".*FLYDSL_RUNTIME_ENABLE_CACHE=0"):
                with toolchain.target("gfx950"):
                    pass
            m.setenv("FLYDSL_RUNTIME_ENABLE_CACHE", "0")
            with toolchain.target("gfx950"):
                pass
    with toolchain.target("gfx950"):  # a working cache: probed once
        pass
    assert toolchain._lockable == {cache}


def test_linker_shim_rewritten_when_the_cache_is_deleted(tmp_path, monkeypatch):
    """The cache deleted under a running process (a tmp cleaner): the ziglang linker shim is
    written again (rocm_path was memoized: every later compile failed, "lld invocation failed")."""
    monkeypatch.setenv("FLYQUANT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("ROCM_PATH", raising=False)
    monkeypatch.setattr(toolchain, "_lld_works", lambda path: False)  # no ROCm: the shim
    toolchain._rocm_path.cache_clear()
    try:
        shim = toolchain.rocm_path()
        lld = Path(shim, "llvm", "bin", "ld.lld")
        assert lld.exists()
        shutil.rmtree(tmp_path / "cache")
        monkeypatch.setattr(toolchain, "_checked", {})
        assert toolchain.rocm_path() == shim and lld.exists()
    finally:
        toolchain._rocm_path.cache_clear()


def test_default_cache_follows_xdg_cache_home(tmp_path, monkeypatch):
    """Without FLYQUANT_CACHE_DIR: $XDG_CACHE_HOME/flyquant when XDG_CACHE_HOME is absolute (helper-70:
    it was ignored), else ~/.cache/flyquant (a relative XDG_CACHE_HOME is invalid per the spec)."""
    monkeypatch.delenv("FLYQUANT_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for xdg, root in ((str(tmp_path / "xdg"), tmp_path / "xdg" / "flyquant"),
                      ("relative", tmp_path / "home" / ".cache" / "flyquant")):
        monkeypatch.setenv("XDG_CACHE_HOME", xdg)
        assert toolchain.cache_dir() == root
        assert toolchain.kernel_cache_dir().startswith(str(root / "flydsl"))  # its memo follows the variable too


@pytest.mark.parametrize("mode", [0o777, 0o775, 0o757, 0o722])
def test_cache_directory_writable_by_others_is_refused(tmp_path, monkeypatch, mode):
    root = tmp_path / "cache"
    root.mkdir()
    root.chmod(mode)
    monkeypatch.setenv("FLYQUANT_CACHE_DIR", str(root))
    with pytest.raises(toolchain.CacheDirError) as info:
        toolchain.cache_dir()
    message = str(info.value)
    assert f"unsafe cache directory {root} (FLYQUANT_CACHE_DIR): group or others can write it (mode {mode:#o})" in message
    assert f"Fix: chmod go-w {root} (or chmod 700), or point FLYQUANT_CACHE_DIR at a new directory" in message
    root.chmod(0o755)  # writable by its owner only: accepted as it is
    assert toolchain.cache_dir() == root and _mode(root) == 0o755


def test_cache_directory_of_another_user_is_refused(tmp_path, monkeypatch):
    """We run as root and cannot chown to a real other user: the directory is ours, and we
    pretend to be uid 4242."""
    root = tmp_path / "cache"
    root.mkdir(mode=0o700)
    monkeypatch.setenv("FLYQUANT_CACHE_DIR", str(root))
    monkeypatch.setattr(os, "geteuid", lambda: 4242)
    with pytest.raises(toolchain.CacheDirError, match=re.escape(
            f"unsafe cache directory {root} (FLYQUANT_CACHE_DIR): it is owned by uid {os.stat(root).st_uid}")) as info:
        toolchain.cache_dir()
    assert "owned by you (uid 4242)" in str(info.value)


def test_cache_below_a_directory_others_can_write_is_refused(tmp_path, monkeypatch):
    """Others could rename the cache away and put theirs in its place; with the sticky bit (as
    /tmp) they cannot."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv("FLYQUANT_CACHE_DIR", str(shared / "cache"))
    with pytest.raises(toolchain.CacheDirError, match=re.escape(f"unsafe cache directory {shared} (FLYQUANT_CACHE_DIR): "
                                                                "group or others can write it (mode 0o777, no sticky bit)")):
        toolchain.cache_dir()
    assert not (shared / "cache").exists()  # nothing created under it
    shared.chmod(0o1777)
    assert toolchain.cache_dir() == shared / "cache" and _mode(shared / "cache") == 0o700


def test_cache_dir_must_be_absolute(monkeypatch):
    monkeypatch.setenv("FLYQUANT_CACHE_DIR", "cache")
    with pytest.raises(env.EnvError, match=r"FLYQUANT_CACHE_DIR='cache': expected an absolute path"):
        toolchain.cache_dir()


def test_kernel_cache_with_an_entry_others_can_write_is_refused(tmp_path, monkeypatch):
    """FlyDSL unpickles every entry under the kernel cache: one that others can write is refused."""
    monkeypatch.setenv("FLYQUANT_CACHE_DIR", str(tmp_path / "cache"))
    kernels = toolchain.kernel_cache_dir()
    entry = os.path.join(kernels, "launch_0123", "deadbeef.pkl")
    os.makedirs(os.path.dirname(entry))
    with open(entry, "wb") as f:
        f.write(b"not a pickle")
    os.chmod(entry, 0o666)
    toolchain._checked.clear()  # a new process: the directory is checked anew
    with pytest.raises(toolchain.CacheDirError, match=re.escape(f"unsafe cache directory {entry} (FLYQUANT_CACHE_DIR): "
                                                                "group or others can write it (mode 0o666)")):
        toolchain.kernel_cache_dir()


def test_damaged_emulator_library_is_rebuilt(tmp_path, monkeypatch):
    """A stub that is not what was built (cut short, emptied, other bytes: helper-79, a truncated
    one killed the process with SIGBUS when loaded) is rebuilt, its checksum beside it."""
    monkeypatch.setenv("FLYQUANT_CACHE_DIR", str(tmp_path / "cache"))
    stub = runtime.build_stub()
    checksum = stub.with_name(stub.name + ".sha256")
    size = stub.stat().st_size

    def rebuilt():  # a whole library again, the checksum its own (builds need not be byte-identical)
        return (runtime.build_stub() == stub and stub.stat().st_size == size
                and checksum.read_text() == hashlib.sha256(stub.read_bytes()).hexdigest())

    for damaged in (stub.read_bytes()[:4096], b"", b"\x7fELF" + bytes(size - 4)):
        stub.write_bytes(damaged)
        assert rebuilt()
    checksum.unlink()  # a cache from before the checksum: rebuilt once
    assert rebuilt()


def test_emulator_library_others_can_write_is_not_loaded(tmp_path, monkeypatch):
    monkeypatch.setenv("FLYQUANT_CACHE_DIR", str(tmp_path / "cache"))
    stub = runtime.stub_path()
    stub.write_bytes(b"\x7fELF planted")
    stub.chmod(0o666)
    with pytest.raises(toolchain.CacheDirError, match=re.escape(f"unsafe cache directory {stub} (FLYQUANT_CACHE_DIR): "
                                                                "group or others can write it (mode 0o666)")):
        runtime.build_stub()


def test_launch_refuses_an_unsafe_flydsl_cache_dir(tmp_path, monkeypatch):
    """A FLYDSL_RUNTIME_CACHE_DIR of the user's own is used for our kernels only if private too."""
    shared = tmp_path / "flydsl-cache"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv("FLYDSL_RUNTIME_CACHE_DIR", str(shared))
    before = dict(os.environ)
    with pytest.raises(toolchain.CacheDirError, match=re.escape(f"unsafe cache directory {shared} (FLYDSL_RUNTIME_CACHE_DIR)")):
        with toolchain.target("gfx950"):
            pass
    assert dict(os.environ) == before
    shared.chmod(0o700)
    with toolchain.target("gfx950"):
        assert os.environ["FLYDSL_RUNTIME_CACHE_DIR"] == str(shared)
    assert dict(os.environ) == before


# --- launching is thread-safe (finding 11) --------------------------------------------------------

TARGET_VARIABLES = ("ARCH", "FLYDSL_GPU_ARCH", "ROCM_PATH", "FLYDSL_RUNTIME_CACHE_DIR")


def test_target_blocks_are_one_thread_at_a_time():
    """While one thread is inside target("gfx942"), another thread's target("gfx950") waits, so
    FlyDSL sees one arch and one cache throughout a block; afterwards os.environ is as before
    (FLYDSL_RUNTIME_CACHE_DIR used to stay set when two blocks interleaved)."""
    before = dict(os.environ)
    inside_a, release_a, inside_b = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def a():
        with toolchain.target("gfx942"):
            inside_a.set()
            release_a.wait(60)
            seen["a"] = {k: os.environ.get(k) for k in TARGET_VARIABLES}

    def b():
        inside_a.wait(60)
        with toolchain.target("gfx950"):
            inside_b.set()
            seen["b"] = {k: os.environ.get(k) for k in TARGET_VARIABLES}

    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    for t in threads:
        t.start()
    try:
        assert inside_a.wait(60)
        assert not inside_b.wait(0.5), "a second thread entered target() while the first was inside"
    finally:
        release_a.set()
        for t in threads:
            t.join(60)
    assert inside_b.is_set()
    assert seen["a"]["ARCH"] == seen["a"]["FLYDSL_GPU_ARCH"] == "gfx942"
    assert seen["b"]["ARCH"] == seen["b"]["FLYDSL_GPU_ARCH"] == "gfx950"
    assert seen["a"]["FLYDSL_RUNTIME_CACHE_DIR"] == seen["b"]["FLYDSL_RUNTIME_CACHE_DIR"] == toolchain.kernel_cache_dir()
    assert dict(os.environ) == before


def test_target_nests_and_restores_every_variable(monkeypatch):
    for k in TARGET_VARIABLES:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("ARCH", "gfx950")
    before = dict(os.environ)
    with toolchain.target("gfx942"):
        with toolchain.target("gfx950"):  # re-entrant: the same thread may nest blocks
            assert os.environ["ARCH"] == "gfx950"
        assert os.environ["ARCH"] == "gfx942"
    assert dict(os.environ) == before and "FLYDSL_RUNTIME_CACHE_DIR" not in os.environ


@pytest.mark.skipif(not emu.enabled(), reason="launches kernels under flyquant.emu")
def test_two_threads_launch_different_arches_concurrently():
    """An MXFP8 1x32 quantize on gfx942 and one on gfx950 from two threads at once, three each:
    every result is bit-exact against the reference, each launch ran the code object of its
    own arch (each thread's emu.record() holds its own launches), and os.environ is unchanged
    afterwards."""
    from flyquant.kernels import mxfp8_quantize_2d as k

    before = dict(os.environ)
    x = {arch: torch.randn(64, 64, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(i))
         for i, arch in enumerate(("gfx942", "gfx950"))}
    expected = {arch: reference.mxfp8_quantize(v, -1, "rceil") for arch, v in x.items()}
    results, errors, launches = {arch: [] for arch in x}, [], {}
    start = threading.Barrier(2)

    def run(arch):
        try:
            start.wait(60)
            with emu.record() as launches[arch]:
                for _ in range(3):
                    results[arch].append(k.quantize_1x32(x[arch], arch=arch))
        except BaseException as exc:  # noqa: BLE001 (reported below)
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(arch,)) for arch in x]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert not errors, errors
    assert {arch: [r.arch for r in mine] for arch, mine in launches.items()} == {arch: [arch] * 3 for arch in x}
    launches = [r for mine in launches.values() for r in mine]
    for arch, outs in results.items():
        assert len(outs) == 3
        for data, scales in outs:
            torch.testing.assert_close(data.view(torch.uint8), expected[arch][0].view(torch.uint8), rtol=0, atol=0)
            torch.testing.assert_close(scales.view(torch.uint8), expected[arch][1].view(torch.uint8), rtol=0, atol=0)
    assert sorted(r.arch for r in launches) == ["gfx942"] * 3 + ["gfx950"] * 3
    assert all(f"_{r.arch}_" in r.kernel for r in launches), [(r.kernel, r.arch) for r in launches]
    assert dict(os.environ) == before


def test_env_flag_and_unknown_names(monkeypatch):
    monkeypatch.setenv("FLYQUANT_DEBUG", "yes")
    with pytest.raises(env.EnvError, match=r"FLYQUANT_DEBUG='yes': expected one of 0\|1"):
        env.flag("FLYQUANT_DEBUG")
    monkeypatch.setenv("FLYQUANT_DEBUG", "1")
    assert env.flag("FLYQUANT_DEBUG")
    with pytest.raises(KeyError, match="FLYQUANT_NOPE is not a flyquant environment variable"):
        env.raw("FLYQUANT_NOPE")


def test_bench_records_only_settings_flyquant_accepts(monkeypatch):
    """bench/ writes FLYQUANT_CONFIG / FLYQUANT_TUNING into its JSON: it reads them as flyquant
    does, so a bad one is the same named error, not a silently recorded setting."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    try:
        import common
    finally:
        sys.path.pop(0)
    monkeypatch.setenv("FLYQUANT_CONFIG", ' {"waves": 2} ')
    assert common.environment()["FLYQUANT_CONFIG"] == '{"waves": 2}'
    monkeypatch.setenv("FLYQUANT_CONFIG", '{"wave": 2}')
    with pytest.raises(env.EnvError, match=rf"unknown key\(s\) 'wave'; {KNOWN_CONFIG}"):
        common.environment()
