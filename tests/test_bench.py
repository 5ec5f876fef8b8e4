"""The benchmark scripts (bench/) on tiny configurations, so they do not rot: each runs in its
modelled mode under flyquant.emu, writes valid JSON and a PNG; and the MoE bench's way of
emulating part of a launch gives exactly the counters of the whole launch when nothing is
sampled (the part it scales is then the whole).

The hardware mode needs a ROCm GPU (marker `gpu`)."""

from __future__ import annotations

import functools
import importlib.util
import json
import sys
import time
from pathlib import Path

import pytest
import torch

import flyquant.emu as emu
from flyquant import select

BENCH = Path(__file__).resolve().parent.parent / "bench"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def skip_without_peer_triton() -> None:
    """Skip unless Triton can compile the peer kernels here: installed at the version bench/peers.py
    was checked with (the extras take 3.9.0 where the installed torch allows it; PyPI's CUDA build of
    torch 2.13 pins 3.7.1, whose AMD backend fails on aiter's MoE GEMM for gfx942)."""
    load("quantize")  # puts bench/ on sys.path for its peer modules
    import peers

    reason = peers.triton_missing()
    if reason:
        pytest.skip(reason)


@functools.cache
def load(name: str):
    """A bench script as a module (once per session: its dataclasses are keys of its caches)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def read_outputs(out: Path, stem: str) -> dict:
    def no_nan(token):
        raise ValueError(f"{token} in JSON")

    payload = json.loads((out / f"{stem}.json").read_text(), parse_constant=no_nan)
    assert (out / f"{stem}.png").read_bytes()[: len(PNG_MAGIC)] == PNG_MAGIC
    return payload


def test_moe_bench_modelled(tmp_path):
    """upstream FlyDSL's small shape (model 256, inter 512, 8 experts, top-2) at 5 tokens, one
    config: 16 small workgroups to emulate."""
    bench = load("moe_tile_n")
    argv = "--mode modelled --arch gfx950 --shapes upstream-small --tokens 5 --tile-n 128 --k-batch 1 --out".split()
    bench.main([*argv, str(tmp_path)])
    payload = read_outputs(tmp_path, "moe_gemm2_tile_n_modelled")
    assert payload["mode"] == "modelled" and "not timed" in payload["label"]
    (row,) = payload["rows"]
    assert (row["tile_n"], row["k_batch"], row["reduction"]) == (128, 1, "exact")
    # 10 routing pairs over 8 experts: between 2 and 8 m-tiles hold pairs, each 2 n-tiles wide
    assert 2 * 2 <= row["wg_working"] <= 8 * 2 and row["wg_working"] <= row["wg_launched"]
    assert row["mfma"] >= row["mfma_useful"] > 0 and row["wave_instr"] > row["mfma"]
    assert row["spills"] == 0 and row["vgprs"] > 0 and row["workgroups_per_cu"] >= 1
    assert row["coalescing_loads"] > 0 and row["upstream_instr_per_mfma"] == 14.96


def test_moe_instructions_per_mfma_within_the_issue_budget(tmp_path):
    """Issue 5's target, on upstream FlyDSL's small shape (the GPT-OSS-like one at 1 token: the
    next test, on the selector's config): executed wave-instructions per MFMA on gfx950 at most
    0.7x upstream's quoted figure for each tile it was quoted at, the very figures the bench
    reports (whole launch, idle workgroups included)."""
    bench, targets = load("moe_tile_n"), load("moe_tile_n_report")  # targets: what the rows are held to
    argv = "--mode modelled --arch gfx950 --shapes upstream-small --tokens 5 --tile-m 16,32 --tile-n 128,256 --k-batch 1 --out"
    bench.main([*argv.split(), str(tmp_path)])
    rows = [r for r in read_outputs(tmp_path, "moe_gemm2_tile_n_modelled")["rows"] if r["upstream_instr_per_mfma"]]
    assert sorted((r["tile_m"], r["tile_n"]) for r in rows) == [(16, 128), (16, 256), (32, 256)]
    for r in rows:
        assert r["reduction"] == "exact"
        assert r["vs_upstream"] <= targets.PER_MFMA_TARGET, (r["tile_m"], r["tile_n"], r["instr_per_mfma"])


def test_moe_bench_stage1_modelled(tmp_path):
    """--stage 1 on the small shape (silu, no bias) at 5 tokens, one config on each arch: the gate/up
    kernel runs (its own output file), stores a2 rows, no split K, 16-byte weight loads."""
    bench, targets = load("moe_tile_n"), load("moe_tile_n_report")  # targets: what the rows are held to
    argv = "--stage 1 --mode modelled --arch gfx950,gfx942 --shapes upstream-small --tokens 5 --tile-n 128 --out"
    bench.main([*argv.split(), str(tmp_path)])
    payload = read_outputs(tmp_path, "moe_gemm1_tile_n_modelled")
    assert "upstream" not in payload  # upstream's figures are stage 2's
    rows = payload["rows"]
    assert [r["arch"] for r in rows] == ["gfx950", "gfx942"]
    for row in rows:
        assert row["stage"] == 1 and row["kernel"].startswith("moe_gemm1_a16w4_silu") and row["kernel"].endswith(row["arch"])
        assert (row["tile_n"], row["k_batch"], row["reduction"]) == (128, 1, "exact")
        # 10 pairs over 8 experts: 2..8 m-tiles with pairs, N = 2 * 512 = 8 n-tiles of 128 each
        assert 2 * 8 <= row["wg_working"] <= 8 * 8
        assert row["mfma"] >= row["mfma_useful"] > 0 and row["store_instr"] > 0 and row["atomic_instr"] == 0
        assert row["w_bytes_per_lane"] == targets.W_BYTES_PER_LANE and row["spills"] == 0


def test_moe_one_token_selected_config_meets_every_modelled_target(tmp_path):
    """GPT-OSS-like 3072^2 at 1 token, the selector's own config (tile 16x128 with split K, so that
    >= 256 workgroups stream weights): the issue's targets the bench checks on that row, including
    wave-instructions per MFMA <= 0.7x upstream's figure for the tile (10.24, no split K), hold on
    gfx950 (sampled m-tiles: all working ones do the same work, so the estimate is theirs)."""
    bench, targets = load("moe_tile_n"), load("moe_tile_n_report")  # targets: what the rows are held to
    argv = "--mode modelled --arch gfx950 --shapes gptoss-3072 --tokens 1 --tile-m 16 --tile-n 128 --k-batch sel --out"
    bench.main([*argv.split(), str(tmp_path)])
    (row,) = [r for r in read_outputs(tmp_path, "moe_gemm2_tile_n_modelled")["rows"] if r.get("selected")]
    assert row["k_batch"] > 1 and row["wg_working"] >= targets.MIN_WORKING_AT_ONE_TOKEN
    assert bench.target_misses(row) == [], bench.target_misses(row)
    assert row["vs_upstream"] <= targets.PER_MFMA_TARGET


@pytest.mark.parametrize("tokens", [1, 64], ids=["compact-grid", "direct-grid"])
def test_moe_bench_estimate_is_exact_without_sampling(tokens):
    """With every m-tile emulated, idle + working parts recombine to the whole launch's counters.
    1 token: 2 pairs, the grid is sized by an upper bound (the kernel scans for tiles: the padded
    path); 64 tokens: 128 pairs fill every m-slot (direct: the gathered path)."""
    bench = load("moe_tile_n")
    from flyquant.kernels import moe_gemm2_a16w4 as kernel

    common = bench.common
    shape, stage = bench.SHAPES["upstream-small"], bench.STAGES[2]
    p = bench.build_problem(stage, shape, tokens, 16, 0.0, 0, "cpu")
    compact = kernel.m_grid(tokens, shape.topk, shape.experts, p.sorting[0].numel(), 16)[1]
    assert compact == (tokens == 1)
    cfg = bench.Config(16, 128, 1, 2)
    weights = bench.Weights(stage, shape, 0, "cpu")
    row = bench.model_config(p, "gfx950", cfg, 10**6, weights)
    assert row["reduction"] == "exact"
    out = bench.new_out(p, "cpu")
    _, whole, _ = common.emulate(lambda: bench.launch(p, "gfx950", cfg, p.sorting, weights, out))
    est = row["counts"]
    assert est["wave_instructions"] == whole.wave_instructions
    assert (est["workgroups_launched"], est["workgroups_working"]) == (
        whole.workgroups_launched,
        whole.workgroups_working,
    )
    assert est["by_class"] == {k: v for k, v in whole.by_class.items() if v}
    for name, m in whole.memory.items():
        assert (est["memory"][name]["bytes"], est["memory"][name]["lines"]) == (m.bytes, m.lines), name


@pytest.mark.parametrize("stage", (1, 2))
def test_moe_bench_vs_aiter_triton(tmp_path, stage):
    """--vs aiter on upstream FlyDSL's small shape at 5 tokens (10 routing pairs over 8 experts),
    both arches: aiter's Triton MXFP4 MoE GEMM of the stage (its own config and alignment: every
    expert padded to BLOCK_SIZE_M) runs whole under flyquant.emu, every routed row within the
    derived bound of float64 recomputation (bench/peers_aiter_moe.tolerance), and is counted per
    useful MFMA as our row is."""
    skip_without_peer_triton()
    bench = load("moe_tile_n")
    argv = f"--stage {stage} --mode modelled --arch gfx950,gfx942 --shapes upstream-small --tokens 5 --tile-n 128"
    bench.main([*argv.split(), "--k-batch", "1", "--vs", "aiter", "--out", str(tmp_path)])
    payload = read_outputs(tmp_path, f"moe_gemm{stage}_tile_n_modelled")
    peers = payload["peers"]
    assert [(p["arch"], p["status"]) for p in peers] == [("gfx950", "ok"), ("gfx942", "ok")]
    for p in peers:
        (ours,) = [r for r in payload["rows"] if r["arch"] == p["arch"]]
        assert p["reduction"] == "exact" and p["rows_checked"] == 10, p
        assert p["rows_outside_tolerance"] == 0 and 0 < p["max_err_over_tol"] <= 1
        assert p["mfma_useful"] == ours["mfma_useful"] and p["mfma"] >= p["mfma_useful"]
        assert p["instr_per_useful_mfma"] == pytest.approx(p["wave_instr"] / ours["mfma_useful"])
        assert p["flyquant_vs_peer"] == pytest.approx(ours["instr_per_useful_mfma"] / p["instr_per_useful_mfma"])
        assert p["wg_working"] <= p["wg_launched"] and p["vgprs"] > 0 and p["workgroups_per_cu"] >= 1
    assert [p["config"].split()[0] for p in peers] == ["64x64x128", "256x256x64"]  # MI350X MX_FP4 file; default


def test_peer_kernel_with_scratch_runs_bit_exact():
    """torchao's dim0 cast, config 128x256 w4 s2, compiled for gfx950 without Triton's argument
    specialization (no 16-divisibility: as a shape that is not a multiple of 16 would be) spills
    VGPRs to scratch; under flyquant.emu its private segment and scratch loads/stores give a
    128x256 result bit-exact vs to_mx."""
    skip_without_peer_triton()
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    load("quantize")  # puts bench/ on sys.path for its peer modules
    import peers
    import peers_torchao

    fn = peers_torchao.load().to_mxfp8_dim0_kernel.fn
    sig = {"x_ptr": "*bf16", "output_ptr": "*fp8e4nv", "scale_ptr": "*u8", "n_rows": "i32", "n_cols": "i32",
           "ROW_TILE_SIZE": "constexpr", "COL_TILE_SIZE": "constexpr", "SCALE_BLOCK_SIZE": "constexpr",
           "SCALING_MODE": "constexpr"}
    consts = {"ROW_TILE_SIZE": 128, "COL_TILE_SIZE": 256, "SCALE_BLOCK_SIZE": 32, "SCALING_MODE": "rceil"}
    kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("hip", "gfx950", 64),
                            options={"num_warps": 4, "num_stages": 2})
    res = peers.resources(kernel)
    assert res.spills > 0 and res.scratch_bytes > 0
    x = (torch.randn(128, 256, generator=torch.Generator().manual_seed(20)) * 30).to(torch.bfloat16)
    data, scales = torch.empty(128, 256, dtype=torch.float8_e4m3fn), torch.empty(128, 8, dtype=torch.uint8)
    args = {"x_ptr": x, "output_ptr": data, "scale_ptr": scales, "n_rows": 128, "n_cols": 256}
    stats = peers.run_kernel(kernel, (1, 1), args)
    assert stats.by_opcode.get("scratch_store_dword", 0) > 0 and stats.by_opcode.get("scratch_load_dword", 0) > 0
    assert peers.difference("1x32", "rceil", x, data, scales) is None


def test_hardware_timing_holds_the_gpu_while_the_host_enqueues(monkeypatch):
    """Hardware mode's time_gpu on a stand-in torch.cuda (no GPU here), the order of what it puts
    on the stream: a first call (it compiles: not a host-time sample), then at least 3 warm-up
    calls timed on the host, the delay's calibration (two probe sleeps, each behind a sleep that
    keeps the GPU busy while it is enqueued, the cycles per microsecond from their difference),
    then per timed call a GPU delay of twice the host's time per call, the start event, the call,
    the end event, so the pair times the GPU's work, not the host's (helper-65: a start event fired
    while the host was still in Python for 0.15-1.5 ms). A call whose start event had already
    fired is counted late and the delay doubled."""
    common = load("common")
    log, spans = [], iter([1.0, 2.0])  # ms: the two probes (2^20 and 2^21 cycles): 2^20 cycles per ms
    fired = iter([False, True, False])  # the second timed call's start had fired before its end was enqueued

    class Event:
        def __init__(self, enable_timing):
            pass

        def record(self):
            log.append(("record",))

        def query(self):
            return next(fired)

        def elapsed_time(self, end):
            return next(spans, 0.005)  # then 5 us per timed call

    def call():
        time.sleep(0.002)  # the host's 2 ms of Python and launches
        log.append(("call",))

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: log.append(("sleep", cycles)), raising=False)
    t = common.time_gpu(call, warmup=1, iters=3, flush=False)
    assert t.gpu_delay and t.median_us == pytest.approx(5.0) and 2000 <= t.host_us < 20000 and t.late == 1
    probe = ["sleep", "record", "sleep", "record"]
    timed = ["sleep", "record", "call", "record"]
    assert [entry[0] for entry in log] == ["call"] * 4 + ["sleep"] + probe * 2 + timed * 3
    delays = [entry[1] for entry in log[13:] if entry[0] == "sleep"]
    per_us = (1 << 20) / 1000.0
    first = int(per_us * (2 * t.host_us + 20))
    assert delays == [first, first, 2 * first]  # doubled after the late call


@pytest.mark.gpu
@pytest.mark.parametrize(
    "script,args",
    [
        ("moe_tile_n", ["--shapes", "upstream-small", "--tokens", "5", "--tile-n", "128", "--k-batch", "1"]),
        ("quantize", ["--shapes", "256x1024", "--kinds", "1x32", "--modes", "rceil"]),
    ],
)
def test_bench_hardware(tmp_path, script, args):
    """On a real MI300X/MI355X: each script times a tiny config, flyquant's rows have times (and
    the quantize output was bit-exact before it was timed)."""
    bench = load(script)
    bench.main(["--mode", "hardware", "--iters", "5", "--warmup", "2", "--out", str(tmp_path), *args])
    payload = read_outputs(tmp_path, "moe_gemm2_tile_n_hardware" if script == "moe_tile_n" else f"{script}_hardware")
    ours = [r for r in payload["rows"] if r.get("impl") == "flyquant"]
    assert ours and all(r["median_us"] > 0 for r in ours)
    if script == "quantize":
        assert all(r["bit_exact"] for r in ours)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "script,args,stem",
    [
        ("moe_tile_n", ["--shapes", "upstream-small", "--tokens", "5", "--tile-n", "128", "--k-batch", "1"],
         "moe_gemm2_tile_n_hardware"),
        ("moe_layer", ["--shapes", "tiny", "--tokens", "3"], "moe_layer_hardware"),
    ],
)
def test_bench_hardware_vs_aiter(tmp_path, script, args, stem):
    """On a real MI300X/MI355X: --vs aiter times aiter's Triton kernels beside ours (and, in the
    layer bench, aiter's CK fused_moe, or the row says why aiter does not import)."""
    bench = load(script)
    bench.main(["--mode", "hardware", "--iters", "5", "--warmup", "2", "--vs", "aiter", "--out", str(tmp_path), *args])
    rows = json.loads((tmp_path / f"{stem}.json").read_text())["rows"]
    (triton,) = [r for r in rows if r.get("impl") == "aiter triton"]
    assert triton["median_us"] > 0 and triton["config"], triton
    assert [r for r in rows if r.get("impl") == "flyquant" and r["median_us"] > 0]
    if script == "moe_layer":
        (ck,) = [r for r in rows if r.get("impl") == "aiter ck fused_moe"]
        assert ck.get("median_us", 0) > 0 or ck["error"].startswith("aiter not importable"), ck


def test_bytes_in_flight_follows_vmcnt():
    """Two 16-byte loads (2 x 1 KiB per wave) in flight, a wait that leaves the newest one, a
    4-byte load (256 B) and a store (counted by vmcnt, 0 bytes): at most 2 KiB were outstanding;
    after vmcnt(0) a single load is 256 B."""
    common = load("quantize").common
    isa = """
        buffer_load_dwordx4 v[0:3], v4, s[0:3], 0 offen
        global_load_dwordx4 v[4:7], v[8:9], off
        s_waitcnt vmcnt(1)
        buffer_load_dword v10, v4, s[0:3], 0 offen
        buffer_store_dword v10, v4, s[4:7], 0 offen
        s_waitcnt vmcnt(0) lgkmcnt(0)
        buffer_load_dword v11, v4, s[0:3], 0 offen
    """
    assert common.bytes_in_flight_per_wave(isa) == 2 * 16 * 64
    assert common.bytes_in_flight_per_wave(isa.split("s_waitcnt vmcnt(0)")[1]) == 4 * 64


def test_tuning_table_is_what_the_selector_reads(tmp_path, monkeypatch):
    """The hardware sweep's tuning table (written from timed rows; here two made-up timings)
    gives the selector the faster config for exactly that (arch, shape, tokens)."""
    from flyquant import select, tuning

    bench = load("moe_tile_n")
    shape = bench.SHAPES["gptoss"]
    timed = [
        {
            "impl": "flyquant",
            "stage": 2,
            "arch": "gfx950",
            "shape": "gptoss",
            "tokens": 4,
            "tile_m": 16,
            "tile_n": n,
            "k_batch": kb,
            "waves": 2,
            "median_us": us,
        }
        for n, kb, us in ((128, 2, 30.0), (256, 1, 20.0))
    ] + [{"impl": "pytorch reference", "stage": 2, "arch": "gfx950", "shape": "gptoss", "tokens": 4, "median_us": 1.0}]
    path = bench.common.write_json(tmp_path / "tuning_gfx950.json", bench.tuning_table(timed, bench.SHAPES))
    monkeypatch.setenv("FLYQUANT_TUNING", str(path))
    key = {
        "tokens": 4,
        "topk": shape.topk,
        "experts": shape.experts,
        "model_dim": shape.model_dim,
        "inter_dim": shape.inter_dim,
    }
    assert tuning.tuned_config("moe_gemm2_a16w4", "gfx950", key) == {"tile_m": 16, "tile_n": 256, "k_batch": 1, "waves": 2}
    assert tuning.tuned_config("moe_gemm2_a16w4", "gfx942", key) == {}

    # a stage-1 sweep's table merged into the same file: both stages' entries, stage 1 without k_batch
    stage1 = [dict(r, stage=1, tile_n=64, k_batch=1, median_us=5.0) for r in timed[1:]]
    table = bench.merge_tuning(path, bench.tuning_table(stage1, bench.SHAPES))
    assert sorted(e["op"] for e in table["entries"]) == ["moe_gemm1_a16w4", "moe_gemm2_a16w4"]
    bench.common.write_json(path, table)
    assert tuning.tuned_config("moe_gemm1_a16w4", "gfx950", key) == {"tile_m": 16, "tile_n": 64, "waves": 2}
    assert tuning.tuned_config("moe_gemm2_a16w4", "gfx950", key)["tile_n"] == 256
    # a stage-2 sweep of another shape keeps this one's entry; sweeping this one again keeps the faster
    # timing (a narrower re-sweep replaced a whole sweep's winner)
    other = [dict(timed[1], shape="dsr1-i256")]
    bench.common.write_json(path, bench.merge_tuning(path, bench.tuning_table(other, bench.SHAPES)))
    assert tuning.tuned_config("moe_gemm2_a16w4", "gfx950", key)["tile_n"] == 256
    def stage2_tile_ns(rows):
        merged = bench.merge_tuning(path, bench.tuning_table(rows, bench.SHAPES), rows, bench.SHAPES)
        return {e["config"]["tile_n"] for e in merged["entries"] if e["op"] == "moe_gemm2_a16w4"
                and e["shape"]["topk"] == shape.topk}

    slower = [dict(timed[0], median_us=25.0)]
    assert stage2_tile_ns(slower) == {256}
    # unless the new sweep timed the old winner too: one comparison on one machine state decides
    assert stage2_tile_ns(slower + [dict(timed[1], median_us=26.0)]) == {128}
    again = [dict(timed[0], median_us=10.0)]
    table = bench.merge_tuning(path, bench.tuning_table(again, bench.SHAPES))
    assert len(table["entries"]) == 3
    bench.common.write_json(path, table)
    assert tuning.tuned_config("moe_gemm2_a16w4", "gfx950", key)["tile_n"] == 128
    x = torch.empty(1, dtype=torch.bfloat16).expand(4, 3072)
    w1 = torch.empty(1, dtype=torch.uint8).expand(shape.experts, 2 * 3072, 3072 // 2)
    emu.enable("gfx950")
    plan = select.plan_moe_gemm1_a16w4(x, w1, shape.topk, 16, shape.model_dim, shape.inter_dim, True, "swiglu_oai")
    assert plan.config["tile_n"] == 64, plan  # the selector alone picks 256 here
    # a table flyquant would refuse (it stopped every MoE call under FLYQUANT_TUNING) is set aside, not merged
    # (the sweep's own JSON is written before it)
    # an old entry no kernel takes is dropped, the rest kept
    bad = dict(table["entries"][0], config={"tile_m": 16, "tile_n": 512, "waves": 2})
    bench.common.write_json(path, {"entries": [bad] + table["entries"][1:]})
    merged = bench.merge_tuning(path, {"entries": []})
    assert len(merged["entries"]) == 2 and 512 not in {e["config"]["tile_n"] for e in merged["entries"]}
    path.write_text('{"entries": [{"op": "moe_gemm2_a16w4"}]}')
    assert bench.merge_tuning(path, bench.tuning_table(again, bench.SHAPES))["entries"][0]["config"]["tile_n"] == 128
    assert not path.exists() and "op" in (tmp_path / "tuning_gfx950.json.bak").read_text()


def test_moe_layer_bench_modelled(tmp_path):
    """bench/moe_layer.py on its smoke shape at 1 and 3 tokens: three launches per layer (sorting,
    stage 1, stage 2), the sorting kernel a small share of the layer (issue 16's target: < 5% at
    1 token), every launched GEMM workgroup storing at 1 token."""
    bench = load("moe_layer")
    bench.main("--mode modelled --arch gfx950,gfx942 --shapes tiny --tokens 1,3 --out".split() + [str(tmp_path)])
    payload = json.loads((tmp_path / "moe_layer_modelled.json").read_text())
    rows = payload["rows"]
    assert payload["mode"] == "modelled" and len(rows) == 12
    for tokens in (1, 3):
        for arch in ("gfx950", "gfx942"):
            layer = [r for r in rows if r["tokens"] == tokens and r["arch"] == arch]
            assert [r["kernel"].split("_")[1] for r in layer] == ["sorting", "gemm1", "gemm2"]
            assert all(r["launches"] == 3 and r["kernel"].endswith(arch) for r in layer)  # compiled for that arch
            assert abs(sum(r["share"] for r in layer) - 1) < 1e-9
    one = [r for r in rows if r["tokens"] == 1 and r["arch"] == "gfx942"]
    assert one[0]["share"] < 0.05
    assert all(r["storing"] == r["workgroups"] for r in one[1:])


def test_moe_layer_bench_vs_aiter_triton(tmp_path):
    """--vs aiter on the smoke shape at 1 token (2 routing pairs over 4 experts), both arches:
    aiter's Triton layer (alignment's 4 launches, stage 1, stage 2) runs whole under flyquant.emu,
    every routed row and every token's top-k sum within the derived bound of float64 from x
    (bench/peers_aiter_layer.check), and is counted as our layer row (launches, wave-instructions,
    bytes over the same compulsory bytes)."""
    skip_without_peer_triton()
    bench = load("moe_layer")
    bench.main("--mode modelled --arch gfx950,gfx942 --shapes tiny --tokens 1 --vs aiter --out".split() + [str(tmp_path)])
    payload = read_outputs(tmp_path, "moe_layer_modelled")
    peers = payload["peers"]
    assert [(p["arch"], p["status"]) for p in peers] == [("gfx950", "ok"), ("gfx942", "ok")]
    for p in peers:
        ours = [r for r in payload["rows"] if r["arch"] == p["arch"]]
        assert p["reduction"] == "exact" and p["rows_checked"] == 2 and p["tokens_summed"] == 1, p
        assert p["rows_outside_tolerance"] == 0 and 0 < p["max_err_over_tol"] <= 1
        assert p["launches"] == 6 and p["flyquant_launches"] == len(ours) == 3
        assert p["wave_instr"] == pytest.approx(p["align_wave_instr"] + p["stage1_wave_instr"] + p["stage2_wave_instr"])
        assert p["flyquant_wave_instr"] == sum(r["wave_instructions"] for r in ours)
        assert p["flyquant_vs_peer"] == pytest.approx(p["flyquant_wave_instr"] / p["wave_instr"])
        assert p["compulsory_bytes"] == ours[0]["layer_compulsory_bytes"] and p["traffic_vs_compulsory"] >= 1
    assert [p["config"].split()[0] for p in peers] == ["64x64x128", "256x256x64"]  # MI350X MX_FP4 file; default


@pytest.mark.parametrize("shape,act", [("gptoss", "swiglu_oai"), ("qwen3", "silu")])
def test_moe_stages_instr_bench(tmp_path, shape, act):
    """bench/moe_stages_instr.py at 1 token on gfx950: both stages emulated, every workgroup works,
    and stage 1's wave-instructions per MFMA are no more than stage 2's (issue 15's target)."""
    bench = load("moe_stages_instr")
    payload = bench.main(["--arch", "gfx950", "--tokens", "1", "--shapes", shape, "--out", str(tmp_path)])
    assert json.loads((tmp_path / "moe_stages_instr.json").read_text()) == payload
    s1, s2 = payload["rows"]
    assert (s1["stage"], s2["stage"]) == (1, 2) and s1["kernel"].startswith(f"moe_gemm1_a16w4_{act}")
    assert all(r["wg_working"] == r["wg_launched"] > 0 for r in (s1, s2))
    assert s1["instr_per_mfma"] <= s2["instr_per_mfma"]


def test_moe_stages_instr_bench_same_tiles(tmp_path):
    """--same-tiles at 16 tokens on gfx950, GPT-OSS-like: stage 2 runs stage 1's 16x256 tile
    without split K, and stage 1 executes no more per MFMA (before its sparse epilogue, 1.6% more:
    the dense activation of every padding row of a tile holding about one routed row)."""
    bench = load("moe_stages_instr")
    payload = bench.main(["--arch", "gfx950", "--tokens", "16", "--same-tiles", "--out", str(tmp_path)])
    s1, s2 = payload["rows"]
    assert (s1["tile_m"], s1["tile_n"]) == (s2["tile_m"], s2["tile_n"]) and s2["k_batch"] == 1
    assert s1["mfma"] == s2["mfma"] and s1["instr_per_mfma"] <= s2["instr_per_mfma"]


def test_grouped_mm_bench_modelled(tmp_path):
    """bench/grouped_mm.py's smallest configuration: M 384, N 256, K 256, E = 2 (groups of 192
    rows, so the middle m-tile has a group boundary at its row 64), gfx950, "mfma" scales. The
    grid's counters, which the bench builds from one emulated workgroup per tile class, are those
    of the whole launch emulated here: MFMAs, VALU, memory instructions, bytes and lines exactly;
    wave-instructions up to the static instructions in which the emulated specialization (N 128)
    differs from the launch's (N 256): at most that many per wave, per pass over K (two in the
    straddling tile)."""
    bench = load("grouped_mm")
    argv = "--mode modelled --arch gfx950 --shapes 384x256x256x2 --layouts mfma --out".split()
    bench.main([*argv, str(tmp_path)])
    (row,) = read_outputs(tmp_path, "grouped_mm_modelled")["rows"]
    assert (row["arch"], row["layout"], row["spills"]) == ("gfx950", "mfma", 0) and row["vgprs"] > 0
    assert row["grid_workgroups"] == row["wg_launched"] == row["wg_working"] == 3 * 2
    assert sorted((t["rows"], tuple(t["boundaries"]), t["cols"], t["workgroups"]) for t in row["tiles"]) == [
        (128, (), 128, 4), (128, (64,), 128, 2)]
    interior = next(t for t in row["tiles"] if not t["boundaries"])
    # its 128 rows of A and 128 columns of B with their scales, 128 x 128 bf16 out, offs: at least that
    assert interior["compulsory_bytes"] == 2 * 128 * 256 * 33 / 32 + 128 * 128 * 2 + 2 * 4
    assert interior["global_bytes"] >= interior["compulsory_bytes"]

    a, a_scale, b, b_scale, offs = bench.make_inputs(384, 256, 256, 2, [192, 384], "mfma", seed=0)
    assert offs.tolist() == bench.Shape("t", 384, 256, 256, 2).ends()
    out = emu.aligned_empty((384, 256), torch.bfloat16)
    common = bench.common
    _, whole, _ = common.emulate(lambda: bench.launch((a, a_scale, b, b_scale, offs), "gfx950", "mfma", 128, 128, False, out))
    est = row["counts"]
    for cls in ("mfma", "valu", "vmem_load", "vmem_store"):
        assert est["by_class"][cls] == whole.by_class[cls], cls
    for name, m in whole.memory.items():
        assert (est["memory"][name]["bytes"], est["memory"][name]["lines"]) == (m.bytes, m.lines), name
    waves, passes = 4, 2
    bound = row["isa_diff_vs_full_n"] * waves * passes * row["grid_workgroups"]
    assert abs(est["wave_instructions"] - whole.wave_instructions) <= bound
    assert row["verdict"] == ("met" if row["instr_per_mfma"] <= 3 and row["coalescing_operands"] >= 1 else "missed")


def test_grouped_mm_bench_groups_are_near_equal():
    """E groups of sizes differing by at most one row, summing to M: with M < E the rows are not all
    put in one group (the others empty), as they were in the last."""
    shape = load("grouped_mm").Shape
    for m, experts in ((5, 8), (100, 3), (16640, 8), (1, 1)):
        ends = shape("t", m, 32, 32, experts).ends()
        sizes = torch.tensor([0, *ends]).diff()
        assert len(ends) == experts and ends[-1] == m and sizes.min() >= 0 and sizes.max() - sizes.min() <= 1


def test_grouped_mm_bench_wgrad_modelled(tmp_path):
    """bench/grouped_mm.py --op wgrad on N 128, K 256 and groups of 160, 0 and 256 rows: the whole
    launch (1 x 2 n/k-tiles x 3 groups) emulated. Every workgroup stores (the empty group's zeros);
    the MFMAs are one per 16x16 block pair of a wave (4 x 4 in a 128x128 tile of 2x2 waves) per
    128-row step with rows of the group in it (160 rows: 2, 0 rows: none, 256 rows: 2)."""
    bench = load("grouped_mm")
    bench.main("--mode modelled --op wgrad --arch gfx950 --wgrad-shapes 128x256:160+0+256 --out".split() + [str(tmp_path)])
    (row,) = read_outputs(tmp_path, "grouped_mm_wgrad_modelled")["rows"]
    assert (row["arch"], row["m"], row["sizes"], row["spills"], row["model_spills"]) == ("gfx950", 416, [160, 0, 256], 0, 0)
    assert row["grid_workgroups"] == row["counts"]["workgroups_launched"] == row["wg_working"] == 6
    mfma = row["counts"]["by_class"]["mfma"]
    assert mfma == 2 * 4 * 16 * (2 + 0 + 2)
    assert row["instr_per_mfma"] == row["counts"]["wave_instructions"] / mfma


@pytest.mark.gpu
def test_grouped_mm_bench_hardware(tmp_path):
    """On a real MI300X/MI355X: the grouped GEMM bench times the kernel (both scale layouts) on a
    small shape, within bf16 rounding of bf16 torch._grouped_mm when that runs; every baseline is
    timed or gives its error."""
    bench = load("grouped_mm")
    bench.main(["--mode", "hardware", "--iters", "5", "--warmup", "2", "--shapes", "384x256x256x2",
                "--out", str(tmp_path)])
    rows = read_outputs(tmp_path, "grouped_mm_hardware")["rows"]
    timed = {r["impl"] for r in rows if r.get("median_us", 0) > 0}
    assert {"flyquant kernel (plain, 128x128)", "flyquant kernel (mfma, 128x128)"} <= timed, rows
    assert all("median_us" in r or "error" in r for r in rows if not r["shape"].startswith("geomean"))
    if select._rocm_arch_of(0) == "gfx950":  # the staged forward and the direct one
        bench.main(["--mode", "hardware", "--iters", "5", "--warmup", "2", "--shapes", "384x256x256x2", "--layouts",
                    "mfma", "--tile-m", "192", "--tile-n", "256", "--out", str(tmp_path / "lds")])
        staged = read_outputs(tmp_path / "lds", "grouped_mm_hardware")["rows"]
        assert {"flyquant kernel (mfma, 192x256 lds)", "flyquant kernel (mfma, 192x256)"} <= {
            r["impl"] for r in staged if r.get("median_us", 0) > 0}, staged
        rows += staged
    for r in rows:
        if r.get("rel_err_vs_bf16") is not None:  # K 256: fp32 sums, one bf16 rounding each side
            assert r["rel_err_vs_bf16"] < 2**-6, r


# (script, arguments, what argparse must say): each was a traceback (IndexError from --arch "", KeyError
# from moe_layer's --shapes, ValueError / RuntimeError from moe_stages_instr's unparsed lists,
# moe_tile_n's --k-batch x and --skew nan mid-sweep) or ran silently (--shapes "," ran the default sweep
# or nothing, zero or negative token counts / sizes ran, or gave ZeroDivisionError rows).
BAD_COMMAND_LINES = [
    ("quantize", ["--arch", ""], "argument --arch: '': expected a comma-separated list"),
    ("quantize", ["--arch", "gfx90a"], "argument --arch: 'gfx90a': unsupported arch 'gfx90a': flyquant kernels target"),
    ("quantize", ["--shapes", ","], "argument --shapes: ',': expected a comma-separated list"),
    ("quantize", ["--shapes", "0x32"], "argument --shapes: invalid shape_arg value: '0x32'"),
    ("quantize", ["--max-elements", "-1"], "argument --max-elements: invalid positive_int value: '-1'"),
    ("moe_layer", ["--shapes", "gptoss"], "unknown shape 'gptoss': choose from ['dsr1', 'gptoss120b', 'qwen3', 'tiny']"),
    ("moe_layer", ["--tokens", "0"], "argument --tokens: '0': 0 is not a positive integer"),
    ("moe_layer", ["--max-workgroups", "0"], "argument --max-workgroups: invalid positive_int value: '0'"),
    ("moe_tile_n", ["--k-batch", "sel,x"], "argument --k-batch: 'sel,x': invalid literal for int()"),
    ("moe_tile_n", ["--waves", "auto,0"], "argument --waves: 'auto,0': 0 is not a positive integer"),
    ("moe_tile_n", ["--skew", "nan"], "argument --skew: invalid _finite_float value: 'nan'"),
    ("moe_tile_n", ["--tokens", ","], "argument --tokens: ',': expected a comma-separated list"),
    ("grouped_mm", ["--shapes", "0x64x64x1"], "argument --shapes: unknown shape '0x64x64x1'"),
    ("grouped_mm", ["--tile-m", "-16"], "argument --tile-m: invalid positive_int value: '-16'"),
    ("moe_stages_instr", ["--arch", "gfx90a"], "argument --arch: 'gfx90a': unsupported arch"),
    ("moe_stages_instr", ["--tokens", "1,x"], "argument --tokens: '1,x': invalid literal for int()"),
    ("moe_stages_instr", ["--tokens", "-1"], "argument --tokens: '-1': -1 is not a positive integer"),
    # options that were accepted and then ignored or overridden
    ("quantize", ["--kinds", "1x32", "--modes", "even"], "no case to run"),
    ("moe_layer", ["--quick", "--tokens", "16"], "give --tokens or --quick, not both"),
    ("grouped_mm", ["--op", "wgrad", "--shapes", "grid"], "--op wgrad takes --wgrad-shapes, not --shapes"),
    ("grouped_mm", ["--op", "wgrad", "--mode", "hardware"], "--op wgrad: modelled mode only so far"),
]


@pytest.mark.parametrize("script, args, message", BAD_COMMAND_LINES,
                         ids=[f"{s}{'_'.join(a)}" for s, a, _ in BAD_COMMAND_LINES])
def test_bad_command_lines_are_argparse_errors(script, args, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        load(script).main([*args, "--out", str(tmp_path)])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("variable, value, message", [
    ("FLYQUANT_ARCH", "gfx942", "FLYQUANT_ARCH=gfx942 compiles every kernel for gfx942, so rows for --arch gfx950"),
    ("FLYQUANT_BACKEND", "reference", "FLYQUANT_BACKEND=reference: no kernel would run"),
])
def test_forcing_variables_are_refused(variable, value, message, tmp_path, monkeypatch):
    # the selector obeys them over the emulator's arch: rows labelled gfx950 held gfx942's counts
    monkeypatch.setenv(variable, value)
    with emu.record() as launches, pytest.raises(SystemExit, match=message):
        load("quantize").main(["--mode", "modelled", "--arch", "gfx950", "--shapes", "64x64", "--out", str(tmp_path)])
    assert launches == []
