"""What the two benchmarks share: how they run (hardware or modelled), GPU timing, the emulator's
counters made additive, the compiled kernels' resources, and the table / JSON / PNG outputs.

Two modes, never mixed in one output:

- ``hardware`` (a ROCm GPU is present): each kernel is timed with ``torch.cuda`` events, one
  event pair per iteration after a warm-up, and the median and minimum are reported (the GPU's
  time, with the host's Python and launch time per call beside it: time_gpu).
- ``modelled`` (no AMD GPU, e.g. here): the kernels run under ``flyquant.emu`` and the outputs
  hold only what the emulator and the compiler observe: wave-instructions executed by class,
  memory instructions and bytes, 128-byte lines touched (coalescing), workgroups, registers,
  LDS and the occupancy they allow. These are labelled "modelled, not timed": no time, TFLOPS or
  TB/s is ever derived from them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

import flyquant.emu as emu
from flyquant.emu.stats import LINE_BYTES
from flyquant import select, toolchain
from flyquant.arch import ARCHS, WAVE_SIZE, arch_info

MODELLED_LABEL = "modelled, not timed (flyquant.emu counts + compiler resources; no GPU was used)"
HARDWARE_LABEL = "timed on hardware (torch.cuda events)"
MODES = ("auto", "hardware", "modelled")


# ---- mode and command line ------------------------------------------------------------------------


def rocm_gpu() -> str | None:
    """The arch of the current ROCm GPU (e.g. "gfx950"), or None without one."""
    if not emu.rocm_device_present():
        return None
    return select._rocm_arch_of(torch.cuda.current_device())


def resolve_mode(requested: str, archs: list[str]) -> tuple[str, list[str]]:
    """(mode, archs). auto = hardware with a ROCm GPU, else modelled. Hardware mode measures the
    GPU that is there, so its arch replaces --arch; modelled mode enables the emulator (which must
    happen before FlyDSL's runtime loads, hence here, first thing)."""
    refuse_forcing_env(archs)
    gpu = rocm_gpu()
    mode = ("hardware" if gpu else "modelled") if requested == "auto" else requested
    if mode == "hardware":
        if gpu is None:
            raise SystemExit("--mode hardware needs a ROCm GPU (none found); use --mode modelled")
        if gpu not in ARCHS:
            raise SystemExit(f"the GPU is {gpu}: flyquant kernels target {sorted(ARCHS)}")
        return mode, [gpu]
    if gpu is not None:
        raise SystemExit("a ROCm GPU is present: the emulator stays off; use --mode hardware")
    emu.enable(archs[0])
    return mode, archs


def refuse_forcing_env(archs: list[str], first_principles: bool = False) -> None:
    """The selector obeys FLYQUANT_BACKEND and FLYQUANT_ARCH over the emulator's arch, so a run
    under either would measure other kernels (or none) than its rows name. FLYQUANT_CONFIG and
    FLYQUANT_TUNING are read and checked against the kernels now, so a bad one stops the run
    before it starts (it was a traceback from the first MoE plan); a script that benches
    first-principles configs only (first_principles) refuses them set."""
    from flyquant import env, select

    if first_principles:
        for name in ("FLYQUANT_CONFIG", "FLYQUANT_TUNING"):
            if env.raw(name) is not None:
                raise SystemExit(f"{name} is set, but this script measures the selector's first-principles "
                                 "configs; unset it")
    try:
        select.check_moe_overrides()
    except env.EnvError as exc:
        raise SystemExit(str(exc)) from None
    if select.forced_backend() == "reference":
        raise SystemExit("FLYQUANT_BACKEND=reference: no kernel would run; unset it to bench the kernels")
    forced = select.forced_arch()
    if forced is not None and any(a != forced for a in archs):
        raise SystemExit(f"FLYQUANT_ARCH={forced} compiles every kernel for {forced}, so rows for --arch "
                         f"{','.join(archs)} would name the wrong arch; unset it (--arch chooses the arch)")


def begin(args, title: str) -> tuple[str, list[str], str, dict[str, float]]:
    """A script's start: (mode, archs, label, kernel_sources()) for its parsed common args, the
    title and the mode's label printed."""
    mode, archs = resolve_mode(args.mode, args.arch)
    label = HARDWARE_LABEL if mode == "hardware" else MODELLED_LABEL
    print(f"{title}: {label}")
    return mode, archs, label, kernel_sources()


def csv_list(text: str, kind=str) -> list:
    """ "a,b,c" -> [kind(a), kind(b), kind(c)] (for argparse). An empty list or an item `kind` refuses
    (ValueError) is an argparse error naming the option: an empty one ran a script's whole default
    sweep or nothing, and a bad item was a traceback (or argparse's "invalid <lambda> value")."""
    try:
        items = [kind(v.strip()) for v in text.split(",") if v.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None
    if not items:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a comma-separated list")
    return items


def positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise ValueError(f"{value} is not a positive integer")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError(f"{value} is negative")
    return value


def positive_ints(text: str) -> list[int]:
    return csv_list(text, positive_int)


def _arch(name: str) -> str:
    arch_info(name)  # ValueError naming the supported ones
    return name


def arch_list(text: str) -> list[str]:
    return csv_list(text, _arch)


def add_common_args(parser) -> None:
    parser.add_argument(
        "--mode",
        choices=MODES,
        default="auto",
        help="hardware: time on the ROCm GPU; modelled: emulate (no timing); auto: hardware if a GPU is present",
    )
    parser.add_argument(
        "--arch",
        type=arch_list,
        default=["gfx950"],
        help="modelled mode: comma-separated targets (gfx950,gfx942); hardware mode uses the GPU's",
    )
    parser.add_argument("--out", type=Path, default=Path("bench-results"), help="directory for the JSON and PNG")
    parser.add_argument("--quick", action="store_true", help="a small subset (fewer sizes, fewer sampled workgroups)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup", type=non_negative_int, default=20, help="hardware mode: untimed iterations first")
    parser.add_argument("--iters", type=positive_int, default=200, help="hardware mode: timed iterations")
    parser.add_argument(
        "--no-flush",
        action="store_true",
        help="hardware mode: keep caches warm between iterations (default: flush L2/MALL)",
    )


# ---- hardware timing ----------------------------------------------------------------------------

FLUSH_BYTES = 512 << 20  # larger than MI300X/MI355X's 256 MiB Infinity Cache: every iteration starts cold


@dataclass(frozen=True)
class Timing:
    """GPU time of one call, over `iters` event-timed iterations after `warmup` untimed ones, and
    the host's time per call (Python and launch, measured in the warm-up)."""

    median_us: float
    min_us: float
    iters: int
    warmup: int
    cold_cache: bool
    host_us: float
    gpu_delay: bool  # the GPU was held while the host enqueued each call (time_gpu); False: not available
    late: int  # timed calls whose start event fired before the host had enqueued them (their delay then doubled)


HOST_MARGIN = 2.0  # the GPU delay before each timed call: this many times the host's time per call
DELAY_EXTRA_US = 20.0  # plus this
HOST_SAMPLES = 3  # warm-up calls at least, for the host's time per call (after one untimed first call)


def time_gpu(fn, *, warmup: int, iters: int, flush: bool = True, before=None) -> Timing:
    """Time `fn()` on the current stream: a start/end event pair around each call, so the median
    and the minimum are of single calls. `before()` (e.g. zeroing an accumulated output) and the
    cache flush run between the event pairs, outside the timed region.

    The pairs time the GPU's work, not the host's: our calls spend 0.15-1.5 ms in Python and
    launches (more than a small kernel's run), and a start event that fires while the host is
    still enqueueing would add that wait. So each call is preceded on the stream by a GPU-side
    delay (torch.cuda._sleep) of twice the host's time per call, the median of the warm-up calls
    (at least HOST_SAMPLES, after a first call that may compile), and the start event fires when
    it ends, with the call's launches already queued behind it. A call whose start event had
    fired before the host finished enqueueing it is counted (`late`) and the delay doubled for
    the next ones. The host's time per call is reported beside (host_us): where it exceeds the
    GPU time, a user calling from Python waits on the host, which CUDA graphs or batching hide."""
    scrub = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda") if flush else None
    if before is not None:
        before()
    fn()  # compiles and loads what it launches: not a sample of the host's time
    torch.cuda.synchronize()
    host = []
    for _ in range(max(warmup, HOST_SAMPLES)):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()  # so the next call's host time is not spent waiting on a full queue
    host_us = statistics.median(host)
    delay = _sleep_cycles(HOST_MARGIN * host_us + DELAY_EXTRA_US)
    pairs, late = [], 0
    for _ in range(iters):
        if before is not None:
            before()
        if scrub is not None:
            scrub.zero_()
        if delay:
            torch.cuda._sleep(delay)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        if delay and start.query():  # the GPU was already past the delay: it waited for the host
            late, delay = late + 1, 2 * delay
        pairs.append((start, end))
        torch.cuda.synchronize()  # the next delay then starts with the host, not behind this call
    times_us = [s.elapsed_time(e) * 1e3 for s, e in pairs]
    return Timing(statistics.median(times_us), min(times_us), iters, warmup, flush, host_us, bool(delay), late)


def _sleep_cycles(us: float) -> int:
    """torch.cuda._sleep's argument for a delay of about `us` microseconds on the current GPU (its
    unit, the GPU's clock cycles: the difference of two probe sleeps timed by events, so the
    launch and the first sleep's loading drop out), 0 where torch lacks it."""
    sleep = getattr(torch.cuda, "_sleep", None)
    if sleep is None:
        return 0
    sleep(1 << 10)  # loads the sleep kernel
    spans = []
    for probe in (1 << 20, 1 << 21):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        sleep(1 << 16)  # the GPU busy while the probe is enqueued: its launch is not timed
        start.record()
        sleep(probe)
        end.record()
        torch.cuda.synchronize()
        spans.append(start.elapsed_time(end) * 1e3)
    per_us = (1 << 20) / max(spans[1] - spans[0], 1e-3)
    return max(1, int(per_us * us))


def hbm_peak_bytes_per_s(arch: str) -> float:
    return arch_info(arch).hbm_tb_per_s * 1e12


# ---- emulator counters, additive ----------------------------------------------------------------

GLOBAL_CLASSES = ("vmem_load", "vmem_store", "vmem_atomic")


@dataclass
class MemFigures:
    """Memory traffic of one mnemonic (or one tensor's instructions): executions, lanes that moved
    data, bytes they moved, 128-byte lines touched, and stored lines covered only in part (a
    read-modify-write or masked write on a GPU)."""

    cls: str
    executed: float = 0.0
    bytes: float = 0.0
    lines: float = 0.0
    partial_store_lines: float = 0.0
    lanes: float = 0.0

    @classmethod
    def of(cls, kind: str, c) -> "MemFigures":
        """From a flyquant.emu MemCounter."""
        return cls(kind, c.executed, c.bytes, c.lines, c.partial_store_lines, c.lanes)

    @classmethod
    def total(cls, figures) -> "MemFigures":
        """The sum of several figures (a GEMM's operand tensors, say)."""
        out = cls("total")
        for f in figures:
            out.add(f)
        return out

    def add(self, other: "MemFigures", coef: float = 1.0) -> None:
        self.executed += coef * other.executed
        self.bytes += coef * other.bytes
        self.lines += coef * other.lines
        self.partial_store_lines += coef * other.partial_store_lines
        self.lanes += coef * other.lanes


@dataclass
class Counts:
    """The additive counters of one or more emulated launches (flyquant.emu LaunchStats), as floats
    so that they can be scaled and combined when a launch stands for a larger one."""

    wave_instructions: float = 0.0
    workgroups_launched: float = 0.0
    workgroups_working: float = 0.0  # workgroups that stored or atomically updated global memory
    by_class: dict[str, float] = field(default_factory=dict)
    by_opcode: dict[str, float] = field(default_factory=dict)
    memory: dict[str, MemFigures] = field(default_factory=dict)
    by_tensor: dict[str, MemFigures] = field(default_factory=dict)  # instructions that stayed inside one tensor

    @classmethod
    def of(cls, stats, tensors=None) -> "Counts":
        """`tensors`: {name: contiguous CPU tensor} whose traffic to count apart (by address range)."""
        mem = {name: MemFigures.of(stats.mem_class[name], c) for name, c in stats.memory.items()}
        by_tensor = {
            name: MemFigures.of("tensor", stats.traffic_within(t.data_ptr(), t.data_ptr() + t.nbytes))
            for name, t in (tensors or {}).items()
        }
        return cls(
            wave_instructions=stats.wave_instructions,
            workgroups_launched=stats.workgroups_launched,
            workgroups_working=stats.workgroups_with_global_store,
            by_class=dict(stats.by_class),
            by_opcode=dict(stats.by_opcode),
            memory=mem,
            by_tensor=by_tensor,
        )

    @classmethod
    def combine(cls, terms) -> "Counts":
        """sum_i coef_i * counts_i for terms [(coef, Counts), ...]."""
        out = cls()
        for coef, c in terms:
            out.wave_instructions += coef * c.wave_instructions
            out.workgroups_launched += coef * c.workgroups_launched
            out.workgroups_working += coef * c.workgroups_working
            for k, v in c.by_class.items():
                out.by_class[k] = out.by_class.get(k, 0.0) + coef * v
            for k, v in c.by_opcode.items():
                out.by_opcode[k] = out.by_opcode.get(k, 0.0) + coef * v
            for k, m in c.memory.items():
                out.memory.setdefault(k, MemFigures(m.cls)).add(m, coef)
            for k, m in c.by_tensor.items():
                out.by_tensor.setdefault(k, MemFigures(m.cls)).add(m, coef)
        return out

    def scaled(self, factor: float) -> "Counts":
        return Counts.combine([(factor, self)])

    def mem(self, classes) -> MemFigures:
        """Memory figures summed over the mnemonics of the given class(es)."""
        classes = (classes,) if isinstance(classes, str) else tuple(classes)
        total = MemFigures("+".join(classes))
        for m in self.memory.values():
            if m.cls in classes:
                total.add(m)
        return total

    def cls(self, name: str) -> float:
        return self.by_class.get(name, 0.0)

    def to_json(self) -> dict:
        return {
            "wave_instructions": self.wave_instructions,
            "workgroups_launched": self.workgroups_launched,
            "workgroups_working": self.workgroups_working,
            "by_class": {k: v for k, v in self.by_class.items() if v},
            "by_opcode": dict(sorted(((k, v) for k, v in self.by_opcode.items() if v), key=lambda kv: -kv[1])),
            "memory": {
                k: dataclasses.asdict(m) | {"coalescing": coalescing(m)} for k, m in sorted(self.memory.items())
            },
            "by_tensor": {k: dataclasses.asdict(m) | {"coalescing": coalescing(m)} for k, m in self.by_tensor.items()},
        }


def coalescing(m: MemFigures) -> float | None:
    """Useful bytes per byte of the 128-byte lines touched (1.0: every byte of every line used; above
    1 when lanes of one instruction read the same bytes, as a broadcast does)."""
    return m.bytes / (m.lines * LINE_BYTES) if m.lines else None


def emulate(fn, tensors=None):
    """Run `fn()` (which launches FlyDSL kernels on CPU tensors under flyquant.emu) and return
    (its result, the summed Counts of its launches, the LaunchRecords); `tensors` as in Counts.of."""
    with emu.record() as records:
        result = fn()
    return result, Counts.combine([(1.0, Counts.of(r.stats, tensors)) for r in records]), list(records)


# ---- compiled kernel resources ------------------------------------------------------------------

LOAD_BYTES = {
    "ubyte": 1,
    "sbyte": 1,
    "ushort": 2,
    "sshort": 2,
    "short_d16": 2,
    "short_d16_hi": 2,
    "dword": 4,
    "dwordx2": 8,
    "dwordx3": 12,
    "dwordx4": 16,
    "b32": 4,
    "b64": 8,
    "b96": 12,
    "b128": 16,
    "u8": 1,
    "i8": 1,
    "u16": 2,
    "i16": 2,
}
_VMEM = re.compile(r"^\s+(buffer|global|flat)_(load|store|atomic)(?:_lds)?_(\w+)", re.M)
_VMCNT = re.compile(r"^\s+s_waitcnt\b[^\n]*?\bvmcnt\((\d+)\)", re.M)


def bytes_in_flight_per_wave(isa: str) -> int:
    """A static estimate of the most global-load bytes one wave has outstanding: walk the ISA in
    text order, queue each vector memory instruction (loads with their bytes, stores and atomics
    with 0: on gfx9 they share the vmcnt counter), and at every ``s_waitcnt vmcnt(n)`` keep only
    the n newest. Straight-line order only: loop back-edges are not followed, so loads a
    software-pipelined loop issues for its next iteration count until the next wait in the text."""
    events = sorted(
        [(m.start(), "mem", m) for m in _VMEM.finditer(isa)] + [(m.start(), "wait", m) for m in _VMCNT.finditer(isa)],
        key=lambda e: e[0],
    )
    queue: list[int] = []
    best = 0
    for _, kind, m in events:
        if kind == "wait":
            n = int(m.group(1))
            queue = queue[len(queue) - n :] if n else []
            continue
        op, suffix = m.group(2), m.group(3)
        size = LOAD_BYTES.get(suffix, LOAD_BYTES.get(suffix.split("_")[0], 0)) if op == "load" else 0
        queue.append(size * WAVE_SIZE)
        best = max(best, sum(queue))
    return best


@dataclass(frozen=True)
class Resources:
    """What the compiler allocated for one kernel and what it allows on one CU."""

    kernel: str
    vgprs: int
    agprs: int
    sgprs: int
    lds_bytes: int
    spills: int
    waves_per_workgroup: int
    workgroups_per_cu: int
    load_bytes_in_flight_per_wave: int  # static estimate, see bytes_in_flight_per_wave

    @property
    def load_bytes_in_flight_per_cu(self) -> int:
        return self.load_bytes_in_flight_per_wave * self.waves_per_workgroup * self.workgroups_per_cu

    @classmethod
    def of(cls, report) -> "Resources":
        waves = max(1, report.max_workgroup_size // WAVE_SIZE)
        return cls(
            report.name,
            report.vgprs,
            report.agprs,
            report.sgprs,
            report.lds_bytes,
            report.spills,
            waves,
            report.workgroups_per_cu(waves),
            bytes_in_flight_per_wave(report.isa),
        )


_by_key: dict = {}
_by_kernel: dict[str, Resources] = {}


def compiled_resources(key, arch: str, launch, *args, **kwargs) -> Resources | None:
    """Resources of the (first) kernel `launch(*args, **kwargs)` compiles for `arch`, compiled without
    running (toolchain.compile_only), once per `key` (which must determine the specialization).

    FlyDSL compiles, and so dumps, a specialization once per process: when an earlier call under
    another key (or an earlier launch) already compiled it, this returns None; the resources are
    then those of that earlier compile, see `resources_of_kernel`."""
    if key not in _by_key:
        try:
            reports = toolchain.compile_only(arch, launch, *args, **kwargs)
        except toolchain.ToolchainError:
            _by_key[key] = None
            return None
        for report in reports:
            _by_kernel[report.name] = Resources.of(report)
        _by_key[key] = _by_kernel[reports[0].name]
    return _by_key[key]


RESOURCE_FIELDS = (
    "vgprs",
    "agprs",
    "sgprs",
    "lds_bytes",
    "spills",
    "waves_per_workgroup",
    "workgroups_per_cu",
    "load_bytes_in_flight_per_cu",
)


def resource_figures(res: Resources | None) -> dict:
    """The row fields of a kernel's resources (None each when they could not be read)."""
    return {k: None if res is None else getattr(res, k) for k in RESOURCE_FIELDS}


def resources_of_kernel(name: str) -> Resources | None:
    """The resources of a kernel (by its name, as a launch record gives it) compiled by
    `compiled_resources` earlier in this process, or None."""
    return _by_kernel.get(name)


# ---- outputs ------------------------------------------------------------------------------------


def fmt(value, digits: int = 3) -> str:
    """Compact table cell: '-' for None, thousands separators for large numbers."""
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer() and abs(value) >= 1000):
        return f"{int(value):,}"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:.{digits}g}"


def print_table(rows: list[dict], columns: list[tuple[str, str]], file=sys.stdout) -> None:
    """Rows of dicts as an aligned text table; columns = [(key, header), ...]."""
    cells = [[h for _, h in columns]] + [[fmt(r.get(k)) for k, _ in columns] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    for n, row in enumerate(cells):
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)), file=file)
        if n == 0:
            print("  ".join("-" * w for w in widths), file=file)


def _json_default(obj):
    if dataclasses.is_dataclass(obj):
        return dataclasses.asdict(obj)
    if isinstance(obj, (torch.dtype, Path)):
        return str(obj)
    raise TypeError(f"cannot write {type(obj).__name__} to JSON")


def write_json(path: Path, payload: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1, default=_json_default, allow_nan=False) + "\n")
    return path


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def kernel_sources() -> dict[str, float]:
    """Modification times of the kernel sources (flyquant.kernels). FlyDSL reads a kernel's source
    again when it compiles a new specialization, so an edit during a run can break the configs
    compiled after it: compare at the end with `changed_kernel_sources`."""
    import flyquant.kernels

    return {p.name: p.stat().st_mtime for p in Path(flyquant.kernels.__file__).parent.glob("*.py")}


def changed_kernel_sources(before: dict[str, float]) -> list[str]:
    after = kernel_sources()
    return sorted(name for name in before.keys() | after.keys() if before.get(name) != after.get(name))


def warn_if_sources_changed(before: dict[str, float], file=sys.stdout) -> list[str]:
    changed = changed_kernel_sources(before)
    if changed:
        print(
            f"WARNING: kernel sources changed during this run ({', '.join(changed)}): configs compiled after the "
            "change may not match the loaded module (FlyDSL compiles from the file); rerun for consistent figures",
            file=file,
        )
    return changed


def environment() -> dict:
    """Versions and settings that a reader of the JSON needs to reproduce it. FLYQUANT_CONFIG and
    the FLYQUANT_TUNING table are read as flyquant reads them (an EnvError names a bad one), so
    the JSON never records a setting the run could not have used."""
    import flydsl

    from flyquant import env, tuning

    tuning.config_overrides()
    tuning.tuning_table()
    return {
        "torch": torch.__version__,
        "flydsl": getattr(flydsl, "__version__", "?"),
        "hip": torch.version.hip,
        "FLYQUANT_BACKEND": env.raw("FLYQUANT_BACKEND"),
        "FLYQUANT_ARCH": env.raw("FLYQUANT_ARCH"),
        "FLYQUANT_CONFIG": env.raw("FLYQUANT_CONFIG"),
        "FLYQUANT_TUNING": env.raw("FLYQUANT_TUNING"),
    }
