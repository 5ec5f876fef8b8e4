"""Per-instruction tests of the flyquant.emu interpreter, continued (test_emu_isa.py says how):
memory instructions (buffer, global, atomics, LDS, scalar loads), their out-of-range rules, and the
traffic counters (per class, per instruction, per tensor, lines and partial stores)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tinygrad.renderer.amd.dsl import EXEC, s, v
from tinygrad.runtime.autogen.amd.cdna import ins as I

from flyquant.emu.alloc import aligned
from flyquant.emu.isa_base import EmuError
from flyquant.emu.memory import Memory

from test_emu_isa import ARCHS, FULL, LANES, OFF, ZERO, run


# --- memory -------------------------------------------------------------------------------------------
def _rsrc_sgprs(base: int, num_records: int) -> dict:
    """A raw buffer resource in s[4:7]: base, stride 0, num_records (bytes), FlyDSL's flags."""
    return {4: base & 0xFFFFFFFF, 5: (base >> 32) & 0xFFFF, 6: num_records, 7: (7 << 12) | (4 << 15)}


@pytest.mark.parametrize("arch", ARCHS)
def test_buffer_load_out_of_range_reads_zero_per_dword(arch):
    # num_records 40 bytes: lane l loads dwordx2 at byte 8*l (+ inst offset 0); dword d of lane l
    # is in range iff 8*l + 4*d + 4 <= 40.
    buf = np.arange(100, dtype=np.uint32) + 1000
    mem = Memory()
    inst = I.buffer_load_dwordx2(vdata=v[2:3], vaddr=v[0], srsrc=s[4:7], soffset=ZERO, offen=1, offset=0)
    w, stats = run(arch, inst, sgpr=_rsrc_sgprs(buf.ctypes.data, 40), vgpr={0: LANES * 8, 2: 7, 3: 7}, memory=mem)
    for lane in range(8):
        for d in range(2):
            ok = 8 * lane + 4 * d + 4 <= 40
            assert w.v[2 + d, lane] == (buf[lane * 2 + d] if ok else 0), (lane, d)
    assert stats.memory["buffer_load_dwordx2"].bytes == 5 * 8


@pytest.mark.parametrize("arch", ARCHS)
def test_buffer_sgpr_offset_where_both_range_checks_agree(arch):
    # the SGPR offset (16 bytes) moves every lane's address; lanes 0 and 1 are in range by both
    # readings of the check (8l + 4d + 4 <= 40, and <= 40 - 16 with the SGPR offset), and lanes
    # from 5 on are out of range by both: exec holds only those
    buf = np.arange(100, dtype=np.uint32) + 1000
    sg = {**_rsrc_sgprs(buf.ctypes.data, 40), 8: 16}
    inst = I.buffer_load_dwordx2(vdata=v[2:3], vaddr=v[0], srsrc=s[4:7], soffset=s[8], offen=1, offset=0)
    exec_mask = 0b11 | ~0b11111 & (1 << 64) - 1
    w, _ = run(arch, inst, sgpr=sg, vgpr={0: LANES * 8, 2: 7, 3: 7}, memory=Memory(), exec_mask=exec_mask)
    for lane in (0, 1, 5, 63):
        for d in range(2):
            assert w.v[2 + d, lane] == (buf[4 + lane * 2 + d] if lane < 2 else 0), (lane, d)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("case", ["sgpr offset", "wrap"])
def test_buffer_lanes_the_range_check_readings_disagree_on_are_an_error(arch, case):
    # ISA guide (checked: vgpr + inst_offset) vs gfx950 hardware per ROCm's simulator (the SGPR
    # offset checked too; vgpr + inst_offset wrapping at 32 bits): lane 3's dwordx2 at 24 with an
    # SGPR offset of 16 ends at 32 <= 40 by the first, past 40 by the second; a VGPR offset of
    # 2^32 - 4 plus inst_offset 8 is out of range unwrapped and 4 (in range) wrapped
    buf = np.arange(100, dtype=np.uint32)
    if case == "sgpr offset":
        sg, vg, offset = {**_rsrc_sgprs(buf.ctypes.data, 40), 8: 16}, {0: LANES * 8}, 0
    else:
        sg, vg, offset = {**_rsrc_sgprs(buf.ctypes.data, 40), 8: 0}, {0: np.full(64, 2**32 - 4)}, 8
    inst = I.buffer_load_dwordx2(vdata=v[2:3], vaddr=v[0], srsrc=s[4:7], soffset=s[8], offen=1, offset=offset)
    with pytest.raises(EmuError, match="in range by one reading of the range check"):
        run(arch, inst, sgpr=sg, vgpr=vg, memory=Memory())


@pytest.mark.parametrize("arch", ARCHS)
def test_buffer_store_out_of_range_is_dropped_and_dwordx3(arch):
    # dwordx3 stores at 12*l, num_records 30: dword d of lane l is written iff 12l + 4d + 4 <= 30:
    # lanes 0 and 1 write all three, lane 2 only its first (24 + 4 <= 30 < 28 + 4)
    buf = np.zeros(64, np.uint32)
    mem = Memory()
    inst = I.buffer_store_dwordx3(vdata=v[2:4], vaddr=v[0], srsrc=s[4:7], soffset=ZERO, offen=1, offset=0)
    vg = {0: LANES * 12, 2: LANES + 1, 3: LANES + 100, 4: LANES + 200}
    run(arch, inst, sgpr=_rsrc_sgprs(buf.ctypes.data, 30), vgpr=vg, memory=mem)
    assert list(buf[:9]) == [1, 100, 200, 2, 101, 201, 3, 0, 0]


@pytest.mark.parametrize("arch", ARCHS)
def test_buffer_sub_dword_loads_and_d16(arch):
    # ubyte zero-extends, sbyte sign-extends, short_d16_hi writes bits 31:16 and keeps 15:0
    data = np.array([0x80, 0x7F, 0xFE, 0xFF], np.uint8)
    mem = Memory()
    sg = _rsrc_sgprs(data.ctypes.data, 4)
    w, _ = run(arch, I.buffer_load_ubyte(vdata=v[1], vaddr=v[0], srsrc=s[4:7], soffset=ZERO, offset=0),
               I.buffer_load_sbyte(vdata=v[2], vaddr=v[0], srsrc=s[4:7], soffset=ZERO, offset=0),
               I.buffer_load_short_d16_hi(vdata=v[3], vaddr=v[0], srsrc=s[4:7], soffset=ZERO, offset=2),
               I.buffer_load_ubyte(vdata=v[4], vaddr=v[0], srsrc=s[4:7], soffset=ZERO, offset=4),
               I.buffer_load_dword(vdata=v[5], vaddr=v[0], srsrc=s[4:7], soffset=ZERO, offset=2),
               sgpr=sg, vgpr={3: 0x1234, 4: 9, 5: 9}, memory=mem)
    assert w.v[1, 0] == 0x80 and w.v[2, 0] == 0xFFFFFF80 and w.v[3, 0] == 0xFFFE1234
    assert w.v[4, 0] == 0  # byte 4 is out of range (num_records 4)
    assert w.v[5, 0] == 0  # a dword at bytes 2..5 crosses num_records: all of it reads 0


@pytest.mark.parametrize("arch", ARCHS)
def test_global_loads_stores_x3_and_d16_hi(arch):
    src_buf = np.arange(64 * 3, dtype=np.uint32)
    dst = np.zeros(64, np.uint16)
    mem = Memory()
    addr = src_buf.ctypes.data + LANES.astype(np.uint64) * 12
    daddr = dst.ctypes.data + LANES.astype(np.uint64) * 2
    w, stats = run(arch, I.global_load_dwordx3(vdst=v[4:6], addr=v[0], saddr=OFF, offset=0),
                   I.global_store_short_d16_hi(addr=v[2], data=v[7], saddr=OFF, offset=0),
                   vgpr={0: addr & 0xFFFFFFFF, 1: addr >> 32, 2: daddr & 0xFFFFFFFF, 3: daddr >> 32,
                         7: (LANES + 0xAB00) << 16}, memory=mem)
    assert (w.v[4] == LANES * 3).all() and (w.v[6] == LANES * 3 + 2).all()
    assert (dst == LANES + 0xAB00).all()
    # 768 contiguous bytes from a 4-byte aligned base: 6 or 7 lines; 128 contiguous stored bytes
    load = stats.memory["global_load_dwordx3"]
    assert load.bytes == 768 and load.lines in (6, 7)
    assert stats.workgroups_with_global_store == 1


@pytest.mark.parametrize("arch", ARCHS)
def test_global_atomic_pk_add_bf16_colliding_lanes_in_order(arch):
    # all 64 lanes add bf16 1.0 to both halves of the same dword starting at 256.0: in bf16
    # (8 bits) 256 + 1 = 257 rounds to even 256 every time, so lane order matters only through
    # rounding: the result stays 256 (0x4380) in both halves; return value of lane 0 is 256.
    out = np.array([0x43804380], np.uint32)
    mem = Memory()
    a = out.ctypes.data
    w, _ = run(arch, I.global_atomic_pk_add_bf16(vdst=v[3], addr=v[0], data=v[2], saddr=OFF, offset=0, sc0=1),
               vgpr={0: a & 0xFFFFFFFF, 1: a >> 32, 2: 0x3F803F80}, memory=mem)
    assert out[0] == 0x43804380 and w.v[3, 0] == 0x43804380


@pytest.mark.parametrize("arch", ARCHS)
def test_global_atomic_add_f32_sums_every_lane(arch):
    out = np.zeros(2, np.float32)
    mem = Memory()
    addr = out.ctypes.data + (LANES % 2).astype(np.uint64) * 4
    run(arch, I.global_atomic_add_f32(addr=v[0], data=v[2], saddr=OFF, offset=0),
        vgpr={0: addr & 0xFFFFFFFF, 1: addr >> 32, 2: np.float32(0.5) * np.ones(64, np.float32)}, memory=mem)
    assert list(out) == [16.0, 16.0]


def test_memory_error_names_the_instruction():
    with pytest.raises(EmuError, match=r"global_load_dword.*offset 0x0"):
        run("gfx942", I.global_load_dword(vdst=v[1], addr=v[0], saddr=OFF, offset=0), vgpr={0: 16, 1: 0},
            memory=Memory(strict=True))


def test_lds_write2st64_read2_and_out_of_range():
    # write2st64_b32 offsets 1 and 2 (x 256 bytes); read2_b32 reads them back as dwords 64 and
    # 128; a b64 read past the 1024-byte LDS returns 0 and is counted
    addr = (LANES * 4).astype(np.uint32)
    w, stats = run("gfx942", I.ds_write2st64_b32(addr=v[0], data0=v[1], data1=v[2], offset0=1, offset1=2),
                   I.ds_read2_b32(vdst=v[4:5], addr=v[0], offset0=64, offset1=128),
                   I.ds_read_b64(vdst=v[6:7], addr=v[3], offset0=0, offset1=0),
                   vgpr={0: addr, 1: LANES + 1, 2: LANES + 500, 3: 1020, 6: 9, 7: 9}, lds=1024)
    assert (w.v[4] == LANES + 1).all() and (w.v[5] == LANES + 500).all()
    assert (w.v[6] == 0).all() and stats.lds_out_of_range_lanes == 64


def test_ds_add_rtn_u32_colliding_lanes():
    # every lane adds 1 to LDS dword 0: final 64, lane l returns l (lanes apply in order)
    w, _ = run("gfx942", I.ds_add_rtn_u32(vdst=v[2], addr=v[0], data0=v[1], offset0=0, offset1=0),
               I.ds_read_b32(vdst=v[3], addr=v[0], offset0=0, offset1=0), vgpr={0: 0, 1: 1}, lds=64)
    assert (w.v[2] == LANES).all() and (w.v[3] == 64).all()


def test_smem_load_and_s_buffer_load_range():
    data = np.array([11, 22, 33, 44], np.uint32)
    mem = Memory()
    base = data.ctypes.data
    w, _ = run("gfx942", I.s_load_dwordx2(s[10:11], s[0:1], offset=4, imm=1),
               I.s_buffer_load_dwordx2(s[12:13], s[4:7], offset=8, imm=1),
               sgpr={0: base & 0xFFFFFFFF, 1: base >> 32, **_rsrc_sgprs(base, 12)}, memory=mem)
    assert (w.s[10], w.s[11]) == (22, 33)
    assert (w.s[12], w.s[13]) == (33, 0)  # the dword at byte 12 is past num_records


# --- counters -----------------------------------------------------------------------------------------
def test_counters_by_class_and_partial_store_lines():
    # 64 lanes store dword l at byte 4*l: 256 contiguous bytes; from a base 64 bytes into a line
    # they touch 3 lines, the first and last only partly.
    buf = np.zeros(128, np.uint32)
    mem = Memory()
    base = (buf.ctypes.data + 127) // 128 * 128 + 64
    addr = base + LANES.astype(np.uint64) * 4
    _, stats = run("gfx942", I.s_nop(simm16=0), I.global_store_dword(addr=v[0], data=v[2], saddr=OFF, offset=0),
                   vgpr={0: addr & 0xFFFFFFFF, 1: addr >> 32, 2: LANES}, memory=mem)
    st = stats.memory["global_store_dword"]
    assert (st.bytes, st.lines, st.partial_store_lines) == (256, 3, 2)
    assert stats.by_class["wait"] == 1 and stats.by_class["vmem_store"] == 1 and stats.wave_instructions == 3


def test_memory_counters_per_instruction_and_by_tensor():
    # Two loads of two tensors, told apart by pc and by address range:
    #   pc 4 (after the 4-byte s_nop): global_load_dwordx4, lane l at a + 16 l: 64 x 16 = 1024
    #     contiguous bytes from a line start = 8 whole lines, coalescing 1, range [a, a + 1024);
    #   pc 12 (after the 8-byte global load): global_load_dword, lane l at b + 256 (63 - l) (column
    #     0 of a 64 x 64 f32 matrix, bottom up: lane 0 is not the lowest address): 64 x 4 bytes in
    #     64 lines, coalescing 256 / (64 * 128) = 1/32, range [b, b + 63 * 256 + 4).
    a = aligned(torch.zeros(256, dtype=torch.int32))  # line-aligned, as a GPU allocation
    b = aligned(torch.zeros(64 * 64, dtype=torch.int32))
    a.copy_(torch.arange(256))
    b.copy_(torch.arange(64 * 64) + 5000)
    pa, pb = a.data_ptr(), b.data_ptr()
    addr_a = pa + LANES.astype(np.uint64) * 16
    addr_b = pb + (63 - LANES).astype(np.uint64) * 256
    w, stats = run("gfx950", I.s_nop(simm16=0),
                   I.global_load_dwordx4(vdst=v[4:7], addr=v[0], saddr=OFF, offset=0),
                   I.global_load_dword(vdst=v[8], addr=v[2], saddr=OFF, offset=0),
                   vgpr={0: addr_a & 0xFFFFFFFF, 1: addr_a >> 32, 2: addr_b & 0xFFFFFFFF, 3: addr_b >> 32},
                   memory=Memory())
    assert (w.v[4] == LANES * 4).all() and (w.v[8] == (63 - LANES) * 64 + 5000).all()
    assert sorted(stats.memory_by_pc) == [4, 12]
    ca, cb = stats.memory_by_pc[4], stats.memory_by_pc[12]
    assert (ca.name, ca.cls, cb.name, cb.cls) == ("global_load_dwordx4", "vmem_load", "global_load_dword", "vmem_load")
    assert (ca.executed, ca.lanes, ca.bytes, ca.lines, ca.lo, ca.hi) == (1, 64, 1024, 8, pa, pa + 1024)
    assert (cb.executed, cb.lanes, cb.bytes, cb.lines, cb.lo, cb.hi) == (1, 64, 256, 64, pb, pb + 63 * 256 + 4)
    assert (ca.bytes_per_lane, ca.coalescing, cb.bytes_per_lane, cb.coalescing) == (16, 1.0, 4, 1 / 32)
    # by tensor: [data_ptr, data_ptr + nbytes) holds exactly one instruction's accesses each
    assert stats.memory_within(pa, pa + a.nbytes) == {4: ca}
    assert stats.memory_within(pb, pb + b.nbytes) == {12: cb}
    ta = stats.traffic_within(pa, pa + a.nbytes)
    assert (ta.executed, ta.bytes, ta.lines) == (1, 1024, 8)
    assert stats.traffic_within(pa, pa + 512).executed == 0  # an instruction half inside does not count
    # the per-mnemonic counters are the per-pc ones summed
    assert stats.memory["global_load_dwordx4"] == stats.traffic_within(pa, pa + a.nbytes)


@pytest.mark.parametrize("arch", ARCHS)
def test_buffer_tail_counts_bytes_and_lines_once(arch):
    # lane l loads dwordx4 at byte 16*l of a 128-byte aligned buffer with num_records 136: lanes
    # 0..7 are in range (one line), lane 8 only for dwords 0, 1 (bytes 128..135, the next line),
    # every other dword reads 0. Counted once: 136 bytes in 2 lines.
    store = np.arange(256, dtype=np.uint32)
    base = (store.ctypes.data + 127) // 128 * 128
    first = (base - store.ctypes.data) // 4
    inst = I.buffer_load_dwordx4(vdata=v[2:5], vaddr=v[0], srsrc=s[4:7], soffset=ZERO, offen=1, offset=0)
    w, stats = run(arch, inst, sgpr=_rsrc_sgprs(base, 136), vgpr={0: LANES * 16}, memory=Memory())
    got = w.v[2:6].T
    for lane in range(64):
        want = [store[first + 4 * lane + d] if 16 * lane + 4 * d + 4 <= 136 else 0 for d in range(4)]
        assert list(got[lane]) == want, lane
    c = stats.memory["buffer_load_dwordx4"]
    assert (c.executed, c.bytes, c.lines) == (1, 136, 2)
    # 9 lanes moved data (lane 8 two dwords of its four): 136 / 9 bytes per lane; bytes [base, base + 136)
    pc = stats.memory_by_pc[0]
    assert (pc.lanes, pc.bytes_per_lane, pc.lo, pc.hi) == (9, 136 / 9, base, base + 136)


def test_line_counts_follow_the_offset_in_the_line():
    # the same lane pattern (64 contiguous dwords) from a line-aligned base touches 2 lines,
    # from 4 bytes further 3: the counts are remembered per pattern and offset in the line
    buf = np.zeros(256, np.uint32)
    base = (buf.ctypes.data + 127) // 128 * 128
    a0 = base + LANES.astype(np.uint64) * 4
    a1 = a0 + 4
    _, stats = run("gfx942", I.global_load_dword(vdst=v[4], addr=v[0], saddr=OFF, offset=0),
                   I.global_load_dword(vdst=v[5], addr=v[2], saddr=OFF, offset=0),
                   I.global_load_dword(vdst=v[6], addr=v[0], saddr=OFF, offset=0),
                   vgpr={0: a0 & 0xFFFFFFFF, 1: a0 >> 32, 2: a1 & 0xFFFFFFFF, 3: a1 >> 32}, memory=Memory())
    assert stats.memory["global_load_dword"].lines == 2 + 3 + 2


def test_lds_read_with_an_inactive_lane_out_of_range():
    # lane 63 (EXEC off) points past the 256-byte LDS: nothing is counted, active lanes read
    w, stats = run("gfx942", I.ds_write_b32(addr=v[0], data0=v[1], offset0=0, offset1=0),
                   I.ds_read_b32(vdst=v[2], addr=v[0], offset0=0, offset1=0),
                   vgpr={0: np.where(LANES < 63, LANES * 4, 4096), 1: LANES + 100, 2: 5},
                   exec_mask=(1 << 63) - 1, lds=256)
    assert (w.v[2, :63] == LANES[:63] + 100).all() and w.v[2, 63] == 5 and stats.lds_out_of_range_lanes == 0


@pytest.mark.parametrize("arch", ARCHS)
def test_global_atomic_pk_add_f16_every_lane(arch):
    # 64 lanes add f16 (1.0, 0.5) to one dword holding (0, 0): exact sums 64.0 (0x5400) and
    # 32.0 (0x5000); lane 0 returns the initial value
    out = np.zeros(1, np.uint32)
    a = out.ctypes.data
    w, _ = run(arch, I.global_atomic_pk_add_f16(vdst=v[3], addr=v[0], data=v[2], saddr=OFF, offset=0, sc0=1),
               vgpr={0: a & 0xFFFFFFFF, 1: a >> 32, 2: 0x38003C00, 3: 9}, memory=Memory())
    assert out[0] == 0x50005400 and w.v[3, 0] == 0


def test_buffer_store_writes_only_active_lanes():
    # MUBUF stores write for the lanes with EXEC set only (every access in range here)
    buf = np.zeros(64, np.uint32)
    inst = I.buffer_store_dword(vdata=v[2], vaddr=v[0], srsrc=s[4:7], soffset=ZERO, offen=1, offset=0)
    run("gfx942", inst, sgpr=_rsrc_sgprs(buf.ctypes.data, 256), vgpr={0: LANES * 4, 2: LANES + 1},
        memory=Memory(), exec_mask=0x5555555555555555)
    assert np.array_equal(buf, np.where(LANES % 2 == 0, LANES + 1, 0))


def test_buffer_load_to_lds_leaves_the_lds_of_inactive_lanes():
    # LDS first filled with 0xEE bytes (ds_write_b128, every lane); then with lane 3 out of EXEC a
    # buffer_load_dwordx4 ... lds writes M0 + 16 l for the active lanes only: lane 3's slot keeps its bytes
    buf = np.arange(4 * 64, dtype=np.uint32) + 1000
    sgpr = {**_rsrc_sgprs(buf.ctypes.data, 4 * 4 * 64), 124: 0, 10: FULL & ~(1 << 3) & 0xFFFFFFFF, 11: FULL >> 32}
    fill = {8 + i: 0xEEEEEEEE for i in range(4)}
    w, _ = run("gfx950", I.ds_write_b128(addr=v[1], data0=v[8:11], offset0=0, offset1=0), I.s_mov_b64(EXEC, s[10:11]),
               I.buffer_load_dwordx4(vdata=v[4:7], vaddr=v[0], srsrc=s[4:7], soffset=ZERO, offen=1, offset=0, lds=1),
               sgpr=sgpr, vgpr={0: LANES * 16, 1: LANES * 16, **fill}, memory=Memory(), lds=16 * 64)
    lds = w.wg.lds.view(np.uint32).reshape(64, 4)
    assert (lds[3] == 0xEEEEEEEE).all()
    assert np.array_equal(lds[0], buf[0:4]) and np.array_equal(lds[4], buf[16:20])
