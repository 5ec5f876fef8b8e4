"""The A16W4 MoE GEMM benchmark's inputs, for either stage: the layer shapes, each stage's view of
them (its N, K, weights and activation rows), routing, weights, one (stage, shape, tokens, block
size) problem with the m-tiles that hold work, the configs to run, and the figures that do not
depend on the kernel (useful MFMAs, compulsory bytes, FLOPs).

Stage 1 (gate/up, activation fused): a2 (T*topk, inter_dim) = act(x (T, model_dim) @ W1[e]^T),
N = 2 * inter_dim (gate rows then up rows), K = model_dim, no split K.
Stage 2 (down): out (T, model_dim) += a2 @ W2[e]^T, N = model_dim, K = inter_dim.
"""

from __future__ import annotations

import importlib
import math
import re
import zlib
from dataclasses import dataclass

import torch

import flyquant as fq
import flyquant.emu as emu
from flyquant import layouts, select
from flyquant.arch import arch_info
from flyquant.moe import TOKEN_BITS, TOKEN_MASK

TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)
FP4_PER_BYTE = 2
MX_BLOCK = 32  # FP4 values per E8M0 scale
BF16_BYTES = 2
W_SCALE_CODES = (119, 127)  # random E8M0 weight scales 2^-8 .. 2^0 (any finite code works)


@dataclass(frozen=True)
class MoeShape:
    """One MoE layer: model_dim (hidden) and inter_dim (per expert) true sizes, padded to w_n and
    w_k in the weights (aiter's scale shuffle needs K % 256 == 0); stage 1's activation and
    whether it has a bias (stage 2's bias is not benchmarked)."""

    name: str
    model_dim: int
    inter_dim: int
    experts: int
    topk: int
    w_n: int  # model_dim padded
    w_k: int  # inter_dim padded
    activation: str = "silu"
    bias: bool = False
    tokens: tuple = TOKENS
    why: str = ""


# fmt: off
SHAPES = {s.name: s for s in (
    #        name               model  inter    E topk   w_n   w_k
    MoeShape("gptoss",           2880,  2880, 128, 4,   3072, 3072, "swiglu_oai", True, why="GPT-OSS-120B, padded to 3072 as deployed"),
    MoeShape("gptoss-3072",      3072,  3072, 128, 4,   3072, 3072, "swiglu_oai", True, why="upstream FlyDSL's GPT-OSS-like shape"),
    MoeShape("dsr1-i256",        7168,   256, 256, 8,   7168,  256, why="DeepSeek-R1, inter_dim 2048 over 8 ranks"),
    MoeShape("dsr1-i1024",       7168,  1024, 256, 8,   7168, 1024, why="DeepSeek-R1, inter_dim 2048 over 2 ranks"),
    MoeShape("dsr1-i2048",       7168,  2048, 256, 8,   7168, 2048, why="DeepSeek-R1, whole experts"),
    MoeShape("dsr1-i2048-e384",  7168,  2048, 384, 8,   7168, 2048, why="384 experts (Kimi-K2 class)"),
    MoeShape("upstream-small",    256,   512,   8, 2,    256,  512, tokens=(5,), why="upstream FlyDSL's small shape"),
)}
# fmt: on


@dataclass(frozen=True)
class Stage:
    """One GEMM of the layer, as the benchmark sees it (module docstring)."""

    number: int

    @property
    def op(self) -> str:
        return f"moe_gemm{self.number}_a16w4"

    @property
    def weight(self) -> str:
        return f"w{self.number}"

    def kernel(self):
        """The stage's launcher module (imported once the emulator is enabled)."""
        return importlib.import_module(f"flyquant.kernels.{self.op}")

    def n(self, s: MoeShape) -> int:
        return 2 * s.inter_dim if self.number == 1 else s.model_dim

    def k(self, s: MoeShape) -> int:
        return s.model_dim if self.number == 1 else s.inter_dim

    def weight_shape(self, s: MoeShape) -> tuple[int, int]:
        """(rows, K) of one expert's weights as laid out: stage 1 gate rows then up rows."""
        return (2 * s.w_k, s.w_n) if self.number == 1 else (s.w_n, s.w_k)

    def a_shape(self, s: MoeShape, tokens: int) -> tuple[int, int]:
        """The activations the GEMM reads: x (T, model_dim) or a2 (T*topk, inter_dim), padded."""
        return (tokens, s.w_n) if self.number == 1 else (tokens * s.topk, s.w_k)

    def out_shape(self, s: MoeShape, tokens: int) -> tuple[int, int]:
        return (tokens * s.topk, s.inter_dim) if self.number == 1 else (tokens, s.model_dim)


STAGES = {1: Stage(1), 2: Stage(2)}


def routing(shape: MoeShape, tokens: int, skew: float, seed: int):
    """(topk_ids int32 (T, topk), topk_weights f32 (T, topk)): distinct experts per token, drawn
    with popularity (rank + 1)^-skew over a random ranking of the experts (skew 0: uniform);
    weights a softmax over the chosen slots, as after a router's top-k."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}/{shape.name}/{tokens}".encode()))
    popularity = torch.empty(shape.experts)
    popularity[torch.randperm(shape.experts, generator=gen)] = (torch.arange(shape.experts) + 1.0) ** -skew
    ids = torch.multinomial(popularity.expand(tokens, -1), shape.topk, replacement=False, generator=gen)
    weights = torch.softmax(torch.randn(tokens, shape.topk, generator=gen), dim=-1)
    return ids.to(torch.int32), weights, gen


class Weights:
    """One stage's weights (E, rows, K/2) and scales (E*rows, K/32) in aiter's A16W4 layouts (stage 1:
    gate_up=True), plus stage 1's bf16 bias when the shape has one, filled expert by expert on
    demand: random FP4 bytes and E8M0 codes, each expert from its own seed (its weights do not
    depend on which others are built). Experts never filled are never read by the launches that
    use this object (their memory is not even backed on a CPU)."""

    def __init__(self, stage: Stage, shape: MoeShape, seed: int, device):
        self.stage, self.shape, self.seed, self.device = stage, shape, seed, device
        rows, k = stage.weight_shape(shape)
        self.w = emu.aligned_empty((shape.experts, rows, k // FP4_PER_BYTE), torch.uint8, device)
        self.scale = emu.aligned_empty((shape.experts * rows, k // MX_BLOCK), torch.uint8, device)
        self.bias = None
        if stage.number == 1 and shape.bias:
            gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}/{shape.name}/bias".encode()))
            self.bias = emu.aligned(torch.randn(shape.experts, rows, generator=gen).to(torch.bfloat16).to(device))
        self.filled: set[int] = set()

    def dense(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert e's weights before aiter's shuffles: FP4 bytes (1, rows, K/2) and E8M0 codes
        (rows, K/32), padded sizes (Stage.weight_shape), from the expert's own seed."""
        s, (lo, hi) = self.shape, W_SCALE_CODES
        rows, k = self.stage.weight_shape(s)
        gen = torch.Generator(device=self.device).manual_seed(zlib.crc32(f"{self.seed}/{s.name}/{e}".encode()))
        packed = torch.randint(0, 256, (1, rows, k // FP4_PER_BYTE), dtype=torch.uint8, generator=gen,
                               device=self.device)
        codes = torch.randint(lo, hi + 1, (rows, k // MX_BLOCK), dtype=torch.uint8, generator=gen, device=self.device)
        return packed, codes

    def fill(self, experts) -> "Weights":
        gate_up = self.stage.number == 1
        rows, _ = self.stage.weight_shape(self.shape)
        for e in sorted(set(experts) - self.filled):
            packed, codes = self.dense(e)
            self.w[e] = layouts.shuffle_weight_a16w4(packed, gate_up=gate_up)[0]
            self.scale[e * rows : (e + 1) * rows] = layouts.shuffle_scale_a16w4(codes, 1, gate_up=gate_up)
            self.filled.add(e)
        return self


@dataclass
class Problem:
    """One (stage, shape, token count, block size): routing, moe_sorting's outputs, the stage's
    activations `a` (x or a2), and the m-tiles that hold routing pairs."""

    stage: Stage
    shape: MoeShape
    tokens: int
    tile_m: int
    sorting: tuple  # (sorted_ids, sorted_weights, sorted_expert_ids, num_valid_ids)
    a: torch.Tensor  # Stage.a_shape, bf16
    work_tiles: torch.Tensor  # indices of the m-tiles whose rows hold routing pairs
    valid_rows: torch.Tensor  # routing pairs in each of them
    experts_active: int
    topk_ids: torch.Tensor  # routing (T, topk) int32, as `routing` drew it
    topk_weights: torch.Tensor  # (T, topk) f32


def build_problem(stage: Stage, shape: MoeShape, tokens: int, tile_m: int, skew: float, seed: int, device) -> Problem:
    ids, weights, gen = routing(shape, tokens, skew, seed)
    sorting = tuple(
        emu.aligned(t) for t in fq.moe_sorting(ids.to(device), weights.to(device), shape.experts, tile_m)
    )
    a = emu.aligned(torch.randn(*stage.a_shape(shape, tokens), generator=gen).to(torch.bfloat16).to(device))
    sorted_ids, _, _, num_valid = (t.cpu() for t in sorting)
    used = int(num_valid[0]) // tile_m
    tok = (sorted_ids[: used * tile_m] & TOKEN_MASK).view(used, tile_m)
    valid = (tok < tokens).sum(dim=1)
    work = valid.nonzero().flatten()
    return Problem(stage, shape, tokens, tile_m, sorting, a, work, valid[work], int(ids.unique().numel()), ids, weights)


def systematic_sample(tiles: torch.Tensor, fill: torch.Tensor, count: int) -> torch.Tensor:
    """`count` of the m-tiles `tiles` (holding `fill` routing pairs each), evenly spaced in the order
    of their fill, in index order: the sample's fill spreads like the whole launch's."""
    by_fill = tiles[torch.argsort(fill, stable=True)]
    return by_fill[torch.linspace(0, len(tiles) - 1, count).round().long()].sort().values


def padded_sorting(p: Problem, keep: torch.Tensor) -> tuple:
    """moe_sorting's outputs with the rows of every m-tile not in `keep` turned into padding
    (id (topk << 24) | T, weight 0): same lengths, so the same grid and the same m-tile scan,
    the other tiles without work."""
    sorted_ids, sorted_weights, sorted_expert_ids, num_valid = p.sorting
    kept_rows = torch.zeros(sorted_ids.numel(), dtype=torch.bool)
    kept_rows[(keep[:, None] * p.tile_m + torch.arange(p.tile_m)).flatten()] = True
    kept_rows = kept_rows.to(sorted_ids.device)
    pad = (p.shape.topk << TOKEN_BITS) | p.tokens
    return (
        emu.aligned(torch.where(kept_rows, sorted_ids, pad)),
        emu.aligned(torch.where(kept_rows, sorted_weights, 0.0)),
        sorted_expert_ids,
        num_valid,
    )


def gathered_sorting(p: Problem, keep: torch.Tensor, in_use: bool = True) -> tuple:
    """moe_sorting-shaped arrays holding only the m-tiles in `keep` (block_m = tile_m, so each
    tile keeps its expert id); in_use=False: num_valid_ids says no row is in use."""
    sorted_ids, sorted_weights, sorted_expert_ids, num_valid = p.sorting
    rows = (keep[:, None] * p.tile_m + torch.arange(p.tile_m)).flatten().to(sorted_ids.device)
    used = rows.numel() if in_use else 0
    return (
        emu.aligned(sorted_ids[rows]),
        emu.aligned(sorted_weights[rows]),
        emu.aligned(sorted_expert_ids[keep.to(sorted_ids.device)]),
        emu.aligned(torch.tensor([used, p.tokens], dtype=torch.int32, device=num_valid.device)),
    )


def useful_mfmas(p: Problem, arch: str) -> int:
    """MFMAs the routed rows need: per tile with work, its 16-row blocks holding pairs x the stage's
    16-column blocks of N x the MFMA's K steps (16x16x32 on gfx950, 16x16x16 on gfx942)."""
    mfma_k = int(re.search(r"(\d+)x(\d+)x(\d+)", arch_info(arch).bf16_mfma).group(3))
    mn = p.stage.kernel().MFMA_MN
    row_blocks = int(((p.valid_rows + mn - 1) // mn).sum())
    return row_blocks * math.ceil(p.stage.n(p.shape) / mn) * math.ceil(p.stage.k(p.shape) / mfma_k)


def compulsory_bytes(p: Problem) -> int:
    """Bytes any implementation moves at least once: the active experts' FP4 weights and E8M0
    scales (true sizes) and biases, the activations read (x, or a2), the bf16 output (a2, or out),
    and the sorted ids and weights in use."""
    s, st = p.shape, p.stage
    n, k = st.n(s), st.k(s)
    weights = p.experts_active * n * (k * (1 / FP4_PER_BYTE + 1 / MX_BLOCK) + (BF16_BYTES if st.number == 1 and s.bias else 0))
    a = st.a_shape(s, p.tokens)[0] * k * BF16_BYTES
    out = math.prod(st.out_shape(s, p.tokens)) * BF16_BYTES
    ids = int(p.sorting[3][0]) * 8
    return int(weights + a + out + ids)


def flops(p: Problem) -> float:
    return 2.0 * p.tokens * p.shape.topk * p.stage.n(p.shape) * p.stage.k(p.shape)


# ---- configs ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    tile_m: int
    tile_n: int
    k_batch: int  # 1 for stage 1
    waves: int  # per workgroup


def selector_choice(stage: Stage, shape: MoeShape, tokens: int, device) -> tuple[Config | None, str]:
    """The config the public API would run (moe_block_m, then the plan), or None and why not."""
    tile_m = fq.moe_block_m(tokens, shape.topk, shape.experts, shape.model_dim, shape.inter_dim, device)
    # the planner reads shapes, dtypes and the device only: stride-0 views cost no memory
    a = torch.empty(1, dtype=torch.bfloat16, device=device).expand(*stage.a_shape(shape, tokens))
    rows, k = stage.weight_shape(shape)
    w = torch.empty(1, dtype=torch.uint8, device=device).expand(shape.experts, rows, k // FP4_PER_BYTE)
    try:
        if stage.number == 1:
            plan = select.plan_moe_gemm1_a16w4(a, w, shape.topk, tile_m, shape.model_dim, shape.inter_dim, shape.bias,
                                               shape.activation)
        else:
            plan = select.plan_moe_gemm2_a16w4(a, w, shape.topk, tile_m, shape.model_dim, shape.inter_dim,
                                               torch.bfloat16, False)
    except Exception as exc:  # reported in the output: the sweep itself does not need the selector
        return None, f"the selector failed: {type(exc).__name__}: {exc}"
    if plan.backend != "flydsl":
        return None, str(plan)
    c = plan.config
    return Config(c["tile_m"], c["tile_n"], c.get("k_batch", 1), c["waves"]), str(plan)


def configs_for(stage: Stage, shape: MoeShape, args, chosen: Config | None, auto_tile_m: int) -> list[Config]:
    """The sweep's configs: --tile-m x --tile-n x --k-batch ("sel": the selector's) x --waves
    ("auto": the kernel's default for the config). Stage 1 has no split K: every value is 1."""
    kernel = stage.kernel()
    tile_ms = [auto_tile_m if m == "auto" else int(m) for m in args.tile_m]
    n_kt = kernel.k_iterations(stage.k(shape))
    out = []
    for tile_m in dict.fromkeys(tile_ms):
        for tile_n in args.tile_n:
            for kb in args.k_batch:
                if kb == "sel":
                    if chosen is None:
                        continue
                    kb = chosen.k_batch
                kb = 1 if stage.number == 1 else int(kb)
                for w in args.waves:
                    waves = (kernel.default_waves(tile_m, tile_n, n_kt, kb, pair=stage.number == 1)
                             if w == "auto" else int(w))
                    cfg = Config(tile_m, tile_n, kb, waves)
                    if cfg not in out:
                        out.append(cfg)
    return out


def launch(p: Problem, arch: str, cfg: Config, sorting, weights: Weights, out=None):
    """The stage's torch-facing launcher with an explicit config."""
    s, kernel = p.shape, p.stage.kernel()
    both = dict(arch=arch, topk=s.topk, block_m=p.tile_m, out=out, model_dim=s.model_dim, inter_dim=s.inter_dim,
                tile_m=cfg.tile_m, tile_n=cfg.tile_n, waves=cfg.waves)  # the arguments both stages take
    if p.stage.number == 1:
        return kernel.moe_gemm1_a16w4(p.a, weights.w, weights.scale, *sorting, bias=weights.bias,
                                      activation=s.activation, **both)
    return kernel.moe_gemm2_a16w4(p.a, weights.w, weights.scale, *sorting, k_batch=cfg.k_batch, **both)


def new_out(p: Problem, device) -> torch.Tensor:
    """A zeroed output for one launch (stage 2 adds into it; stage 1 writes the routed rows)."""
    return emu.aligned(torch.zeros(*p.stage.out_shape(p.shape, p.tokens), dtype=torch.bfloat16, device=device))
