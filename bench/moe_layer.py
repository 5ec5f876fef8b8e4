"""The whole A16W4 MoE layer (fq.fused_moe: moe_sorting, stage 1, stage 2) per launch.

Hardware mode (a ROCm GPU): the layer's time (median of --iters, caches flushed). Modelled mode
(no AMD GPU): the layer under flyquant.emu, never timed: per launch the kernel, workgroups
launched and storing, wave-instructions executed, and the sorting kernel's share of the layer's
wave-instructions; for the layer, its global bytes over the compulsory bytes (`compulsory_bytes`). Weights are random bytes in the shuffled layouts (every byte is a valid
E2M1 pair; scales near 2^0): the instruction stream does not depend on their values.

    python bench/moe_layer.py --quick                       # GPT-OSS-120B at 1 and 4 tokens, gfx950
    python bench/moe_layer.py --shapes gptoss120b,dsr1 --tokens 1,4,16,128,1024 --arch gfx950,gfx942
    python bench/moe_layer.py --mode modelled --quick --arch gfx950,gfx942 --vs aiter   # aiter's layer beside ours

--vs aiter (modelled): aiter's Triton MXFP4 MoE layer (alignment, both GEMMs) on the same x and
routing, counted as our row (bench/peers_aiter_layer.py); on a GPU, timed beside ours
(bench/peers_aiter_gpu.py).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import moe_tile_n_report  # noqa: E402
import peers_aiter_gpu  # noqa: E402
import peers_aiter_layer  # noqa: E402

import flyquant as fq  # noqa: E402


@dataclass(frozen=True)
class LayerShape:
    name: str
    experts: int
    topk: int
    model_dim: int  # true hidden size
    inter_dim: int  # true intermediate size
    activation: str
    biases: bool
    why: str


SHAPES = {
    "gptoss120b": LayerShape("gptoss120b", 128, 4, 2880, 2880, "swiglu_oai", True,
                             "GPT-OSS-120B: inter 2880 padded to 3072 for the shuffles, biases, clamped swiglu"),
    "dsr1": LayerShape("dsr1", 256, 8, 7168, 256, "silu", False, "DeepSeek-R1-like per rank: E 256, topk 8, inter 256"),
    "qwen3": LayerShape("qwen3", 128, 8, 2048, 768, "silu", False, "Qwen3-30B-A3B: E 128, topk 8, inter 768 (flyquant.nn.patch_moe)"),
    "tiny": LayerShape("tiny", 4, 2, 224, 224, "swiglu_oai", True, "smoke test: padded dims, biases, seconds to emulate"),
}
SCALE_ONE = 127  # E8M0 code of 2^0
FP4_BYTES, SCALE_BYTES, BF16_BYTES, ROUTE_BYTES = 0.5, 1 / 32, 2, 8  # per weight element; per pair (id + weight)
MAX_WORKGROUPS = 48  # --vs: working workgroups of aiter's wider stage emulated per layer
PEERS = {"aiter": peers_aiter_layer}


def _pad(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def make_layer(shape: LayerShape, tokens: int, seed: int) -> dict:
    """Random inputs of the layer's true sizes; weights padded as the shuffles require."""
    g = torch.Generator().manual_seed(seed)
    k1, p = _pad(shape.model_dim, 256), _pad(shape.inter_dim, 256)  # w1's K, the gate/up halves and w2's K
    n2 = _pad(shape.model_dim, 32)
    e = shape.experts

    def fp4(*size):
        return torch.randint(0, 256, size, generator=g, dtype=torch.uint8)

    def scales(*size):  # codes 125..129: values of a normal magnitude
        return (SCALE_ONE - 2 + torch.randint(0, 5, size, generator=g, dtype=torch.uint8)).view(torch.float8_e8m0fnu)

    logits = torch.randn(tokens, e, generator=g)
    weights, ids = fq.moe_routing(logits, shape.topk, softmax_after_topk=True)
    bias = (lambda *s: torch.randn(*s, generator=g).to(torch.bfloat16)) if shape.biases else (lambda *s: None)
    return dict(x=torch.randn(tokens, shape.model_dim, generator=g).to(torch.bfloat16),
                w1=fp4(e, 2 * p, k1 // 2), w1_scale=scales(e * 2 * p, k1 // 32),
                w2=fp4(e, n2, p // 2), w2_scale=scales(e * n2, p // 32),
                topk_weights=weights, topk_ids=ids, b1=bias(e, 2 * p), b2=bias(e, n2))


def run_layer(shape: LayerShape, t: dict):
    return fq.fused_moe(t["x"], t["w1"], t["w1_scale"], t["w2"], t["w2_scale"], t["topk_weights"], t["topk_ids"],
                        b1=t["b1"], b2=t["b2"], activation=shape.activation, model_dim=shape.model_dim,
                        inter_dim=shape.inter_dim)


def compulsory_bytes(shape: LayerShape, topk_ids: torch.Tensor) -> int:
    """Bytes any implementation of the layer moves at least once: the active experts' FP4 weights and
    E8M0 scales of both stages at the true sizes (and biases), x, the output, and the routing."""
    d, i = shape.model_dim, shape.inter_dim
    per_expert = 3 * d * i * (FP4_BYTES + SCALE_BYTES)  # w1 (2 i x d) and w2 (d x i)
    per_expert += (2 * i + d) * BF16_BYTES if shape.biases else 0
    tokens = topk_ids.shape[0]
    return int(topk_ids.unique().numel() * per_expert + 2 * tokens * d * BF16_BYTES + topk_ids.numel() * ROUTE_BYTES)


def modelled(shape: LayerShape, tokens: int, arch: str, seed: int, vs=(), max_workgroups=MAX_WORKGROUPS):
    """(per-launch rows of our layer, the peers' layer rows)."""
    t = make_layer(shape, tokens, seed)
    fq.emu.enable(arch)  # the selector plans, and the ops compile, for the emulator's arch
    with fq.emu.record() as records:
        run_layer(shape, t)
    total = sum(r.stats.wave_instructions for r in records)
    moved = sum(common.Counts.of(r.stats).mem(common.GLOBAL_CLASSES).bytes for r in records)
    minimum = compulsory_bytes(shape, t["topk_ids"])
    rows = []
    for r in records:
        s = r.stats
        rows.append(dict(shape=shape.name, arch=arch, tokens=tokens, kernel=r.kernel,
                         workgroups=s.workgroups_launched, storing=s.workgroups_with_global_store,
                         wave_instructions=s.wave_instructions, share=s.wave_instructions / total if total else 0.0,
                         layer_wave_instructions=total, launches=len(records), layer_global_bytes=moved,
                         layer_compulsory_bytes=minimum, layer_traffic_vs_compulsory=moved / minimum))
    ours = dict(launches=len(records), wave_instructions=total, global_bytes=moved, compulsory_bytes=minimum)
    return rows, [PEERS[v].compare(shape, t, arch, max_workgroups, seed, ours) for v in vs]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_common_args(parser)
    parser.add_argument("--shapes", type=common.csv_list, default=["gptoss120b"], help=f"of {sorted(SHAPES)}")
    parser.add_argument("--tokens", type=common.positive_ints, default=None,
                        help="comma-separated token counts (default: 1,4,16,128,1024; --quick: 1,4)")
    parser.add_argument("--vs", type=common.csv_list, default=[], help=f"peers beside our layer: {','.join(PEERS)}")
    parser.add_argument("--max-workgroups", type=common.positive_int, default=MAX_WORKGROUPS,
                        help="--vs, modelled: working workgroups of the peer's wider stage emulated per layer")
    args = parser.parse_args(argv)
    for peer in args.vs:
        if peer not in PEERS:
            parser.error(f"unknown peer {peer!r}: choose from {sorted(PEERS)}")
    for name in args.shapes:  # else a KeyError traceback when the sweep reached it
        if name not in SHAPES:
            parser.error(f"unknown shape {name!r}: choose from {sorted(SHAPES)}")
    if args.tokens is None:
        args.tokens = [1, 4] if args.quick else [1, 4, 16, 128, 1024]
    elif args.quick:
        parser.error("--quick chooses the token counts (1,4); give --tokens or --quick, not both")
    mode, archs = common.resolve_mode(args.mode, args.arch)
    rows, peer_rows = [], []
    for name in args.shapes:
        shape = SHAPES[name]
        for tokens in args.tokens:
            for arch in archs:
                if mode == "hardware":
                    t = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in make_layer(shape, tokens, args.seed).items()}
                    timing = common.time_gpu(lambda: run_layer(shape, t), warmup=args.warmup, iters=args.iters,
                                             flush=not args.no_flush)
                    rows.append(dict(shape=name, arch=arch, tokens=tokens, impl="flyquant", **asdict(timing)))
                    for peer in args.vs:
                        rows += peers_aiter_gpu.time_layer(peers_aiter_layer.moe_shape(shape), t, arch, args)
                else:
                    ours, theirs = modelled(shape, tokens, arch, args.seed, args.vs, args.max_workgroups)
                    rows.extend(ours)
                    peer_rows.extend(theirs)
                    print(f"  {name} T={tokens} {arch}: ok" + "".join(f"; {p['peer']}: {p['status']}" for p in theirs),
                          flush=True)
    if mode == "hardware":
        keys = dict.fromkeys(k for r in rows for k in r if k not in ("shape", "arch", "tokens"))
        columns = [("shape", "shape"), ("arch", "arch"), ("tokens", "T")] + [(k, k) for k in keys]
    else:
        print("MoE layer: modelled, not timed (flyquant.emu counts; no GPU was used)")
        columns = [("shape", "shape"), ("arch", "arch"), ("tokens", "T"), ("launches", "launches"), ("kernel", "kernel"),
                   ("workgroups", "WG"), ("storing", "WG storing"), ("wave_instructions", "wave-instr"),
                   ("share", "share of layer"), ("layer_traffic_vs_compulsory", "layer traffic/min")]
    common.print_table(rows, columns)
    if peer_rows:
        peers_aiter_layer.print_rows(peer_rows)
    path = common.write_json(args.out / f"moe_layer_{mode}.json",
                             dict(mode=mode, shapes={n: asdict(SHAPES[n]) for n in args.shapes}, rows=rows,
                                  peers=peer_rows, environment=common.environment()))
    png = plot(rows, peer_rows, args.out / f"moe_layer_{mode}.png") if mode == "modelled" else None
    print(f"wrote {path}" + (f" and {png}" if png else ""))
    return 0


def plot(rows: list[dict], peer_rows: list[dict], path: Path):
    """Wave-instructions per layer by token count, one line per (shape, arch); peers dashed in their colour."""
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    layers = {(r["shape"], r["arch"], r["tokens"]): r["layer_wave_instructions"] for r in rows}
    for key in dict.fromkeys((s, a) for s, a, _ in layers):
        pts = sorted((tk, v) for (s, a, tk), v in layers.items() if (s, a) == key)
        style = "o-" if key[1] == "gfx950" else "o--"
        ax.plot(*zip(*pts), style, color="tab:blue", label=f"flyquant {key[0]} {key[1]}")
        theirs = sorted((p["tokens"], p["wave_instr"]) for p in peer_rows
                        if p.get("status") == "ok" and (p["shape"], p["arch"]) == key)
        if theirs:
            ax.plot(*zip(*theirs), "s:", color=moe_tile_n_report.PEER_COLOUR,
                    label=f"{peers_aiter_layer.NAME} {key[0]} {key[1]}")
    ax.set(xscale="log", yscale="log", xlabel="tokens", ylabel="wave-instructions per layer (modelled)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


if __name__ == "__main__":
    sys.exit(main())
