"""torchao's Triton MXFP8 casts beside our quantize rows (`bench/quantize.py --vs torchao`).

torchao 0.18 defines `to_mxfp8_dim0_kernel` (1x32: along the last dim) and `to_mxfp8_dim1_kernel`
(32x1: along dim 0, data written column-major) in torchao/prototype/mx_formats/kernels.py, inside
`if _triton_kernels_available:` (a CUDA sm100 or MI350 device), so on a CPU they are never
defined. We take them from the installed file as they are: the kernels, their JIT helpers and
torchao's autotune configs are cut out of the source (by name, with `ast`) into a module in
flyquant's cache with `IS_ROCM = True` (the ROCm branch: no PTX), and compiled by Triton for the
chosen arch (bench/peers.py). Nothing of torchao's is copied into this repository.

Per case and config the peer runs under flyquant.emu on the very input of our row (the same
shape, the same seeded values) and its output is compared byte for byte with torchao's own
`to_mx` (data and E8M0 scales); a difference is reported with its count and first position.
torchao has no Triton kernel for the dual cast or the 3D (per-expert) cast: those rows say so.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import textwrap
import torch

import peers
from flyquant import toolchain

KERNELS = {"1x32": "to_mxfp8_dim0_kernel", "32x1": "to_mxfp8_dim1_kernel"}
# the kernels and the @triton.jit helpers they call, and the autotune config list they are decorated with
_NAMES = ("_get_mxfp8_quant_autotune_configs", "_calculate_reciprocal_scale", "_triton_calculate_scale_rceil",
          "_triton_calculate_scale_floor", *KERNELS.values())
NO_KERNEL = {
    "dual": "torchao has no Triton kernel for both orientations at once (two casts: the 1x32 and 32x1 rows)",
    "3d": "torchao has no Triton 3D (per-expert) cast",
}
NO_MXFP4 = ("torchao 0.18 has no Triton MXFP4 quantize (its mx_formats Triton kernels are MXFP8; its FP4 casts "
            "are torch code)")
NAME = "torchao triton"
DEFAULT_CONFIG = 0  # torchao's first autotune config (ROW_TILE 128, COL_TILE 128, 4 warps, 2 stages)
_module = None


def _source() -> str:
    """The module text: torchao's definitions of _NAMES (first definition of each, decorators
    included), after the imports they need and IS_ROCM = True."""
    from torchao.prototype.mx_formats import kernels

    with open(kernels.__file__) as f:
        text = f.read()
    lines = text.splitlines()
    found: dict[str, str] = {}
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.FunctionDef) and node.name in _NAMES and node.name not in found:
            first = min([d.lineno for d in node.decorator_list] + [node.lineno])
            found[node.name] = textwrap.dedent("\n".join(lines[first - 1 : node.end_lineno]))
    missing = [n for n in _NAMES if n not in found]
    if missing:
        raise RuntimeError(f"{kernels.__file__} no longer defines {', '.join(missing)}")
    header = f"# Cut from {kernels.__file__} by flyquant's bench/peers_torchao.py\n"
    header += "import triton\nimport triton.language as tl\n\nIS_ROCM = tl.constexpr(True)\n\n\n"
    return header + "\n\n\n".join(found[n] for n in _NAMES) + "\n"


def load():
    """The module holding torchao's Triton MXFP8 casts (written to flyquant's cache once per source)."""
    global _module
    if _module is None:
        text = _source()
        digest = hashlib.sha256(text.encode()).hexdigest()[:16]
        path = toolchain.private_dir(toolchain.cache_dir(), "peers") / f"torchao_mxfp8_triton_{digest}.py"
        if not path.exists():
            path.write_text(text)
        spec = importlib.util.spec_from_file_location(f"torchao_mxfp8_triton_{digest}", path)
        _module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(_module)
    return _module


def configs(kind: str) -> list:
    """torchao's autotune configs of the kind's kernel (triton.Config)."""
    return list(getattr(load(), KERNELS[kind]).configs)


def config_name(cfg) -> str:
    kw = cfg.kwargs
    return f"{kw['ROW_TILE_SIZE']}x{kw['COL_TILE_SIZE']} w{cfg.num_warps} s{cfg.num_stages}"


def not_applicable(kind: str, cfg, shape) -> str | None:
    """Why a config cannot run on this shape, or None. torchao's dim1 kernel stores its scales
    unmasked, at offsets that assume n_rows is a multiple of ROW_TILE_SIZE (a larger tile writes
    past the scale tensor), and its wrapper asserts rows and columns are multiples of 128."""
    rows, cols = shape
    if kind == "32x1":
        if rows % 128 or cols % 128:
            return "torchao's dim1 cast needs rows and columns divisible by 128"
        if rows % cfg.kwargs["ROW_TILE_SIZE"]:
            return f"ROW_TILE_SIZE {cfg.kwargs['ROW_TILE_SIZE']} does not divide {rows} rows (unmasked scale store)"
    return None


def _launch(kind: str, cfg, mode: str, x: torch.Tensor, arch: str):
    """Compile and run one config on x; returns (data, scales, LaunchStats, PeerResources)."""
    rows, cols = x.shape
    jit = getattr(load(), KERNELS[kind]).fn
    if kind == "1x32":
        data = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
        scales = torch.empty(rows, cols // 32, dtype=torch.uint8)
        constexprs = {"SCALE_BLOCK_SIZE": 32}
    else:
        data = torch.empty(cols, rows, dtype=torch.float8_e4m3fn)  # the transpose, row-major
        scales = torch.empty(cols, rows // 32, dtype=torch.uint8)
        constexprs = {"INNER_BLOCK_SIZE": 32}
    args = dict(zip(jit.arg_names, (x, data, scales, rows, cols))) | constexprs | cfg.kwargs | {"SCALING_MODE": mode}
    kernel = peers.compile_kernel(jit, arch, args, cfg.num_warps, cfg.num_stages)
    grid = (peers.ceil_div(rows, cfg.kwargs["ROW_TILE_SIZE"]), peers.ceil_div(cols, cfg.kwargs["COL_TILE_SIZE"]))
    stats = peers.run_kernel(kernel, grid, args)
    return data, scales, stats, peers.resources(kernel)


def peer_rows(kind: str, mode: str, x: torch.Tensor, arch: str, which: str) -> list[dict]:
    """One row per config run (`which`: "default" = torchao's first config, "all" = every one;
    the row of the config with the fewest wave-instructions is marked best)."""
    if kind.startswith("fp4_"):
        return [{"peer": NAME, "status": NO_MXFP4}]
    if kind in NO_KERNEL:
        return [{"peer": NAME, "status": NO_KERNEL[kind]}]
    candidates = configs(kind)
    chosen = [candidates[DEFAULT_CONFIG]] if which == "default" else candidates
    rows = []
    for cfg in chosen:
        row = {"peer": NAME, "config": config_name(cfg), "default": cfg is candidates[DEFAULT_CONFIG]}
        why = not_applicable(kind, cfg, tuple(x.shape))
        if why:
            rows.append(row | {"status": f"not run: {why}"})
            continue
        try:
            data, scales, stats, res = _launch(kind, cfg, mode, x, arch)
        except Exception as exc:  # a config that fails to compile or to run is reported, the others go on
            rows.append(row | {"status": f"error: {type(exc).__name__}: {exc}"})
            continue
        rows.append(row | peers.measured(stats, res, x, peers.difference(kind, mode, x, data, scales)))
    ran = [r for r in rows if r["status"] == "ok"]
    if ran and which == "all":
        min(ran, key=lambda r: r["wave_instr"])["best"] = True
    return rows

