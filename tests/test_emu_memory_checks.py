"""The checks the suite's memory-safety guarantee rests on, each at the edge where a weaker check
would still pass: the strict memory of tests/conftest.py (a launch touches only its tensor
arguments' bytes, its kernarg segment read-only), the buffer range check's two readings, the
store-race and LDS-race detectors, LDS and scratch bounds. (Found by mutating these checks: the
tests elsewhere use accesses far past the edges, which a check off by one byte also catches.)"""

from __future__ import annotations

import emu_kernels as K
import numpy as np
import pytest
import torch
from tinygrad.renderer.amd.dsl import s, v
from tinygrad.runtime.autogen.amd.cdna import ins as I

import flyquant.emu as emu
from flyquant.emu import decode as D
from flyquant.emu import interp
from flyquant.emu.isa_base import EmuError
from flyquant.emu.memory import EmuMemoryError, Memory
from flyquant.emu.runtime import kernarg_readable_bytes
from flyquant.emu.store_races import StoreRaceCheck

from conftest import _Extents, tensor_extent
from test_emu_isa import ARCHS, LANES, OFF, program, run, wave
from test_emu_isa_memory import _rsrc_sgprs


# --- strict memory ------------------------------------------------------------------------------------
def test_tensor_extent_is_exact():
    """The bytes conftest registers for a launch tensor: its elements' span, not one more."""
    x = torch.zeros(100, dtype=torch.float32)
    assert tensor_extent(x) == (x.data_ptr(), 400)
    assert tensor_extent(x[10:20]) == (x.data_ptr() + 40, 40)
    assert tensor_extent(x.view(10, 10)[2:4, 1:3]) == (x.data_ptr() + 84, 48)  # rows 2-3, columns 1-2
    assert tensor_extent(x[:0]) is None


def test_a_view_registers_its_extent_not_its_storage():
    x = torch.zeros(100, dtype=torch.float32)
    mem = Memory(strict=True)
    extents = _Extents(mem)
    extents.add(x[10:20])
    try:
        mem.read(x.data_ptr() + 40, 40)
        for before_or_after in (36, 80):  # x[9], x[20]: in the storage, outside the view
            with pytest.raises(EmuMemoryError):
                mem.read(x.data_ptr() + before_or_after, 4)
    finally:
        extents.release()


def test_a_partly_masked_load_checks_every_active_lane():
    x = np.zeros(64, np.uint32)
    mem = Memory(strict=True)
    key = mem.register(x.ctypes.data, x.nbytes)
    addrs = x.ctypes.data + np.arange(64, dtype=np.uint64) * 4 + np.uint64(4)  # lane 63: one dword past x
    mask = np.ones(64, bool)
    mask[5] = False  # one inactive lane: the masked path
    try:
        with pytest.raises(EmuMemoryError, match="strict mode"):
            mem.load(addrs, 4, mask)
        mask[63] = False
        mem.load(addrs, 4, mask)
    finally:
        mem.unregister(key)


def test_a_global_atomic_needs_writable_memory():
    buf = np.zeros(64, np.uint32)
    mem = Memory(strict=True)
    key = mem.register(buf.ctypes.data, buf.nbytes, writable=False)
    addr = buf.ctypes.data + LANES.astype(np.uint64) * 4
    try:
        with pytest.raises(EmuError, match="outside every known memory region"):
            run("gfx950", I.global_atomic_add(addr=v[0], data=v[2], saddr=OFF, offset=0),
                vgpr={0: addr & 0xFFFFFFFF, 1: addr >> 32, 2: 1}, memory=mem)
    finally:
        mem.unregister(key)
    assert not buf.any()


def test_the_kernarg_segment_is_readable_to_its_granule_and_read_only(monkeypatch):
    assert [kernarg_readable_bytes(bytes(n)) for n in (0, 1, 16, 17, 28, 32)] == [1, 16, 16, 32, 32, 32]
    runtime = emu._runtime
    real = runtime.executor or interp.execute
    seen = []

    def executor(co, name, grid, block, address, dynamic_lds, memory):
        with pytest.raises(EmuMemoryError, match="store to"):
            memory.store(np.array([address], np.uint64), np.zeros((1, 4), np.uint8))
        seen.append(address)
        return real(co, name, grid, block, address, dynamic_lds, memory)

    emu.enable("gfx950")
    monkeypatch.setattr(runtime, "executor", executor)
    out = torch.full((1,), -1, dtype=torch.int32)
    K.last_block_id("gfx950")(out, 1, stream=0)
    assert seen and int(out[0]) == 0


# --- buffer resources ---------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_buffer_readings_disagree_with_every_lane_in_range_by_the_guides(arch):
    """Lane l's dword at 4 l: in range by the ISA guides' reading (4 * 63 + 4 = 256 <= 256), out of
    range with the SGPR offset 16 counted for lanes 60-63: an error even though the guides' reading
    alone puts the whole access in range."""
    buf = np.arange(128, dtype=np.uint32)
    inst = I.buffer_load_dword(vdata=v[2], vaddr=v[0], srsrc=s[4:7], soffset=s[8], offen=1, offset=0)
    with pytest.raises(EmuError, match="in range by one reading of the range check"):
        run(arch, inst, sgpr={**_rsrc_sgprs(buf.ctypes.data, 256), 8: 16}, vgpr={0: LANES * 4}, memory=Memory())


def test_a_buffer_resource_with_a_stride_is_refused():
    buf = np.zeros(64, np.uint32)
    sgpr = _rsrc_sgprs(buf.ctypes.data, 256)
    sgpr[5] |= 16 << 16
    with pytest.raises(EmuError, match="stride 16"):
        run("gfx950", I.buffer_load_dword(vdata=v[2], vaddr=v[0], srsrc=s[4:7], soffset=s[8], offen=1, offset=0),
            sgpr=sgpr, vgpr={0: LANES * 4}, memory=Memory())


# --- store races --------------------------------------------------------------------------------------
@pytest.mark.parametrize("num_records", [256, 252], ids=["all-in-range", "lane-63-out"])
def test_a_buffer_store_race_between_workgroups(num_records):
    """Two workgroups store different dwords to the same bytes with buffer_store_dword, every lane
    in range (the whole-access path) or lane 63 past num_records (the per-component path)."""
    buf = np.zeros(64, np.uint32)
    mem = Memory(strict=True)
    key = mem.register(buf.ctypes.data, buf.nbytes)
    prog = program("gfx950", I.buffer_store_dword(vdata=v[2], vaddr=v[0], srsrc=s[4:7], soffset=s[8], offen=1, offset=0))
    launch = interp._Launch(mem)
    try:
        with pytest.raises(EmuError, match="StoreRace"):
            for g in range(2):
                wg = interp._Workgroup(0)
                wg.ids = (g, 0, 0)
                launch.start(wg)
                w = wave(sgpr={**_rsrc_sgprs(buf.ctypes.data, num_records), 8: 0},
                         vgpr={0: LANES * 4, 2: np.full(64, g + 1)})
                w.wg, w.launch = wg, launch
                interp._run_workgroup([w], prog, [0] * len(prog.ops), 1000)
    finally:
        mem.unregister(key)


def test_a_store_race_on_the_second_page_of_one_store():
    check = StoreRaceCheck(0x1000)
    a, b = check.start((0, 0, 0)), check.start((1, 0, 0))
    idx = np.array([[4095, 4096]], np.uint64)  # one 2-byte store across a 4 KiB page boundary
    check.record(a, idx, np.zeros((1, 2), np.uint8), np.ones((1, 2), np.uint8))
    with pytest.raises(Exception, match="stores to 0x2000, where workgroup"):
        check.record(b, idx, np.ones((1, 2), np.uint8), np.array([[1, 2]], np.uint8))  # byte 4095 unchanged


# --- LDS ----------------------------------------------------------------------------------------------
def _one_workgroup(prog, regs, lds_bytes):
    """Waves with registers `regs` (a VGPR dict each) run in one workgroup, its LDS race check on."""
    launch = interp._Launch(Memory())
    wg = interp._Workgroup(lds_bytes, waves=len(regs))
    launch.start(wg)
    waves = []
    for i, vgpr in enumerate(regs):
        w = wave(vgpr=vgpr)
        w.wave_id = i
        w.wg, w.launch = wg, launch
        waves.append(w)
    with np.errstate(all="ignore"):
        interp._run_workgroup(waves, prog, [0] * len(prog.ops), 1000)


def test_an_lds_read_inside_another_waves_written_dword_is_a_race():
    """Wave 0 writes dwords 0-255; wave 1, with no barrier, reads byte 2 (inside lane 0's dword, not
    its first byte). Each wave's other access touches bytes no other wave does."""
    prog = program("gfx950", I.ds_write_b32(addr=v[0], data0=v[1], offset0=0, offset1=0),
                   I.ds_read_u8(vdst=v[3], addr=v[2], offset0=0, offset1=0))
    wave0 = {0: LANES * 4, 1: np.full(64, 0xFFFFFFFF), 2: 512 + LANES}
    wave1 = {0: 256 + LANES * 4, 1: np.full(64, 0xFFFFFFFF), 2: np.full(64, 2)}
    with pytest.raises(EmuError, match=r"LdsRace: wave 1 reads LDS byte 2, which wave 0 wrote"):
        _one_workgroup(prog, [wave0, wave1], 1024)
    _one_workgroup(prog, [wave0, {**wave1, 2: np.full(64, 700)}], 1024)  # no shared byte: no race


def test_an_lds_write_over_another_waves_write_is_a_race():
    prog = program("gfx950", I.ds_write_b32(addr=v[0], data0=v[1], offset0=0, offset1=0))
    wave0 = {0: LANES * 4, 1: np.full(64, 0xFFFFFFFF)}
    wave1 = {0: LANES * 4, 1: np.full(64, 0xEEEEEEEE)}
    with pytest.raises(EmuError, match=r"LdsRace: wave 1 writes LDS byte 0, which wave 0 wrote"):
        _one_workgroup(prog, [wave0, wave1], 1024)


def test_an_lds_address_near_2_to_the_32_is_out_of_range_not_wrapped():
    w, stats = run("gfx950", I.ds_write_b32(addr=v[0], data0=v[1], offset0=0, offset1=0),
                   I.ds_read_b32(vdst=v[3], addr=v[2], offset0=0, offset1=0),
                   vgpr={0: 60, 1: 0x12345678, 2: 0xFFFFFFFC, 3: 9}, lds=64)
    assert (w.v[3] == 0).all() and stats.lds_out_of_range_lanes == 64


def test_a_load_to_lds_below_address_0_is_out_of_range_not_wrapped():
    """global_load_lds_dword with M0 = 0 and offset -4: lane 0's LDS address is -4, out of range
    (counted), not LDS's last dword (a negative index from its end), which no lane writes: lane l
    lands at 4 l - 4, lane 63 at 248."""
    buf = np.arange(1, 65, dtype=np.uint32)
    addr = buf.ctypes.data + 4 + LANES.astype(np.uint64) * 4
    addr[63] -= 4
    w, stats = run("gfx950", I.global_load_lds_dword(addr=v[0], saddr=OFF, offset=-4 & 0x1FFF),
                   I.ds_read_b32(vdst=v[3], addr=v[2], offset0=0, offset1=0),
                   sgpr={D.M0: 0}, vgpr={0: addr & 0xFFFFFFFF, 1: addr >> 32, 2: 252}, lds=256, memory=Memory())
    assert w.v[3, 0] == 0 and stats.lds_out_of_range_lanes == 1


# --- scratch ------------------------------------------------------------------------------------------
def _scratch_load(offset):
    w = wave()
    w.scratch = np.zeros((64, 64), np.uint8)
    interp.run_wave(program("gfx950", I.scratch_load_dword(vdst=v[1], addr=v[0], saddr=OFF, offset=offset & 0x1FFF)), w)


def test_scratch_accesses_outside_a_lanes_bytes_are_errors():
    with pytest.raises(EmuError, match="outside its 64"):
        _scratch_load(-4)  # before the lane's private bytes, not its last dword
    with pytest.raises(EmuError, match="lane 0 accesses private bytes 62..65 outside its 64"):
        _scratch_load(62)
