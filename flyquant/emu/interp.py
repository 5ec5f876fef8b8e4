"""Wave64 interpreter for gfx942 (CDNA3) / gfx950 (CDNA4) code objects.

`execute(co, kernel, grid, block, kernarg_addr, dynamic_lds, memory)` runs one kernel launch:
for every workgroup (x fastest, then y, then z), its waves run round-robin, each until it reaches
s_barrier or s_endpgm; when every wave that has not ended waits at the barrier, all are released.
That order hides LDS races between waves and store races between workgroups, which lds_races
and (in strict memory mode) store_races therefore check for.

Before the first instruction each wave holds what the HSA dispatch sets up from the kernel
descriptor: the user SGPRs (FlyDSL kernels use only the kernarg segment pointer, plus
gfx940+ kernarg preloading; Triton's kernels with kernarg preloading also enable the dispatch
pointer, queue pointer and dispatch id before it, see `DispatchPacket`), then the enabled
workgroup ids; v0 = workitem id x, or on gfx90a+
x | y << 10 | z << 20 when y/z are enabled; EXEC has the lanes of the workgroup's threads;
MODE holds the descriptor's float modes. A kernel with a private segment gets zeroed private
memory per lane (`isa_scratch`); its private-segment wave-offset SGPR stays 0 (every wave's
private memory starts at offset 0). A workgroup's LDS starts filled with LDS_FILL, not zeros:
its contents are undefined on hardware, so a kernel that reads LDS it did not write (a histogram
it forgot to clear) gets visibly wrong bytes here.

The program is decoded once per (code object, kernel), following branches from the entry, and
turned into a list of closures (`Program`), one per instruction. An instruction the interpreter
does not know, or one of the other arch, is only an error when a wave executes it: an `EmuError`
naming the instruction, its offset from the kernel entry and the kernel.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections import OrderedDict

import numpy as np

from .. import env
from . import decode as D
from . import (isa_cvt, isa_hwreg, isa_lane, isa_lds, isa_mem, isa_mfma, isa_salu, isa_scratch,  # noqa: F401
               isa_valu, isa_vdiv, isa_vopc, isa_vpacked)  # (imported for their registrations into `table`)
from . import table
from .errors import EmuError
from .isa_base import END, F32, LANES, Ctx, Wave, initial_mode, sext
from .lds_races import LdsRaceCheck
from .memory import Memory
from .store_races import StoreRaceCheck
from .stats import CLASSES, LaunchStats, MemCounter, MemRecorder, classify

__all__ = ["EmuError", "execute", "program", "snippet", "run_wave", "Program", "Wave", "MAX_WAVE_INSTRUCTIONS"]

DEFAULT_MAX_WAVE_INSTRUCTIONS = 5_000_000


def max_wave_instructions() -> int:
    """FLYQUANT_EMU_MAX_WAVE_INSTRUCTIONS (a positive integer), or the default; an EnvError
    naming the variable and its value otherwise."""
    return env.positive_int("FLYQUANT_EMU_MAX_WAVE_INSTRUCTIONS", DEFAULT_MAX_WAVE_INSTRUCTIONS)


# A wave that executes more instructions than this is taken to never end: read once, when the
# interpreter is imported (flyquant.emu.enable imports it, so a bad value fails there, not in
# the first launch); execute(max_wave_instructions=...) overrides it per launch.
MAX_WAVE_INSTRUCTIONS = max_wave_instructions()
LDS_BYTES = {"gfx942": 64 * 1024, "gfx950": 160 * 1024}
LDS_FILL = 0xA5  # a workgroup's LDS bytes before its first write (module docstring)
MAX_WORKGROUP_THREADS = 1024
WORKITEM_ID_BITS = 10  # gfx90a+: v0 = x | y << 10 | z << 20
_PROGRAM_CACHE: OrderedDict = OrderedDict()
_PROGRAM_CACHE_SIZE = 64

_TERMINATORS = {"s_endpgm", "s_branch", "s_setpc_b64", "s_endpgm_saved", "s_endpgm_ordered_ps_done"}


class Program:
    """Decoded instructions of one kernel and their closures, indexed in address order."""

    def __init__(self, arch: str, kernel: str, entry: int, insts: list, ops: list, classes: list[str]):
        self.arch, self.kernel, self.entry = arch, kernel, entry
        self.insts, self.ops, self.classes = insts, ops, classes

    def listing(self) -> str:
        return "\n".join(f"{i.addr - self.entry:#06x}  {i.text}" for i in self.insts if i is not None)


def _raiser(exc: EmuError):
    def run(w):
        raise exc
    return run


def _decode_reachable(read, entry: int):
    """Decode every instruction reachable from `entry`; returns (insts by address, decode errors)."""
    insts: dict[int, D.Inst] = {}
    errors: dict[int, str] = {}
    work = [entry]
    while work:
        addr = work.pop()
        while addr not in insts and addr not in errors:
            try:
                inst = D.decode(read, addr)
            except Exception as e:  # unknown encoding/opcode: an error only if it executes
                errors[addr] = str(e)
                break
            insts[addr] = inst
            if inst.enc == "SOPP" and inst.name.startswith(("s_branch", "s_cbranch_")):
                work.append(addr + 4 + 4 * sext(inst.f["simm16"], 16))
            if inst.name in _TERMINATORS:
                break
            addr += inst.size
    return insts, errors


def _build_op(inst: D.Inst, ctx: Ctx):
    only = D.arch_of_instruction(inst.name)
    if only is not None and only != ctx.arch:
        return _raiser(ctx.error(inst, f"{inst.name} is a {only}-only instruction"))
    builder = table.builder(inst)
    try:
        op = builder(inst, ctx) if builder is not None else None
    except EmuError as e:
        return _raiser(e)
    if op is None:
        return _raiser(ctx.error(inst, "instruction not supported by the emulator"))
    return op


def _compile(read, entry: int, arch: str, kernel: str, kd) -> Program:
    """Decode from `entry` (bytes via `read(addr, n)`) and build the closures."""
    insts_by_addr, errors = _decode_reachable(read, entry)
    addrs = sorted(set(insts_by_addr) | set(errors))
    index = {a: i for i, a in enumerate(addrs)}

    def index_of(addr: int) -> int:
        if addr not in index:
            raise EmuError(f"branch target {addr - entry:#x} is not an instruction in kernel {kernel}")
        return index[addr]

    ctx = Ctx(arch, kernel, kd, index_of, entry)
    insts, ops, classes = [], [], []
    for i, a in enumerate(addrs):
        ctx.index = i
        inst = insts_by_addr.get(a)
        insts.append(inst)
        if inst is None:
            ops.append(_raiser(EmuError(f"cannot decode the instruction at offset {a - entry:#x} in kernel "
                                        f"{kernel} ({arch}): {errors[a]}")))
            classes.append("other")
            continue
        ops.append(_build_op(inst, ctx))
        classes.append(classify(inst.name, inst.enc))
    end_addr = addrs[-1] if addrs else entry
    ops.append(_raiser(EmuError(f"execution ran past the last decoded instruction (offset "
                                f"{end_addr - entry:#x}) of kernel {kernel} ({arch})")))
    insts.append(None)
    classes.append("other")
    return Program(arch, kernel, entry, insts, ops, classes)


def program(co, kernel: str) -> Program:
    """The decoded, closure-compiled program of `kernel` (cached per code object image)."""
    key = (hashlib.sha1(co.image).digest(), kernel)
    prog = _PROGRAM_CACHE.get(key)
    if prog is not None:
        _PROGRAM_CACHE.move_to_end(key)
        return prog
    info = co.kernels[kernel]
    prog = _compile(co.read, info.entry, co.arch, kernel, info.kd)
    _PROGRAM_CACHE[key] = prog
    if len(_PROGRAM_CACHE) > _PROGRAM_CACHE_SIZE:
        _PROGRAM_CACHE.popitem(last=False)
    return prog


def snippet(code: bytes, arch: str, kd=None, name: str = "snippet") -> Program:
    """A program of raw instruction bytes at address 0 (tests, debugging). `kd`: a kernel
    descriptor for the float modes, None for FlyDSL's (no denormal flush, IEEE mode)."""
    if arch not in LDS_BYTES:
        raise ValueError(f"arch must be one of {sorted(LDS_BYTES)}, got {arch!r}")
    padded = bytes(code) + bytes(16)

    def read(addr: int, n: int) -> bytes:
        if addr < 0 or addr + n > len(padded):
            raise EmuError(f"read past the end of the snippet at {addr:#x}")
        return padded[addr:addr + n]
    return _compile(read, 0, arch, name, kd)


def run_wave(prog: Program, w: Wave, memory=None, lds_bytes: int = 0, budget: int = 100_000) -> LaunchStats:
    """Run one prepared wave (registers set by the caller) of `prog` to its end, alone in its
    workgroup (a barrier releases at once). Returns the launch counters."""
    stats = LaunchStats(kernel=prog.kernel, arch=prog.arch, grid=(1, 1, 1), block=(LANES, 1, 1), waves_per_workgroup=1)
    launch = _Launch(memory)
    wg = _Workgroup(lds_bytes)
    launch.start(wg)
    w.wg, w.launch = wg, launch
    counts = [0] * len(prog.ops)
    with np.errstate(all="ignore"):
        _run_workgroup([w], prog, counts, budget)
    stats.workgroups_launched = 1
    stats.workgroups_with_global_store = int(launch.rec.global_store)
    _fill_stats(stats, prog, counts, launch)
    return stats


class _Launch:
    """What the instructions of a running launch share: memory, counters."""

    def __init__(self, memory):
        self.memory = memory
        self.rec = MemRecorder()
        self.lds_oob = 0
        self.stores = StoreRaceCheck(Memory.BASE) if getattr(memory, "strict", False) else None

    def start(self, wg) -> None:
        """Workgroup `wg` (its ids set) starts running."""
        if self.stores is not None:
            wg.store_number = self.stores.start(wg.ids)


class _Workgroup:
    __slots__ = ("lds", "ids", "races", "store_number")

    def __init__(self, lds_bytes: int, waves: int = 1):
        self.lds = np.zeros(lds_bytes, np.uint8)
        self.ids = (0, 0, 0)
        self.races = LdsRaceCheck(lds_bytes) if waves > 1 and lds_bytes else None  # (lds_races)
        self.store_number = 0  # its number in the launch's store race check (store_races)


def _check_kernel(info, arch: str, block, dynamic_lds: int) -> int:
    kd = info.kd
    unsupported = [name for name, on in (
        ("private segment buffer", kd.enable_sgpr_private_segment_buffer),
        ("flat scratch init", kd.enable_sgpr_flat_scratch_init),
        ("private segment size", kd.enable_sgpr_private_segment_size),
        ("workgroup info SGPR", kd.enable_sgpr_workgroup_info),
        ("dynamic stack", kd.uses_dynamic_stack)) if on]
    if unsupported:
        raise EmuError(f"kernel {info.name} ({arch}) needs {', '.join(unsupported)}, "
                       "which the emulator does not provide")
    threads = block[0] * block[1] * block[2]
    if not 0 < threads <= MAX_WORKGROUP_THREADS or min(block) < 1:
        raise EmuError(f"kernel {info.name}: invalid workgroup size {block}")
    lds = info.group_segment_fixed_size + dynamic_lds
    if lds > LDS_BYTES[arch]:
        raise EmuError(f"kernel {info.name}: {lds} bytes of LDS exceed the {LDS_BYTES[arch]} of {arch}")
    return lds


def _check_host_float_mode():
    """NumPy must see f32 denormals (an FTZ/DAZ host mode would silently flush them)."""
    tiny = np.array([1e-45], F32)
    if not (tiny * F32(1.0))[0] or not (tiny + F32(0.0))[0]:
        raise EmuError("the host FPU flushes float32 denormals (FTZ/DAZ is on, e.g. torch.set_flush_denormal(True)); "
                       "the emulator needs them")


class DispatchPacket:
    """The launch's HSA kernel dispatch packet (hsa_kernel_dispatch_packet_t, 64 bytes), which the
    dispatch-pointer user SGPRs point at, read-only in `memory` while the launch runs. There is no
    HSA queue: the queue-pointer SGPRs hold 0 (a read through them is an access to address 0,
    which fails) and the dispatch id is 0. kernel_object and completion_signal are 0 too."""

    TYPE_KERNEL_DISPATCH = 2  # hsa_packet_type_t, the header's low 8 bits
    DIMENSIONS = 3  # setup: HIP launches every kernel with 3 dimensions

    def __init__(self, info, grid, block, kernarg_addr: int, dynamic_lds: int, memory):
        self.buffer = np.zeros(64, np.uint8)
        f = self.buffer
        f[0:6].view(np.uint16)[:] = (self.TYPE_KERNEL_DISPATCH, self.DIMENSIONS, block[0])
        f[6:10].view(np.uint16)[:] = block[1:]
        f[12:32].view(np.uint32)[:] = (*(g * b for g, b in zip(grid, block)), info.private_segment_fixed_size,
                                       info.group_segment_fixed_size + dynamic_lds)
        f[40:48].view(np.uint64)[0] = kernarg_addr
        self.address = f.ctypes.data
        self.memory, self.key = memory, memory.register(self.address, f.nbytes, writable=False)

    def close(self) -> None:
        self.memory.unregister(self.key)


def _init_wave(w: Wave, info, layout: dict, wg_ids, wave_index: int, block, kernarg_addr: int, memory,
               packet: DispatchPacket):
    w.reset()
    kd = info.kd
    w.mode = initial_mode(kd)
    if info.private_segment_fixed_size:  # architected flat scratch: offsets are per lane (isa_scratch)
        w.scratch = np.zeros((LANES, info.private_segment_fixed_size), np.uint8)
    s = w.s
    if "kernarg_segment_ptr" in layout:
        i = layout["kernarg_segment_ptr"]
        s[i], s[i + 1] = kernarg_addr & 0xFFFFFFFF, kernarg_addr >> 32
    for key, value in (("dispatch_ptr", packet.address), ("queue_ptr", 0), ("dispatch_id", 0)):
        if key in layout:
            i = layout[key]
            s[i], s[i + 1] = value & 0xFFFFFFFF, value >> 32
    if "kernarg_preload" in layout:
        n = kd.kernarg_preload_length
        words = memory.read(kernarg_addr + 4 * kd.kernarg_preload_offset, 4 * n).view(np.uint32)
        first = layout["kernarg_preload"]
        s[first:first + n] = [int(x) for x in words]
    for axis, key in enumerate(("workgroup_id_x", "workgroup_id_y", "workgroup_id_z")):
        if key in layout:
            s[layout[key]] = wg_ids[axis]
    bx, by, bz = block
    threads = bx * by * bz
    t = wave_index * LANES + np.arange(LANES)
    x, y, z = t % bx, (t // bx) % by, t // (bx * by)
    if kd.enable_vgpr_workitem_id == 0:
        w.v[0] = x
    else:
        w.v[0] = x | (y << WORKITEM_ID_BITS) | (z << 2 * WORKITEM_ID_BITS)
    live = min(LANES, threads - wave_index * LANES)
    w.set_exec((1 << live) - 1)
    w.wave_id = wave_index


def _run_wave(w: Wave, prog: Program, counts: list, budget: int) -> None:
    """Run `w` until it ends or reaches a barrier."""
    ops = prog.ops
    pc = w.pc
    n = 0
    limit = budget - w.executed
    try:
        while True:
            counts[pc] += 1
            r = ops[pc](w)
            n += 1
            if r is None:
                pc += 1
            elif r >= 0:
                pc = r
            else:
                w.pc = pc + 1
                if r == END:
                    w.done = True
                else:
                    w.at_barrier = True
                break
            if n >= limit:
                raise EmuError(f"a wave executed {budget} instructions without ending (infinite loop?); "
                               f"last at offset {prog.insts[pc].addr - prog.entry:#x} in kernel {prog.kernel} "
                               f"({prog.arch}); a longer wave needs a larger FLYQUANT_EMU_MAX_WAVE_INSTRUCTIONS "
                               f"(default {DEFAULT_MAX_WAVE_INSTRUCTIONS})")
    except EmuError:
        raise
    except Exception as e:
        inst = prog.insts[pc]
        where = f"`{inst.text}` at offset {inst.addr - prog.entry:#x}" if inst is not None else "the end"
        raise EmuError(f"{type(e).__name__}: {e} -- executing {where} in kernel {prog.kernel} ({prog.arch}), "
                       f"workgroup {w.wg.ids}, wave {w.wave_id}") from e
    finally:
        w.executed += n


def execute(co, kernel: str, grid, block, kernarg_addr: int, dynamic_lds: int, memory, *,
            max_wave_instructions: int | None = None) -> LaunchStats:
    """Run `kernel` of code object `co` over `grid` workgroups of `block` threads; returns its counters."""
    t0, cpu0 = time.perf_counter(), time.process_time()
    budget = MAX_WAVE_INSTRUCTIONS if max_wave_instructions is None else max_wave_instructions
    if type(budget) is not int or budget <= 0:
        raise ValueError(f"max_wave_instructions must be a positive int, got {budget!r}")
    if kernel not in co.kernels:
        raise EmuError(f"kernel {kernel!r} is not in the code object (it has {sorted(co.kernels)})")
    grid, block = tuple(int(g) for g in grid), tuple(int(b) for b in block)
    info = co.kernels[kernel]
    lds_bytes = _check_kernel(info, co.arch, block, int(dynamic_lds))
    _check_host_float_mode()
    prog = program(co, kernel)
    layout = info.kd.sgpr_layout()
    nwaves = -(-(block[0] * block[1] * block[2]) // LANES)
    stats = LaunchStats(kernel=kernel, arch=co.arch, grid=grid, block=block, waves_per_workgroup=nwaves)
    launch = _Launch(memory)
    counts = [0] * len(prog.ops)
    waves = [Wave() for _ in range(nwaves)]
    wg = _Workgroup(lds_bytes, nwaves)
    packet = DispatchPacket(info, grid, block, kernarg_addr, int(dynamic_lds), memory)
    with np.errstate(all="ignore"), contextlib.closing(packet):
        for gz in range(grid[2]):
            for gy in range(grid[1]):
                for gx in range(grid[0]):
                    wg.ids = (gx, gy, gz)
                    wg.lds.fill(LDS_FILL)
                    if wg.races is not None:
                        wg.races.reset()
                    launch.start(wg)
                    launch.rec.global_store = False
                    for i, w in enumerate(waves):
                        _init_wave(w, info, layout, wg.ids, i, block, kernarg_addr, memory, packet)
                        w.wg, w.launch = wg, launch
                    _run_workgroup(waves, prog, counts, budget)
                    stats.workgroups_launched += 1
                    stats.workgroups_with_global_store += launch.rec.global_store
    _fill_stats(stats, prog, counts, launch)
    stats.seconds = time.perf_counter() - t0
    stats.cpu_seconds = time.process_time() - cpu0
    return stats


def _run_workgroup(waves: list[Wave], prog: Program, counts: list, budget: int) -> None:
    while True:
        for w in waves:
            if not w.done and not w.at_barrier:
                _run_wave(w, prog, counts, budget)
        if all(w.done for w in waves):
            return
        for w in waves:  # every live wave waits at the barrier: release them
            w.at_barrier = False
        if waves[0].wg.races is not None:
            waves[0].wg.races.barrier()


def _fill_stats(stats: LaunchStats, prog: Program, counts: list, launch: _Launch) -> None:
    by_class = dict.fromkeys(CLASSES, 0)
    by_opcode: dict[str, int] = {}
    for inst, cls, n in zip(prog.insts, prog.classes, counts):
        if not n or inst is None:
            continue
        by_class[cls] += n
        by_opcode[inst.name] = by_opcode.get(inst.name, 0) + n
    stats.by_class = by_class
    stats.by_opcode = by_opcode
    stats.wave_instructions = sum(counts)
    for index, counter in launch.rec.counters.items():
        inst = prog.insts[index]
        counter.pc, counter.name, counter.cls = inst.addr - prog.entry, inst.name, prog.classes[index]
        counter.text = inst.text
        stats.memory_by_pc[counter.pc] = counter
        stats.memory.setdefault(inst.name, MemCounter()).add(counter)
        stats.mem_class[inst.name] = counter.cls
    stats.lds_out_of_range_lanes = launch.lds_oob
