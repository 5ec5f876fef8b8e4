"""flyquant.emu's runtime side: code objects, kernel arguments, memory checks, the HIP stand-in,
and FlyDSL's unchanged launch path delivering launches (and failures) through it.

The interpreter is replaced by a fake here (``emu._runtime.executor``): these tests pin down
what the interpreter is given and how its exceptions come back, not what it computes.
"""

from __future__ import annotations

import ctypes
import re
import shutil
import struct
import subprocess
import sys
import threading

import emu_kernels as K
import numpy as np
import pytest
import torch

import flyquant.emu as emu
from flyquant import toolchain
from flyquant.emu import codeobject, runtime
from flyquant.emu.codeobject import CodeObjectError, KernelArg, KernelDescriptor, KernelInfo
from flyquant.emu.memory import EmuMemoryError, Memory

ARCHS = ("gfx942", "gfx950")
# vector_add on a (20, 100) f32 problem: tiles of 8x64 -> grid (3, 2), 128 threads per workgroup.
VADD_SHAPE = (20, 100)
VADD_GRID = (3, 2, 1)
VADD_BLOCK = (128, 1, 1)
BLOCK_SUM_LDS_BYTES = K.BLOCK_SUM_THREADS * 4  # one f32 slot per thread


# --- code objects ------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=ARCHS)
def compiled(request, tmp_path_factory):
    """(arch, {kernel: (ELF, ISA text)}) for vector_add and block_sum, compiled (not run)."""
    arch = request.param
    dump = tmp_path_factory.mktemp(f"dump-{arch}")
    patch = pytest.MonkeyPatch()
    with toolchain.target(arch):
        for name, value in dict(
            COMPILE_ONLY="1", FLYDSL_DUMP_IR="1", FLYDSL_DUMP_DIR=str(dump), FLYDSL_RUNTIME_ENABLE_CACHE="0"
        ).items():
            patch.setenv(name, value)
        try:  # fresh (uncached) jit functions: a cached one would not compile, hence not dump
            K.vector_add.__wrapped__(arch)(*(torch.zeros(VADD_SHAPE) for _ in range(3)), stream=0)
            K.block_sum.__wrapped__(arch)(torch.zeros(512), torch.zeros(2), 2, stream=0)
        finally:
            patch.undo()
    return arch, K.dumped_kernels(dump)


def _directive(isa: str, name: str) -> int:
    (value,) = re.findall(rf"^\s*\.amdhsa_{name}\s+(\d+)", isa, flags=re.M)
    return int(value)


def _meta(isa: str, key: str) -> int:
    (value,) = re.findall(rf"^[\s-]+\.{key}:\s+(\d+)", isa, flags=re.M)
    return int(value)


def _meta_args(isa: str) -> list[tuple[int, int, str]]:
    """(offset, size, value_kind) of the YAML metadata's .args, in order."""
    block = isa[isa.index(".args:") : isa.index(".group_segment_fixed_size:")]
    items = block.split("- ")[1:]
    return [
        (
            int(re.search(r"\.offset:\s+(\d+)", item).group(1)),
            int(re.search(r"\.size:\s+(\d+)", item).group(1)),
            re.search(r"\.value_kind:\s+(\S+)", item).group(1),
        )
        for item in items
    ]


def test_code_object_agrees_with_the_assembler_text(compiled):
    """Every descriptor and metadata field decoded from the ELF equals what the compiler's own
    assembly listing (.amdhsa_* directives, YAML metadata) says: two independent encodings."""
    arch, kernels = compiled
    assert set(kernels) == {"emu_vadd_0", "emu_block_sum_0"}
    for name, (elf, isa) in kernels.items():
        co = codeobject.load(elf)
        assert co.arch == arch
        k = co.kernels[name]
        kd = k.kd
        assert k.entry == co.symbols[name]  # descriptor offset lands on the function symbol
        assert k.kd_vaddr == co.symbols[name + ".kd"]
        assert kd.group_segment_fixed_size == _directive(isa, "group_segment_fixed_size")
        assert kd.private_segment_fixed_size == _directive(isa, "private_segment_fixed_size") == 0
        assert kd.kernarg_size == _directive(isa, "kernarg_size") == k.kernarg_segment_size
        assert kd.user_sgpr_count == _directive(isa, "user_sgpr_count")
        assert kd.enable_sgpr_kernarg_segment_ptr == bool(_directive(isa, "user_sgpr_kernarg_segment_ptr"))
        assert kd.enable_sgpr_dispatch_ptr == bool(_directive(isa, "user_sgpr_dispatch_ptr"))
        for axis in "xyz":
            assert getattr(kd, f"enable_sgpr_workgroup_id_{axis}") == bool(
                _directive(isa, f"system_sgpr_workgroup_id_{axis}")
            )
        assert kd.enable_vgpr_workitem_id == _directive(isa, "system_vgpr_workitem_id")
        assert kd.accum_offset == _directive(isa, "accum_offset")
        assert kd.float_denorm_mode_32 == _directive(isa, "float_denorm_mode_32") == codeobject.DENORM_FLUSH_NONE
        assert kd.float_denorm_mode_16_64 == _directive(isa, "float_denorm_mode_16_64")
        assert kd.enable_ieee_mode == bool(_directive(isa, "ieee_mode"))
        assert kd.enable_dx10_clamp == bool(_directive(isa, "dx10_clamp"))
        assert kd.kernarg_preload_length == _directive(isa, "user_sgpr_kernarg_preload_length")
        assert (k.vgpr_count, k.sgpr_count, k.agpr_count) == (
            _meta(isa, "vgpr_count"),
            _meta(isa, "sgpr_count"),
            _meta(isa, "agpr_count"),
        )
        assert [(a.offset, a.size, a.value_kind) for a in k.args] == _meta_args(isa)
        assert k.max_flat_workgroup_size == _meta(isa, "max_flat_workgroup_size")
        layout = kd.sgpr_layout()
        assert layout["kernarg_segment_ptr"] == 0  # the only user SGPR pair FlyDSL enables
        assert layout["workgroup_id_x"] == kd.user_sgpr_count
    assert codeobject.load(kernels["emu_block_sum_0"][0]).kernels["emu_block_sum_0"].group_segment_fixed_size == (
        BLOCK_SUM_LDS_BYTES
    )


def test_read_follows_program_headers(compiled):
    _, kernels = compiled
    elf, _ = kernels["emu_vadd_0"]
    co = codeobject.load(elf)
    k = co.kernels["emu_vadd_0"]
    # The descriptor bytes read by address are the 64 bytes the symbol table points at in the file.
    raw = co.read(k.kd_vaddr, codeobject.KD_SIZE)
    assert struct.unpack_from("<q", raw, 16)[0] == k.kd.kernel_code_entry_byte_offset
    with pytest.raises(CodeObjectError, match="not in any loaded segment"):
        co.read(1 << 40, 4)


def test_load_rejects_what_it_cannot_run(compiled):
    _, kernels = compiled
    elf, _ = kernels["emu_vadd_0"]
    with pytest.raises(CodeObjectError, match="not an ELF"):
        codeobject.load(b"\x00" * 64)
    gfx90a = bytearray(elf)
    flags = struct.unpack_from("<I", gfx90a, 48)[0]
    struct.pack_into("<I", gfx90a, 48, (flags & ~0xFF) | 0x3F)  # EF_AMDGPU_MACH_AMDGCN_GFX90A
    with pytest.raises(CodeObjectError, match="0x3f"):
        codeobject.load(bytes(gfx90a))
    with pytest.raises(CodeObjectError, match="truncated"):
        codeobject.load(elf[: len(elf) - 100])
    assert codeobject.image_size(elf[:64]) == len(elf)  # what the stub uses to copy the image


# --- kernel arguments --------------------------------------------------------------------------


def _kernel(args: list[KernelArg], size: int) -> KernelInfo:
    kd = KernelDescriptor(0, 0, size, 0, 0, 0, 0, 0, 0)
    return KernelInfo(
        name="k", kd_vaddr=0, entry=0, kd=kd, args=tuple(args), kernarg_segment_size=size, kernarg_segment_align=8,
        group_segment_fixed_size=0, private_segment_fixed_size=0, vgpr_count=0, agpr_count=0, sgpr_count=0,
        vgpr_spill_count=0, sgpr_spill_count=0, wavefront_size=64, max_flat_workgroup_size=256, metadata={},
    )  # fmt: skip


def test_kernargs_are_packed_as_hip_does():
    """Explicit arguments at their offsets, hidden ones with the launch's values, the rest 0."""
    args = [
        KernelArg(0, 8, "global_buffer", "global"),
        KernelArg(8, 4, "by_value"),
        KernelArg(16, 4, "hidden_block_count_x"),
        KernelArg(20, 4, "hidden_block_count_y"),
        KernelArg(24, 4, "hidden_block_count_z"),
        KernelArg(28, 2, "hidden_group_size_x"),
        KernelArg(30, 2, "hidden_group_size_y"),
        KernelArg(32, 2, "hidden_group_size_z"),
        KernelArg(34, 2, "hidden_remainder_x"),
        KernelArg(40, 8, "hidden_hostcall_buffer"),
        KernelArg(48, 2, "hidden_grid_dims"),
        KernelArg(52, 4, "hidden_dynamic_lds_size"),
    ]
    params = [struct.pack("<Q", 0x7F0012345678), struct.pack("<i", -3)]
    segment = runtime.pack_kernargs(_kernel(args, 64), params, (5, 2, 1), (256, 1, 1), 512)
    expected = bytearray(64)
    struct.pack_into("<Q", expected, 0, 0x7F0012345678)
    struct.pack_into("<i", expected, 8, -3)
    struct.pack_into("<III", expected, 16, 5, 2, 1)  # workgroups per dimension
    struct.pack_into("<HHH", expected, 28, 256, 1, 1)  # work-items per workgroup
    struct.pack_into("<H", expected, 34, 0)  # whole workgroups only: no remainder
    struct.pack_into("<H", expected, 48, 3)  # hipModuleLaunchKernel's NDRange is 3-D
    struct.pack_into("<I", expected, 52, 512)
    assert segment == expected  # hostcall buffer (unsupported feature) stays a null pointer
    with pytest.raises(runtime.EmuError, match="1 argument values for 2 arguments"):
        runtime.pack_kernargs(_kernel(args, 64), params[:1], (1, 1, 1), (64, 1, 1), 0)
    with pytest.raises(runtime.EmuError, match="has 4 bytes, not 8"):
        runtime.pack_kernargs(_kernel(args, 64), [params[1], params[1]], (1, 1, 1), (64, 1, 1), 0)


def test_kernel_params_are_read_by_metadata_sizes():
    """kernelParams holds one pointer per explicit argument; each points at its value."""
    args = [KernelArg(0, 8, "global_buffer", "global"), KernelArg(8, 16, "by_value"), KernelArg(24, 4, "hidden_none")]
    pointer = ctypes.c_uint64(0x1234)
    packed = (ctypes.c_int32 * 4)(7, 8, 9, 10)
    params = (ctypes.c_void_p * 2)(ctypes.addressof(pointer), ctypes.addressof(packed))
    values = runtime.read_kernel_params(_kernel(args, 32), ctypes.addressof(params))
    assert values == [struct.pack("<Q", 0x1234), struct.pack("<4i", 7, 8, 9, 10)]


# --- memory ------------------------------------------------------------------------------------

LANES = 64


def _addresses(t: torch.Tensor, stride_bytes: int) -> np.ndarray:
    return np.uint64(t.data_ptr()) + np.arange(LANES, dtype=np.uint64) * np.uint64(stride_bytes)


def test_memory_gathers_and_scatters_active_lanes_only():
    x = torch.arange(LANES * 4, dtype=torch.int32)
    addrs = _addresses(x, 16)
    mask = np.ones(LANES, dtype=bool)
    mask[5] = False
    addrs[5] = 0  # an inactive lane's address is never checked nor touched
    mem = Memory()
    got = mem.load(addrs, 16, mask).view(np.int32)
    expected = x.numpy().reshape(LANES, 4).copy()
    expected[5] = 0
    np.testing.assert_array_equal(got, expected)
    mem.store(addrs, (got + 1000).view(np.uint8), mask)
    after = x.numpy().reshape(LANES, 4)
    np.testing.assert_array_equal(after[5], [20, 21, 22, 23])  # untouched
    np.testing.assert_array_equal(after[6], [1024, 1025, 1026, 1027])
    np.testing.assert_array_equal(mem.read(x.data_ptr() + 4, 4).view(np.int32), [1001])


def test_memory_errors_name_the_address():
    mem = Memory()
    one = np.ones(1, dtype=bool)
    with pytest.raises(EmuMemoryError, match="load from 0x10 .*null") as err:
        mem.load(np.array([0x10], dtype=np.uint64), 4, one)
    assert (err.value.address, err.value.nbytes, err.value.write) == (0x10, 4, False)
    for bad in (1 << 46, 2**64 - 8):  # unmapped; wraps around on adding the access size
        with pytest.raises(EmuMemoryError, match=f"{bad:#x}"):
            mem.load(np.array([bad], dtype=np.uint64), 16, one)
    code = ctypes.cast(ctypes.CDLL(None).printf, ctypes.c_void_p).value
    mem.load(np.array([code], dtype=np.uint64), 4, one)  # code is readable ...
    with pytest.raises(EmuMemoryError, match="read-only"):  # ... and never writable
        mem.store(np.array([code], dtype=np.uint64), np.zeros((1, 4), np.uint8), one)


def test_memory_sees_allocations_made_after_it_was_created():
    mem = Memory()
    mem.read(torch.zeros(1).data_ptr(), 4)  # reads the process mappings once
    fresh = torch.full((1 << 22,), 7, dtype=torch.int32)  # 16 MiB: a new mmap'd region
    assert mem.read(fresh.data_ptr() + fresh.nbytes - 4, 4).view(np.int32)[0] == 7


@pytest.mark.loose_memory("checks that the loose mode (outside strict_memory()) sees the heap")
def test_strict_memory_catches_reads_past_a_tracked_tensor():
    x = torch.zeros(LANES, dtype=torch.float32)
    emu.track(x)
    addrs = _addresses(x, 4)
    with emu.strict_memory():
        emu.global_memory().load(addrs, 4, None)
        with pytest.raises(EmuMemoryError, match="strict mode"):
            emu.global_memory().load(addrs + np.uint64(4), 4, None)  # the last lane is one float past the end
    emu.global_memory().load(addrs + np.uint64(4), 4, None)  # outside strict mode the heap mapping is valid


# --- the HIP stand-in --------------------------------------------------------------------------


def _flydsl_runtime_library() -> str:
    import flydsl

    from pathlib import Path

    return str(Path(flydsl.__file__).parent / "_mlir" / "_mlir_libs" / "libfly_jit_runtime.so")


@pytest.mark.skipif(shutil.which("nm") is None, reason="needs binutils' nm")
def test_stub_defines_every_hip_symbol_flydsl_uses():
    def symbols(path: str, defined: bool) -> set[str]:
        flag = "--defined-only" if defined else "--undefined-only"
        out = subprocess.run(["nm", "-D", flag, "--with-symbol-versions", path], capture_output=True, text=True)
        return {line.split()[-1].replace("@@", "@") for line in out.stdout.splitlines()}

    needed = {s for s in symbols(_flydsl_runtime_library(), defined=False) if s.startswith("hip")}
    assert len(needed) >= 28 and all(s.endswith("@hip_4.2") for s in needed)
    assert needed <= symbols(str(runtime.stub_path()), defined=True)


def test_stub_memory_is_host_memory_and_tracked():
    lib = emu._runtime.lib
    ptr = ctypes.c_void_p()
    assert lib.hipMalloc(ctypes.byref(ptr), ctypes.c_size_t(1000)) == 0
    assert ptr.value % 256 == 0
    assert lib.hipMemset(ptr, 0x5A, ctypes.c_size_t(1000)) == 0
    host = (ctypes.c_uint8 * 1000)()
    assert lib.hipMemcpy(host, ptr, ctypes.c_size_t(1000), 2) == 0  # 2: hipMemcpyDeviceToHost
    assert bytes(host) == b"\x5a" * 1000
    with emu.strict_memory():  # a hipMalloc'd buffer is a precise region
        emu.global_memory().read(ptr.value + 996, 4)
        with pytest.raises(EmuMemoryError):
            emu.global_memory().read(ptr.value + 997, 4)
        assert lib.hipFree(ptr) == 0
        with pytest.raises(EmuMemoryError):
            emu.global_memory().read(ptr.value, 4)


def test_stub_reports_errors_like_hip():
    lib = emu._runtime.lib
    lib.hipGetErrorName.restype = ctypes.c_char_p
    assert lib.hipSetDevice(1) == 101  # hipErrorInvalidDevice: there is one device
    assert lib.hipGetLastError() == 101
    assert lib.hipGetLastError() == 0  # reading the error resets it
    assert lib.hipGetErrorName(101) == b"hipErrorInvalidDevice"


def test_runtime_refuses_a_process_already_bound_to_hip(monkeypatch):
    monkeypatch.setattr(runtime, "loaded_libraries", lambda: ["/opt/rocm/lib/libamdhip64.so.7"])
    with pytest.raises(runtime.EmuError, match="already loaded"):
        runtime.Runtime(emu.EmuLaunchError)


def test_enable_validates_the_arch():
    before = emu.arch()
    with pytest.raises(ValueError, match="gfx90a"):
        emu.enable("gfx90a")
    assert emu.arch() == before


def test_environment_variable_enables_at_import():
    code = "import os, flyquant.emu as e; print(e.enabled(), e.arch(), os.environ['ARCH'], os.environ['FLYDSL_GPU_ARCH'])"
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("ARCH", "FLYDSL_GPU_ARCH")}
    out = subprocess.run([sys.executable, "-c", code], env={**env, "FLYQUANT_EMU": "gfx942"}, capture_output=True, text=True)
    assert out.stdout.split() == ["True", "gfx942", "gfx942", "gfx942"], out.stderr


# --- FlyDSL's launch path ----------------------------------------------------------------------


def _vadd_tensors():
    torch.manual_seed(0)
    return torch.randn(VADD_SHAPE), torch.randn(VADD_SHAPE), torch.zeros(VADD_SHAPE)


@pytest.mark.parametrize("arch", ARCHS)
def test_flydsl_launch_reaches_the_interpreter(arch, monkeypatch):
    """The interpreter gets the code object of the arch compiled for, FlyDSL's grid and block,
    and a kernarg segment holding the tensors' data pointers and (M, N) / row stride."""
    seen = []

    def fake_execute(co, kernel, grid, block, kernarg_addr, dynamic_lds, memory):
        size = co.kernels[kernel].kernarg_segment_size
        seen.append((co.arch, kernel, grid, block, dynamic_lds, memory.read(kernarg_addr, size).tobytes()))
        return {"fake": "stats"}

    monkeypatch.setattr(emu._runtime, "executor", fake_execute)
    a, b, c = _vadd_tensors()
    with toolchain.target(arch), emu.record() as launches:
        assert K.vector_add(arch)(a, b, c, stream=0) is None
    ((co_arch, kernel, grid, block, dynamic_lds, segment),) = seen
    assert (co_arch, kernel, grid, block, dynamic_lds) == (arch, "emu_vadd_0", VADD_GRID, VADD_BLOCK, 0)
    # Per tensor (metadata .args): pointer (8 bytes), then shape (i32, i32) and row stride (i64).
    for i, t in enumerate((a, b, c)):
        ptr, m, n, row_stride = struct.unpack_from("<QiiQ", segment, 24 * i)
        assert (ptr, m, n, row_stride) == (t.data_ptr(), *VADD_SHAPE, VADD_SHAPE[1])
    (record,) = launches
    assert (record.kernel, record.arch, record.grid, record.block, record.stats) == (
        "emu_vadd_0", arch, VADD_GRID, VADD_BLOCK, {"fake": "stats"},
    )  # fmt: skip
    assert emu.launches()[-1] == record


def test_nested_record_blocks_each_get_their_launches(monkeypatch):
    """An inner emu.record() block leaves the enclosing one registered: both see the launch made
    inside both, only the outer the one after (the inner block's exit removed the first recorder
    equal to its list, so with both empty the outer's: it stopped recording and its own exit
    raised ValueError)."""
    monkeypatch.setattr(emu._runtime, "executor", lambda *args: {"fake": "stats"})
    a, b, c = _vadd_tensors()
    with toolchain.target("gfx942"), emu.record() as outer:
        with emu.record() as inner:
            K.vector_add("gfx942")(a, b, c, stream=0)
        K.vector_add("gfx942")(a, b, c, stream=0)
    assert (len(inner), len(outer)) == (1, 2)
    assert not any(r is inner or r is outer for _, r in emu._runtime.recorders)


def test_failing_kernel_raises_in_the_launching_thread(monkeypatch):
    def broken(co, kernel, *_):
        raise ValueError(f"{kernel}: unknown instruction v_bogus_b32 at offset 0x40")

    monkeypatch.setattr(emu._runtime, "executor", broken)
    a, b, c = _vadd_tensors()
    launch = K.vector_add("gfx950")
    with toolchain.target("gfx950"):
        with pytest.raises(emu.EmuLaunchError, match=r"emu_vadd_0 \(gfx950\) failed: ValueError: .*v_bogus_b32") as err:
            launch(a, b, c, stream=0)
        assert isinstance(err.value.__cause__, ValueError)

        caught = []

        def worker():
            try:
                launch(a, b, c, stream=0)
            except emu.EmuLaunchError as exc:
                caught.append(exc)

        thread = threading.Thread(target=worker)
        thread.start()
        thread.join()
        assert len(caught) == 1 and "v_bogus_b32" in str(caught[0])
        assert not emu._runtime.pending  # nothing left to surface later

        monkeypatch.setattr(emu._runtime, "executor", lambda *args: "ok")
        launch(a, b, c, stream=0)  # the failure did not poison later launches
        assert emu.launches()[-1].stats == "ok"


def test_a_rocm_gpu_is_found_in_the_kfd_topology(tmp_path, monkeypatch):
    """rocm_device_present reads the KFD topology (a node with SIMDs is a GPU): FlyDSL's query ran
    rocm_agent_enumerator from PATH and took its failure for no GPU (helper-65), so a machine
    without /opt/rocm/bin in PATH would have had the emulator enabled beside its real GPU."""
    real_exists = emu.os.path.exists
    monkeypatch.setattr(emu.os.path, "exists", lambda p: p == "/dev/kfd" or real_exists(p))
    monkeypatch.setattr(emu, "KFD_NODES", str(tmp_path))
    for node, simds in ((0, 0), (1, 0)):  # CPU nodes only
        (tmp_path / str(node)).mkdir()
        (tmp_path / str(node) / "properties").write_text(f"cpu_cores_count 64\nsimd_count {simds}\nmax_waves_per_simd 0\n")
    assert not emu.rocm_device_present()
    (tmp_path / "2").mkdir()
    (tmp_path / "2" / "properties").write_text("cpu_cores_count 0\nsimd_count 1216\ngfx_target_version 90402\n")
    assert emu.rocm_device_present()
    monkeypatch.setattr(emu.os.path, "exists", lambda p: p != "/dev/kfd" and real_exists(p))
    assert not emu.rocm_device_present()  # no /dev/kfd: no GPU, whatever the topology says


def test_record_and_strict_memory_under_threads(monkeypatch):
    """helper-69: emu.record() collected every thread's launches, and two threads' overlapping
    strict_memory() blocks left the mode on for good (or off inside the second block). Now a
    record() block gets its own thread's launches only, and the strict mode holds from the first
    open block to the end of the last, then the mode before it comes back."""
    monkeypatch.setattr(emu._runtime, "executor", lambda *args: "ok")
    a, b, c = _vadd_tensors()
    launch = K.vector_add("gfx950")
    inside, other_done = threading.Event(), threading.Event()

    def other():
        inside.wait()
        with toolchain.target("gfx950"):
            launch(a, b, c, stream=0)
        other_done.set()

    thread = threading.Thread(target=other)
    thread.start()
    with emu.record() as mine:
        with toolchain.target("gfx950"):  # holds toolchain.launch_lock: the other launch waits for it to end
            launch(a, b, c, stream=0)
        inside.set()
        assert other_done.wait(timeout=60)  # the other thread launched inside this record() block
    thread.join()
    assert len(mine) == 1

    mem = emu.global_memory()
    before = mem.strict
    a_in, b_in, a_out, seen = threading.Event(), threading.Event(), threading.Event(), []

    def first():
        with emu.strict_memory():
            a_in.set()
            b_in.wait(timeout=60)
        a_out.set()

    def second():
        a_in.wait(timeout=60)
        with emu.strict_memory():
            b_in.set()
            a_out.wait(timeout=60)
            seen.append(mem.strict)

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == [True] and mem.strict == before
