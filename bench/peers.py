"""Peers' Triton kernels (torchao's, aiter's), compiled for gfx942/gfx950 on the CPU and run under
flyquant.emu, so that they are counted exactly as our kernels are.

Triton (the `bench` extra; TRITON_VERSION checked) compiles AMD targets without a GPU: `compile_kernel`
makes a stand-in Triton driver current that only names the target (GPUTarget("hip", arch, 64))
and calls the JIT function's own `warmup`, so the argument specialization (16-divisible
integers and pointers, buffer-op pointer ranges) is Triton's, as on a GPU. `run_kernel` packs
the compiled kernel's arguments by its code object's metadata (Triton appends two scratch
pointers, passed as null: the casts use no global scratch) and runs it in the interpreter on
CPU tensors, with the dynamic LDS Triton launches with (its metadata's `shared`).

Each peer module (peers_torchao, peers_aiter) has NAME and peer_rows(kind, mode, x, arch, which);
`compare` puts a peer's rows beside one of our rows (same input) and `difference` checks a peer's
MXFP8 output byte for byte against torchao's to_mx, the numerical oracle of the quantize rows
(`byte_difference` compares any outputs with an oracle's: the MXFP4 peer's with flyquant.reference).
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

import torch

import common
import flyquant.emu as emu
from flyquant.arch import WAVE_SIZE, occupancy
from flyquant.emu import codeobject, interp, runtime
from flyquant.emu.memory import Memory

TRITON_VERSION = "3.9.0"  # the version whose AMD backend the peers were checked with (the extras allow 3.7.1-3.9.0)
TRITON_SCRATCH_POINTERS = 2  # global_scratch and profile_scratch, appended by Triton's AMD backend


def triton_missing() -> str | None:
    """Why Triton cannot compile the peers here (None: it can)."""
    try:
        import triton
        from triton.backends.compiler import GPUTarget  # noqa: F401
    except ImportError as exc:
        return (f"Triton is not installed ({exc}); pip install -e '.[bench]' installs it ({TRITON_VERSION} "
                "beside the CPU torch the README names)")
    if triton.__version__ != TRITON_VERSION:
        return f"Triton {triton.__version__} is installed; the peer rows were checked with {TRITON_VERSION}"
    return None


class _CompileOnlyDriver:
    """The part of a Triton driver that compiling (JITFunction.warmup) asks for: the target."""

    def __init__(self, arch: str):
        from triton.backends.compiler import GPUTarget

        self.arch = arch
        self.target = GPUTarget("hip", arch, WAVE_SIZE)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return self.arch  # Triton keys its per-device compile caches by this: one per arch

    def get_current_stream(self, device=None):
        return 0


@contextlib.contextmanager
def _compiling_for(arch: str):
    from triton.runtime.driver import driver

    previous = driver._active  # reset_active() would create the default driver, which needs a GPU
    driver.set_active(_CompileOnlyDriver(arch))
    try:
        yield
    finally:
        driver._active = previous


def compile_kernel(jit_fn, arch: str, args: dict, num_warps: int, num_stages: int, **options):
    """The Triton CompiledKernel of `jit_fn` for `arch`, specialized on `args` (every parameter by
    name, constexprs included) as a launch with them would be; `options`: other launch options
    (waves_per_eu, ...)."""
    with _compiling_for(arch):
        return jit_fn.warmup(grid=(1,), num_warps=num_warps, num_stages=num_stages, **options, **args)


@dataclass(frozen=True)
class PeerResources:
    """What the compiler allocated for a peer kernel (from its code object metadata)."""

    kernel: str
    vgprs: int  # architected + accumulation registers (the metadata's .vgpr_count)
    agprs: int
    lds_bytes: int  # static + the dynamic LDS Triton launches with
    spills: int  # VGPR + SGPR spill count
    scratch_bytes: int  # private segment per work-item
    waves_per_workgroup: int
    workgroups_per_cu: int


def _kernel_info(kernel):
    co = codeobject.load(kernel.asm["hsaco"])
    return co, co.kernels[kernel.metadata.name]


def resources(kernel) -> PeerResources:
    co, info = _kernel_info(kernel)
    lds = info.group_segment_fixed_size + kernel.metadata.shared
    waves = kernel.metadata.num_warps
    spills = info.vgpr_spill_count + info.sgpr_spill_count
    return PeerResources(info.name, info.vgpr_count, info.agpr_count, lds, spills, info.private_segment_fixed_size,
                         waves, occupancy(co.arch, info.vgpr_count - info.agpr_count, info.agpr_count, lds, waves))


def _arg_bytes(value, kind: str) -> bytes:
    if kind.startswith("*"):
        return value.data_ptr().to_bytes(8, "little")
    bits = {"i32": 32, "i64": 64, "u32": 32, "u64": 64}.get(kind)
    if bits is None:
        raise ValueError(f"argument type {kind} is not packed by the peer runner")
    return (int(value) & ((1 << bits) - 1)).to_bytes(bits // 8, "little")


def run_kernel(kernel, grid: tuple, args: dict):
    """Run a compiled Triton kernel under flyquant.emu on CPU tensors (`args` as given to
    `compile_kernel`); returns its LaunchStats."""
    co, info = _kernel_info(kernel)
    params = [_arg_bytes(args[name], kind) for name, kind in kernel.src.signature.items() if kind != "constexpr"]
    params += [bytes(8)] * TRITON_SCRATCH_POINTERS
    grid = tuple(grid) + (1,) * (3 - len(grid))
    block = (kernel.metadata.num_warps * WAVE_SIZE, 1, 1)
    dynamic_lds = kernel.metadata.shared
    segment = runtime.pack_kernargs(info, params, grid, block, dynamic_lds)
    buffer, address = runtime.kernarg_buffer(segment)  # noqa: F841 (buffer: keeps the segment alive)
    memory = emu.global_memory() if emu.enabled() else Memory()
    # valid for the launch (as the HIP stand-in does for FlyDSL's), also under strict_memory():
    # the kernarg segment, read-only, and the storage of every tensor argument
    keys = [memory.register(address, runtime.kernarg_readable_bytes(segment), writable=False)]
    keys += [memory.register(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
             for t in args.values() if isinstance(t, torch.Tensor)]
    try:
        return interp.execute(co, info.name, grid, block, address, dynamic_lds, memory)
    finally:
        for key in keys:
            memory.unregister(key)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def difference(kind: str, mode: str, x: torch.Tensor, data: torch.Tensor, scales: torch.Tensor) -> str | None:
    """None when (data, scales) equal torchao's to_mx byte for byte, else where they differ."""
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import to_mx

    rows_major = x if kind == "1x32" else x.t().contiguous()
    want_s, want_d = to_mx(rows_major, torch.float8_e4m3fn, 32, ScaleCalculationMode[mode.upper()])
    return byte_difference("to_mx", (("data", data, want_d), ("scales", scales, want_s)))


def byte_difference(oracle: str, outputs) -> str | None:
    """None when every (what, got, want) of `outputs` holds the same bytes (want reshaped to got's
    shape), else where they differ."""
    out = []
    for what, got, want in outputs:
        got, want = got.view(torch.uint8), want.view(torch.uint8)
        if got.numel() != want.numel():
            out.append(f"{what}: {tuple(got.shape)} vs {oracle} {tuple(want.shape)}")
            continue
        want = want.reshape(got.shape)
        bad = (got != want).nonzero()
        if len(bad):
            first = tuple(bad[0].tolist())
            out.append(f"{len(bad)} of {got.numel()} {what} bytes differ (first at {first}: "
                       f"{got[first].item():#04x} vs {oracle} {want[first].item():#04x})")
    return "; ".join(out) or None


def measured(stats, res: PeerResources, x: torch.Tensor, diff: str | None) -> dict:
    """The row fields of one peer launch on x: its counters, resources and check."""
    return dataclasses.asdict(res) | {
        "status": "ok",
        "wave_instr": stats.wave_instructions,
        "instr_per_element": stats.wave_instructions / x.numel(),
        "scratch_instr": sum(n for op, n in stats.by_opcode.items() if op.startswith("scratch_")),
        "workgroups": stats.workgroups_launched,
        "bit_exact": diff is None,
        "difference": diff,
    }


def compare(peer, case, x: torch.Tensor, arch: str, which: str, ours: dict) -> list[dict]:
    """The rows of `peer` (a module with NAME and peer_rows) for one of our modelled rows (`ours`),
    on the same input x, with the ratio of the peer's wave-instructions per element to ours."""
    head = {"case": case.name, "arch": arch, "flyquant_instr_per_element": ours.get("instr_per_element")}
    missing = triton_missing()
    if missing:
        return [head | {"peer": peer.NAME, "status": missing}]
    try:
        found = peer.peer_rows(case.kind, case.mode, x, arch, which)
    except Exception as exc:  # reported in the table's notes; our row and the other peers go on
        found = [{"peer": peer.NAME, "status": f"error: {type(exc).__name__}: {exc}"}]
    rows = []
    for r in found:
        if r.get("instr_per_element") and head["flyquant_instr_per_element"]:
            r["peer_vs_flyquant"] = r["instr_per_element"] / head["flyquant_instr_per_element"]
        rows.append(head | r)
    return rows


def annotate_best(row: dict, peer_rows: list[dict]) -> None:
    """Adds to one of our quantize rows the peer run with the fewest wave-instructions per element
    on its case and arch (`best_peer`) and ours over that peer's (`vs_best_peer`)."""
    ran = [p for p in peer_rows if p["case"] == row["case"] and p["arch"] == row["arch"] and p["status"] == "ok"]
    if ran:
        best = min(ran, key=lambda p: p["instr_per_element"])
        row["best_peer"] = f"{best['peer']} {best['config']}"
        row["vs_best_peer"] = row["instr_per_element"] / best["instr_per_element"]


PEER_COLUMNS = [
    ("case", "case"),
    ("arch", "arch"),
    ("peer", "peer"),
    ("config", "config"),
    ("tag", "which"),
    ("instr_per_element", "instr/elem"),
    ("flyquant_instr_per_element", "flyquant"),
    ("peer_vs_flyquant", "peer/flyquant"),
    ("vgprs", "VGPR"),
    ("agprs", "AGPR"),
    ("lds_bytes", "LDS B"),
    ("spills", "spill"),
    ("scratch_bytes", "scratch B"),
    ("workgroups_per_cu", "WG/CU"),
    ("bit_exact", "exact"),
]


def print_rows(rows: list[dict]) -> None:
    def tag(r):
        return " ".join(name for name in ("best", "default") if r.get(name))

    ran = [r | {"tag": tag(r)} for r in rows if r.get("status") == "ok"]
    print("\npeers under flyquant.emu (modelled, not timed; inputs identical to the flyquant rows; exact: "
          "MXFP8 outputs byte for byte vs torchao's to_mx, MXFP4 outputs vs flyquant.reference):")
    common.print_table(ran, PEER_COLUMNS)
    for r in rows:
        if r.get("status") != "ok":
            print(f"peer {r['peer']} {r.get('config', '')} on {r['case']} {r['arch']}: {r['status']}")
        elif r.get("difference"):
            print(f"peer output differs: {r['case']} {r['arch']} {r['config']}: {r['difference']}")
