"""The quantize bench's table columns and plot (bench/quantize.py), apart from its cases and driver."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import common

# ---- torchao 0.18's FlyDSL kernels, from issue 4 (not measured by these scripts) --------------------
TORCHAO_SOURCE = (
    "torchao 0.18 FlyDSL kernels (flydsl <= 0.2.4), gfx950, bf16, inputs randn*30, executed on a CPU "
    "emulator, one count per instruction a wave executes (issue 4)"
)
TORCHAO_WAVE_INSTR = {  # (kind, shape, mode) -> executed wave-instructions
    ("1x32", (128, 4096), "rceil"): 32_128,
    ("1x32", (128, 4096), "floor"): 51_200,
    ("32x1", (128, 5120), "rceil"): 47_200,
    ("32x1", (128, 5120), "floor"): 71_760,
    ("3d", (4, 64, 1024), "rceil"): 18_528,
    ("3d", (4, 64, 1024), "floor"): 28_352,
}
TORCHAO_NOTES = (
    "on gfx942 their rceil does not assemble and floor writes FNUZ bytes (every data byte wrong)",
    "a NaN inside a block is ignored by their max reduction (to_mx gives the block a NaN scale)",
    "torchao PR 4357 measured +43% write traffic for a 32x1 kernel at 16384^2 on MI355X (read-modify-write) "
    "before fixing it",
)


def print_torchao(target_lines: list[str], file=sys.stdout) -> None:
    """torchao's figures and notes, then the targets they are measured against."""
    print(f"\ntorchao, for comparison ({TORCHAO_SOURCE}):", file=file)
    for (kind, shape, mode), v in TORCHAO_WAVE_INSTR.items():
        n = math.prod(shape)
        print(
            f"  {kind} {'x'.join(map(str, shape))} {mode}: {v:,} wave-instructions ({v / n:.4f} per element)", file=file
        )
    for note in TORCHAO_NOTES:
        print(f"  {note}", file=file)
    for line in target_lines:
        print(line, file=file)


def torchao_json(targets) -> dict:
    return {"source": TORCHAO_SOURCE, "notes": TORCHAO_NOTES, "targets": targets,
            "wave_instructions": [{"kind": k, "shape": list(s), "mode": m, "value": v}
                                  for (k, s, m), v in TORCHAO_WAVE_INSTR.items()]}


MODELLED_COLUMNS = [
    ("case", "case"),
    ("arch", "arch"),
    ("emulated_workgroups", "WG emulated"),
    ("vgprs", "VGPR"),
    ("lds_bytes", "LDS B"),
    ("spills", "spill"),
    ("workgroups_per_cu", "WG/CU"),
    ("inflight_kib", "ld KiB/CU"),
    ("instr_per_element", "instr/elem"),
    ("torchao_instr_per_element", "torchao"),
    ("vs_torchao", "ratio"),
    ("vs_fp8_1x32", "vs fp8 1x32"),
    ("vs_fp8_same", "vs fp8 same"),
    ("coalescing_loads", "coal ld"),
    ("store_coal", "coal st (per mnemonic)"),
    ("partial_store_fraction", "partial st"),
    ("traffic_vs_compulsory", "traffic/min"),
    ("bit_exact", "exact"),
    ("outputs_off_line", "out off-line"),
    ("reduction", "reduction"),
]
HARDWARE_COLUMNS = [
    ("case", "case"),
    ("impl", "impl"),
    ("median_us", "median us"),
    ("min_us", "min us"),
    ("host_us", "host us"),
    ("tb_per_s", "TB/s"),
    ("hbm_peak_fraction", "of HBM"),
    ("bit_exact", "exact"),
    ("error", "error"),
]


def display(rows):
    for r in rows:
        r = dict(r)
        if r.get("load_bytes_in_flight_per_cu") is not None:
            r["inflight_kib"] = r["load_bytes_in_flight_per_cu"] / 1024
        if "store_coalescing_by_mnemonic" in r:
            r["store_coal"] = " ".join(
                f"{k.split('_', 2)[-1]}:{common.fmt(v)}" for k, v in r["store_coalescing_by_mnemonic"].items()
            )
        yield r


def plot(rows: list[dict], mode: str, path: Path, peers: list[dict] = ()) -> Path:
    """`peers`: the --vs rows; each peer gets its own bar (its best config run) in the
    wave-instructions panel."""
    plt = common.pyplot()
    ok = [r for r in rows if r.get("status", "ok") == "ok" and "error" not in r]
    peer_best: dict[str, dict[str, float]] = {}  # peer -> {case label: fewest instructions per element}
    for p in peers:
        if p.get("status") == "ok":
            best = peer_best.setdefault(p["peer"], {})
            label = f"{p['case']} {p['arch']}"
            best[label] = min(best.get(label, p["instr_per_element"]), p["instr_per_element"])
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    if mode == "modelled":
        panels = (("instr_per_element", "wave-instructions per element"), ("coalescing_loads", "coalescing"))
        series = {"flyquant": ok}
    else:
        panels = (("tb_per_s", "TB/s (compulsory bytes / median time)"), ("hbm_peak_fraction", "fraction of HBM peak"))
        series = {}
        for r in ok:
            series.setdefault(r["impl"], []).append(r)
    labels = list(dict.fromkeys(f"{r['case']} {r['arch']}" for r in ok))
    bars = max(1, len(series) + (mode == "modelled") + len(peer_best))
    width = 0.8 / bars
    for ax, (key, title) in zip(axes, panels):
        for i, (name, pts) in enumerate(series.items()):
            pos = {f"{r['case']} {r['arch']}": r.get(key) for r in pts}
            ax.bar(
                [j + i * width for j in range(len(labels))],
                [pos.get(lab) or 0 for lab in labels],
                width,
                label=name if mode == "hardware" or key == "instr_per_element" else "loads",
            )
        if mode == "modelled":  # a second bar per case: torchao's figure (issue 4), our data stores
            other, other_label = (
                ("torchao_instr_per_element", "torchao 0.18 FlyDSL (issue 4)")
                if key == "instr_per_element"
                else ("coalescing_data_stores", "data stores")
            )
            ax.bar(
                [j + width for j in range(len(labels))],
                [next((r.get(other) or 0 for r in ok if f"{r['case']} {r['arch']}" == lab), 0) for lab in labels],
                width,
                label=other_label,
            )
        if key == "instr_per_element":
            for k, (name, best) in enumerate(peer_best.items()):
                ax.bar([j + (2 + k) * width for j in range(len(labels))], [best.get(lab, 0) for lab in labels],
                       width, label=f"{name} (best config run)")
        ax.set_xticks(
            [j + width * (bars - 1) / 2 for j in range(len(labels))], labels, rotation=70, ha="right", fontsize=6
        )
        ax.set_title(title, fontsize=9)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(
        f"MXFP8/MXFP4 quantize - {common.MODELLED_LABEL if mode == 'modelled' else common.HARDWARE_LABEL}", fontsize=9
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
