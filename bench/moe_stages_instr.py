"""A16W4 MoE stage 1 vs stage 2 under flyquant.emu: executed wave-instructions per MFMA, per stage,
on issue 15's shapes (--shapes): GPT-OSS-like (hidden 2880 -> K 3072, inter 2880 -> 3072 rows per
half, 128 experts, top-4, swiglu_oai; both stages with a bias, as GPT-OSS has, bf16 as in its
checkpoint or fp32 as flyquant.nn stores it: --bias-dtype), DeepSeek-R1-like per rank (hidden
7168, inter 256, 256 experts, top-8, silu, no bias) and Qwen3-30B-A3B-like (hidden 2048, inter
768, 128 experts, top-8, silu, no bias), each stage on the config its selector picks for the
full shape from first principles (FLYQUANT_CONFIG and FLYQUANT_TUNING are refused), its rows
sorted at that config's tile_m (fused_moe sorts both stages at stage 2's).

    python bench/moe_stages_instr.py --arch gfx950,gfx942 --tokens 1,4,16 --shapes gptoss,dsr1,qwen3 --out results
    python bench/moe_stages_instr.py --same-tiles ...   # stage 2 on stage 1's tiles, no split K

Modelled, not timed. The N of each stage is cut (stage 1: inter 128 -> N 256; stage 2: model_dim
256) so a CPU emulates it in seconds: a working workgroup's work is the full shape's (same K, tiles,
waves, split), so the per-MFMA figure is that of the full launch's working workgroups, plus the
instructions of the cut launch's idle ones (tiles past the sorted rows; about 0.5% of the figure for
qwen3 at 16 tokens; WGs counts the working ones). Writes <out>/moe_stages_instr.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

import flyquant.emu as emu

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

SHAPES = {  # experts, topk, hidden, inter, activation, bias
    "gptoss": (128, 4, 2880, 2880, "swiglu_oai", True),
    "dsr1": (256, 8, 7168, 256, "silu", False),
    "qwen3": (128, 8, 2048, 768, "silu", False),
}
STAGE1_INTER, STAGE2_MODEL = 128, 256  # the cut N of each stage (see the docstring)


BIAS_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def measure(arch: str, tokens: int, seed: int = 0, bias_dtype: str = "bf16", shape: str = "gptoss",
            same_tiles: bool = False) -> list[dict]:
    emu.enable(arch)
    from flyquant import layouts, reference, toolchain
    from flyquant.kernels import moe_gemm1_a16w4 as k1
    from flyquant.kernels import moe_gemm2_a16w4 as k2
    from flyquant.moe import moe_sorting

    experts, topk, hidden, inter, act, has_bias = SHAPES[shape]
    k1_pad, k2_pad = (-(-d // 256) * 256 for d in (hidden, inter))  # the shuffles' K (GPT-OSS: 2880 -> 3072)
    gen = torch.Generator().manual_seed(seed)
    p1, s1 = reference.quantize_mxfp4(torch.randn(experts, 2 * STAGE1_INTER, k1_pad, generator=gen) * 0.05)
    p2, s2 = reference.quantize_mxfp4(torch.randn(experts, STAGE2_MODEL, k2_pad, generator=gen) * 0.05)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:topk] for _ in range(tokens)]).int()
    wts = torch.rand(tokens, topk, generator=gen)
    tm1, tn1 = k1.choose_config1(tokens, topk, experts, hidden, inter, arch)
    tm2, tn2, kb2 = (tm1, tn1, 1) if same_tiles else k2.choose_config(tokens, topk, experts, hidden, inter, arch)

    def bias(n):
        return torch.randn(experts, n, generator=gen).to(BIAS_DTYPES[bias_dtype]) if has_bias else None

    rows = []
    with toolchain.target(arch):
        with emu.record() as rec1:
            k1.moe_gemm1_a16w4(torch.randn(tokens, hidden, generator=gen).bfloat16(),
                               layouts.shuffle_weight_a16w4(p1, gate_up=True),
                               layouts.shuffle_scale_a16w4(s1, experts, gate_up=True),
                               *moe_sorting(ids, wts, experts, tm1), arch=arch, topk=topk, block_m=tm1,
                               activation=act, bias=bias(2 * STAGE1_INTER),
                               model_dim=hidden, inter_dim=STAGE1_INTER, tile_m=tm1, tile_n=tn1)
        with emu.record() as rec2:
            k2.moe_gemm2_a16w4(torch.randn(tokens * topk, inter, generator=gen).bfloat16(),
                               layouts.shuffle_weight_a16w4(p2), layouts.shuffle_scale_a16w4(s2, experts),
                               *moe_sorting(ids, wts, experts, tm2), arch=arch, topk=topk, block_m=tm2,
                               bias=bias(STAGE2_MODEL),
                               model_dim=STAGE2_MODEL, inter_dim=inter, tile_m=tm2, tile_n=tn2, k_batch=kb2)
    for stage, rec, cfg in ((1, rec1, (tm1, tn1, 1)), (2, rec2, (tm2, tn2, kb2))):
        st = rec[0].stats
        mfma = sum(v for k, v in st.by_opcode.items() if k.startswith("v_mfma"))
        rows.append({"shape": shape, "arch": arch, "tokens": tokens, "stage": stage, "kernel": st.kernel, "tile_m": cfg[0],
                     "tile_n": cfg[1], "k_batch": cfg[2], "waves": st.waves_per_workgroup,
                     "wg_launched": st.workgroups_launched, "wg_working": st.workgroups_with_global_store,
                     "wave_instr": st.wave_instructions, "mfma": mfma,
                     "instr_per_mfma": st.wave_instructions / mfma if mfma else None, "bias_dtype": bias_dtype})
    return rows


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=common.arch_list, default="gfx950,gfx942", help="comma-separated: gfx950, gfx942")
    ap.add_argument("--tokens", type=common.positive_ints, default="1,4,16", help="comma-separated token counts")
    ap.add_argument("--bias-dtype", default="bf16", choices=sorted(BIAS_DTYPES), help="both stages' bias (gptoss)")
    ap.add_argument("--shapes", type=common.csv_list, default=["gptoss"], help=f"comma-separated, of {sorted(SHAPES)}")
    ap.add_argument("--same-tiles", action="store_true",
                    help="stage 2 on stage 1's tile_m x tile_n without split K (issue 15's like-for-like comparison)")
    ap.add_argument("--out", default="bench-results", help="output directory")
    args = ap.parse_args(argv)
    for name in args.shapes:  # else a KeyError traceback once the sweep reached it
        if name not in SHAPES:
            ap.error(f"unknown shape {name!r}: choose from {sorted(SHAPES)}")
    common.refuse_forcing_env(args.arch, first_principles=True)
    rows = [r for shape in args.shapes for arch in args.arch for t in args.tokens
            for r in measure(arch, t, bias_dtype=args.bias_dtype, shape=shape, same_tiles=args.same_tiles)]
    print(f"{'shape':7} {'arch':7} {'T':>3} {'stage':>5} {'tile':>10} {'kb':>3} {'WGs':>4} {'instr/MFMA':>10}  kernel  "
          "(modelled, not timed)")
    for r in rows:
        print(f"{r['shape']:7} {r['arch']:7} {r['tokens']:3} {r['stage']:5} {r['tile_m']:>4}x{r['tile_n']:<5} "
              f"{r['k_batch']:3} {r['wg_working']:4} {r['instr_per_mfma']:10.2f}  {r['kernel']}")
    payload = {"label": "modelled, not timed (flyquant.emu)", "args": vars(args), "environment": common.environment(),
               "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "moe_stages_instr.json").write_text(json.dumps(payload, indent=1))
    return payload


if __name__ == "__main__":
    sys.exit(main() and 0)
