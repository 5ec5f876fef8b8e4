"""What bench/moe_tile_n.py reports: the issue targets each row is checked against (issues 5 and
15), upstream FlyDSL's quoted figures, the table columns and the plot."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import common

# ---- figures of other kernels, from issue 5 (not measured by this script) ---------------------------
UPSTREAM_SOURCE = (
    "upstream FlyDSL A16W4 stage 2 (kernels/moe/moe_2stage_a16wmix/gemm2.py), gfx950, "
    "executed on a CPU emulator, one count per instruction a wave executes (issue 5)"
)
# (shape, tokens, tile_m, tile_n) -> wave-instructions per MFMA
UPSTREAM_PER_MFMA = {
    ("gptoss-3072", 1, 16, 128): 10.24,
    ("gptoss-3072", 1, 16, 256): 8.95,
    ("gptoss-3072", 1, 32, 256): 5.33,
    ("upstream-small", 5, 16, 128): 14.96,
    ("upstream-small", 5, 16, 256): 10.57,
    ("upstream-small", 5, 32, 256): 6.47,
}
UPSTREAM_NOTES = (
    "gfx950 static, 3072x3072 tile 16x128: 106 VGPR, 16 KiB LDS, 192 MFMA, 1,855 instructions per wave",
    "at 1 token (GPT-OSS-like, E=128, topk 4, tile_m 16) only 48 of its workgroups stream weights; "
    "idle ones exit after 80 wave-instructions",
    "does not assemble for gfx942 (v_cvt_scalef32_pk_bf16_fp4)",
    "aiter CK-Tile in GPT-OSS production on MI355X: 39 / 49 / 64 us for the whole MoE (both stages) "
    "at 1 / 2 / 4 tokens",
)
TARGETS = (
    "GPT-OSS-like at 1 token: >= 256 workgroups stream weights",
    "idle workgroups exit within ~100 wave-instructions (upstream: 80)",
    "16-byte weight loads with coalescing >= 0.95",
    "no spills, >= 2 workgroups per CU",
    "wave-instructions per MFMA <= 0.7x upstream's on the same shape and tile",
)
PER_MFMA_TARGET = 0.7
MIN_WORKING_AT_ONE_TOKEN = 256
MIN_W_COALESCING = 0.95
W_BYTES_PER_LANE = 16
MIN_WORKGROUPS_PER_CU = 2


def target_misses(row: dict) -> list[str]:
    """The targets (issues 5 and 15) this row can be checked against and misses."""
    misses = []
    if row["coalescing_w_loads"] is None or row["coalescing_w_loads"] < MIN_W_COALESCING:
        misses.append(f"weight loads coalescing {row['coalescing_w_loads']} (target >= {MIN_W_COALESCING})")
    if row["w_bytes_per_lane"] != W_BYTES_PER_LANE:
        misses.append(f"weight loads {row['w_bytes_per_lane']} bytes per lane (target {W_BYTES_PER_LANE})")
    if row["spills"]:
        misses.append(f"{row['spills']} spills")
    if row["workgroups_per_cu"] is not None and row["workgroups_per_cu"] < MIN_WORKGROUPS_PER_CU:
        misses.append(f"{row['workgroups_per_cu']} workgroup(s) per CU")
    if row["vs_upstream"] is not None and row["vs_upstream"] > PER_MFMA_TARGET:
        misses.append(f"wave-instructions per MFMA {row['vs_upstream']:.2f}x upstream's (target <= {PER_MFMA_TARGET}x)")
    # what the selector runs at 1 token must keep the GPU streaming (other configs of the sweep need not)
    one_token = row["shape"].startswith("gptoss") and row["tokens"] == 1 and row.get("selected")
    if one_token and row["wg_working"] < MIN_WORKING_AT_ONE_TOKEN:
        misses.append(
            f"{row['wg_working']} workgroups stream weights at 1 token (target >= {MIN_WORKING_AT_ONE_TOKEN})"
        )
    return misses


# ---- outputs ------------------------------------------------------------------------------------

MODELLED_COLUMNS = [
    ("stage", "stage"),
    ("shape", "shape"),
    ("tokens", "T"),
    ("arch", "arch"),
    ("tile", "tile"),
    ("k_batch", "kb"),
    ("waves", "waves"),
    ("sel", "sel"),
    ("wg_launched", "WG"),
    ("wg_working", "working"),
    ("idle_wave_instr", "idle/wave"),
    ("vgprs", "VGPR"),
    ("agprs", "AGPR"),
    ("lds_kib", "LDS KiB"),
    ("spills", "spill"),
    ("workgroups_per_cu", "WG/CU"),
    ("inflight_kib", "ld KiB/CU"),
    ("wave_instr", "wave-instr"),
    ("instr_per_mfma", "/MFMA"),
    ("instr_per_useful_mfma", "/useful"),
    ("upstream_instr_per_mfma", "upstream/MFMA"),
    ("vs_upstream", "ratio"),
    ("coalescing_w_loads", "coal w ld"),
    ("w_bytes_per_lane", "w B/lane"),
    ("coalescing_loads", "coal ld"),
    ("coalescing_stores", "coal st"),
    ("coalescing_atomics", "coal atom"),
    ("traffic_vs_compulsory", "traffic/min"),
    ("reduction", "reduction"),
]
HARDWARE_COLUMNS = [
    ("stage", "stage"),
    ("shape", "shape"),
    ("tokens", "T"),
    ("impl", "impl"),
    ("tile", "tile"),
    ("k_batch", "kb"),
    ("waves", "waves"),
    ("sel", "sel"),
    ("median_us", "median us"),
    ("min_us", "min us"),
    ("host_us", "host us"),
    ("tflops", "TFLOPS"),
    ("compulsory_tb_per_s", "TB/s"),
    ("hbm_peak_fraction", "of HBM"),
    ("vs_streaming_bound", "x bound"),
    ("error", "error"),
]


def _display(rows):
    for r in rows:
        r = dict(r)
        if "tile_m" in r:
            r["tile"] = f"{r['tile_m']}x{r['tile_n']}"
        r["sel"] = "*" if r.get("selected") else ""
        if r.get("lds_bytes") is not None:
            r["lds_kib"] = r["lds_bytes"] / 1024
        if r.get("load_bytes_in_flight_per_cu") is not None:
            r["inflight_kib"] = r["load_bytes_in_flight_per_cu"] / 1024
        yield r


PEER_COLOUR = "crimson"  # peers' series (--vs), apart from the matplotlib cycle our configs use


def plot(rows: list[dict], mode: str, path: Path, peer_rows=()) -> Path:
    """One column per shape, x = tokens: modelled, wave-instructions per MFMA (with upstream FlyDSL's
    figures from issue 5 as black crosses) and per useful MFMA (with the --vs peers' in PEER_COLOUR,
    one marker per arch), and the working workgroups;
    hardware, TFLOPS and the time over the weight-streaming bound (baselines dashed)."""
    plt = common.pyplot()
    shapes = list(dict.fromkeys(r["shape"] for r in rows if "error" not in r))
    panels = (
        (
            ("instr_per_mfma", "wave-instructions / MFMA"),
            ("instr_per_useful_mfma", "wave-instructions / useful MFMA"),
            ("wg_working", "workgroups working"),
        )
        if mode == "modelled"
        else (("tflops", "TFLOPS"), ("vs_streaming_bound", "time / weight-streaming bound"))
    )
    cols = max(1, len(shapes))
    fig, axes = plt.subplots(len(panels), cols, figsize=(4.8 * cols, 3.2 * len(panels)), squeeze=False)
    for col, name in enumerate(shapes):
        mine = [r for r in rows if r["shape"] == name and "error" not in r]
        series = {}
        for r in mine:
            series.setdefault(_series_name(r), []).append(r)
        for row_i, (key, label) in enumerate(panels):
            ax = axes[row_i][col]
            for sname, pts in sorted(series.items()):
                pts = sorted(pts, key=lambda r: r["tokens"])
                dashed = pts[0].get("impl", "flyquant") != "flyquant"
                ax.plot(
                    [r["tokens"] for r in pts],
                    [r.get(key) for r in pts],
                    marker="o",
                    ms=3,
                    label=sname,
                    ls="--" if dashed else "-",
                )
                chosen = [r for r in pts if r.get("selected")]
                ax.scatter(
                    [r["tokens"] for r in chosen], [r.get(key) for r in chosen], marker="*", s=90, c="k", zorder=3
                )
            if key == "instr_per_useful_mfma":
                _plot_peers(ax, [r for r in peer_rows if r["shape"] == name])
            if key == "instr_per_mfma":
                theirs = [(t, v, f"{tm}x{tn}") for (sh, t, tm, tn), v in UPSTREAM_PER_MFMA.items() if sh == name]
                ax.scatter(
                    [t for t, _, _ in theirs],
                    [v for _, v, _ in theirs],
                    marker="x",
                    c="k",
                    zorder=3,
                    label="upstream FlyDSL (issue 5)" if theirs else None,
                )
                for t, v, tile in theirs:
                    ax.annotate(tile, (t, v), fontsize=6, xytext=(3, 2), textcoords="offset points")
            ax.set_xscale("log", base=2)
            if key == "wg_working":
                ax.set_yscale("log", base=2)
            ax.set_title(f"{name}: {label}", fontsize=9)
            ax.set_xlabel("tokens")
            ax.grid(alpha=0.3)
        axes[0][col].legend(fontsize=6)
    label = common.MODELLED_LABEL if mode == "modelled" else common.HARDWARE_LABEL
    stages = "/".join(sorted({str(r["stage"]) for r in rows if "stage" in r})) or "?"
    label = textwrap.fill(label, width=int(4.8 * cols * 14))  # a one-shape figure is too narrow for the label's line
    fig.suptitle(f"A16W4 MoE stage {stages}, tile_n sweep (* = the selector's choice)\n{label}", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_peers(ax, peer_rows: list[dict]) -> None:
    """The peers' series, with a legend of their own (our configs' is in the first panel)."""
    handles = []
    for (peer, arch), pts in sorted(_group(peer_rows, ("peer", "arch")).items()):
        pts = sorted(pts, key=lambda r: r["tokens"])
        handles += ax.plot([r["tokens"] for r in pts], [r["instr_per_useful_mfma"] for r in pts], color=PEER_COLOUR,
                           ls=":", marker="s" if arch == "gfx950" else "^", ms=4, label=f"{peer} {arch}")
    if handles:
        ax.legend(handles=handles, fontsize=6)


def _group(rows: list[dict], keys: tuple) -> dict:
    out = {}
    for r in rows:
        out.setdefault(tuple(r[k] for k in keys), []).append(r)
    return out


def config_label(r: dict) -> str:
    """A config (a row, or vars(Config)) as the outputs name it: tile, split-K, waves."""
    return f"{r['tile_m']}x{r['tile_n']} kb{r['k_batch']} {r['waves']}w"


def _series_name(r: dict) -> str:
    if r.get("impl", "flyquant") != "flyquant":
        return r["impl"]
    return f"{r['arch']} {config_label(r)}"


def print_upstream(file=sys.stdout) -> None:
    print(f"\nupstream, for comparison ({UPSTREAM_SOURCE}):", file=file)
    for (shape, tokens, tm, tn), v in UPSTREAM_PER_MFMA.items():
        print(f"  {shape} T={tokens} tile {tm}x{tn}: {v} wave-instructions per MFMA", file=file)
    for note in UPSTREAM_NOTES:
        print(f"  {note}", file=file)
    print("targets (issue 5): " + "; ".join(TARGETS), file=file)
