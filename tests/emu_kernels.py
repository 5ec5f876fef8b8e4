"""Small FlyDSL kernels that exercise the emulator end to end (tests only, not shipped).

Each builder is cached per arch (a FlyDSL ``@flyc.jit`` function freezes its target at its
first call) and is called inside ``flyquant.toolchain.target(arch)``. Every kernel is small
enough to emulate in well under a second, and each stresses one part of the machine:

- ``vector_add``: predicated 128-bit global loads/stores, 2-D grid, tail predicate;
- ``block_sum``: a tree reduction through LDS with a barrier between steps (4 waves), or
  without them (an LDS race);
- ``lds_before_write``: each thread reads its LDS slot before anything is written there;
- ``last_block_id``: every workgroup stores its id to one address (a store race);
- ``wave_shuffles``: cross-lane data movement inside one wave (shuffle xor / down / idx);
- ``mfma_tile``: one 32x32 tile of A @ B^T on a 2x2 grid of 16x16 MFMAs (f32 and bf16);
- ``buffer_tail``: buffer loads past the descriptor's end read 0, stores there are dropped;
- ``mfma_scale``: one gfx950 scaled MFMA on operands given register by register.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl.expr import const_expr, gpu, range_constexpr, rocdl
from flydsl.expr.typing import T
from flydsl.expr.typing import Vector as Vec

WAVE = 64


def _mlir_string_bytes(escaped: str) -> bytes:
    """Bytes of an MLIR string literal body: printable characters as themselves, "\\\\" for a
    backslash, "\\XX" (two hex digits) for any other byte."""
    out = bytearray()
    i = 0
    while i < len(escaped):
        if escaped[i] != "\\":
            out += escaped[i].encode("latin-1")
            i += 1
        elif escaped[i + 1] == "\\":
            out.append(0x5C)
            i += 2
        else:
            out.append(int(escaped[i + 1 : i + 3], 16))
            i += 3
    return bytes(out)


def dumped_kernels(dump_dir: Path) -> dict[str, tuple[bytes, str]]:
    """{kernel name: (code object ELF, final ISA text)} from a FLYDSL_DUMP_IR directory.

    The ELF is the `bin = "..."` attribute of 20_gpu_module_to_binary.mlir (one code object per
    FlyDSL kernel); the ISA text with its .amdhsa directives is 22_final_isa.s.
    """
    found = {}
    for stage in sorted(Path(dump_dir).glob("*/20_gpu_module_to_binary.mlir")):
        (binary,) = re.findall(r'bin = "((?:[^"\\]|\\.)*)"', stage.read_text())
        isa = (stage.parent / "22_final_isa.s").read_text()
        (name,) = re.findall(r"^\s+\.name:\s+(\S+)", isa, flags=re.M)
        found[name] = (_mlir_string_bytes(binary), isa)
    return found


@functools.lru_cache(maxsize=None)
def vector_add(arch: str):
    """C = A + B for (M, N) f32 tensors; tiles of 8x64, 4 floats per thread, tails predicated."""

    @flyc.kernel
    def emu_vadd(A: fx.Tensor, B: fx.Tensor, C: fx.Tensor, tiled_copy: fx.TiledCopy):
        tid = fx.thread_idx.x
        bid_x, bid_y = fx.block_idx.x, fx.block_idx.y
        M, N = A.shape.unpack()
        coords = fx.make_view((0, 0), fx.make_identity_layout((M, N)))
        tile = tiled_copy.tile_mn
        gA = fx.flat_divide(A, tile)[None, None, bid_x, bid_y]
        gB = fx.flat_divide(B, tile)[None, None, bid_x, bid_y]
        gC = fx.flat_divide(C, tile)[None, None, bid_x, bid_y]
        cC = fx.flat_divide(coords, tile)[None, None, bid_x, bid_y]
        thr = tiled_copy.get_slice(tid)
        tA, tB, tC = thr.partition_S(gA), thr.partition_S(gB), thr.partition_D(gC)
        tCoord = thr.partition_S(cC)[(0, None), None, None]
        rA, rB, rC = fx.make_fragment_like(tA), fx.make_fragment_like(tB), fx.make_fragment_like(tC)
        pred = fx.make_fragment_like(tCoord, dtype=fx.Boolean)
        for i in range_constexpr(fx.size(pred.shape).unpack()):
            pred[i] = fx.elem_less(tCoord[i], (M, N))
        atom = fx.make_copy_atom(fx.UniversalCopy128b(), fx.Float32)
        fx.copy(atom, tA, rA, pred=pred)
        fx.copy(atom, tB, rB, pred=pred)
        rC.store(rA.load() + rB.load())
        fx.copy(atom, rC, tC, pred=pred)

    @flyc.jit
    def launch(A: fx.Tensor, B: fx.Tensor, C: fx.Tensor, stream: fx.Stream = fx.Stream(None)):
        atom = fx.make_copy_atom(fx.UniversalCopy128b(), fx.Float32)
        # 128 threads as 8 rows x 16 columns, each thread 1x4 floats: an 8x64 tile.
        tiled_copy = fx.make_tiled_copy_tv(
            atom, fx.make_ordered_layout((8, 16), order=(1, 0)), fx.make_ordered_layout((1, 4), order=(0, 1))
        )
        tile_m, tile_n = tiled_copy.tile_mn.unpack()
        M, N = A.shape.unpack()
        emu_vadd(A, B, C, tiled_copy).launch(
            grid=((M + tile_m - 1) // tile_m, (N + tile_n - 1) // tile_n, 1), block=(128, 1, 1), stream=stream
        )

    return launch


BLOCK_SUM_THREADS = 256  # 4 waves: the barrier has to order stores and loads across waves
BLOCK_SUM_STEPS = 8  # log2(BLOCK_SUM_THREADS) halvings


@functools.lru_cache(maxsize=None)
def block_sum(arch: str, barriers: bool = True):
    """out[b] = sum of x[b*256 : (b+1)*256] (f32) by a tree through LDS: at step s, thread
    t < s adds slot t + s into slot t, with a workgroup barrier after every step. The
    summation order is fixed, so the result is reproducible bit for bit on the host.
    barriers=False drops the barriers inside the tree: an LDS race between the waves."""

    @flyc.kernel(name="emu_block_sum_0" if barriers else "emu_block_sum_racy")
    def emu_block_sum(X: fx.Tensor, Out: fx.Tensor):
        tid = fx.thread_idx.x
        bid = fx.block_idx.x
        lds = fx.SharedAllocator().allocate(fx.Array[fx.Float32, BLOCK_SUM_THREADS]).peek()
        slots = lds.view(fx.make_layout(BLOCK_SUM_THREADS, 1))
        x = fx.memref_load(X, bid * BLOCK_SUM_THREADS + tid)
        fx.memref_store(x, slots, tid)
        gpu.barrier()
        for step in range_constexpr(BLOCK_SUM_STEPS):
            stride = BLOCK_SUM_THREADS >> (step + 1)
            if tid < stride:
                fx.memref_store(fx.memref_load(slots, tid) + fx.memref_load(slots, tid + stride), slots, tid)
            if const_expr(barriers):
                gpu.barrier()
        if tid == 0:
            fx.memref_store(fx.memref_load(slots, 0), Out, bid)

    @flyc.jit
    def launch(X: fx.Tensor, Out: fx.Tensor, blocks: fx.Constexpr[int], stream: fx.Stream = fx.Stream(None)):
        emu_block_sum(X, Out).launch(grid=(blocks, 1, 1), block=(BLOCK_SUM_THREADS, 1, 1), stream=stream)

    return launch


@functools.lru_cache(maxsize=None)
def lds_before_write(arch: str):
    """Out[b * 64 + t] = LDS slot t (a u32) of workgroup b, read before the workgroup writes it; then,
    when `write` is nonzero, slot t = t (an argument: the compiler cannot take LDS for never written
    and drop the read)."""

    @flyc.kernel
    def emu_lds_before_write(Out: fx.Tensor, write: fx.Int32):
        tid = fx.thread_idx.x
        lds = fx.SharedAllocator().allocate(fx.Array[fx.Int32, WAVE]).peek()
        slots = lds.view(fx.make_layout(WAVE, 1))
        fx.memref_store(fx.memref_load(slots, tid), Out, fx.block_idx.x * WAVE + tid)
        if write != 0:
            fx.memref_store(fx.Int32(tid), slots, tid)

    @flyc.jit
    def launch(Out: fx.Tensor, write: fx.Int32, blocks: fx.Constexpr[int], stream: fx.Stream = fx.Stream(None)):
        emu_lds_before_write(Out, write).launch(grid=(blocks, 1, 1), block=(WAVE, 1, 1), stream=stream)

    return launch


@functools.lru_cache(maxsize=None)
def last_block_id(arch: str):
    """Out[0] = the workgroup id, stored by every workgroup: with more than one, the stores race
    (which id remains depends on the order the workgroups run in)."""

    @flyc.kernel
    def emu_last_block_id(Out: fx.Tensor):
        if fx.thread_idx.x == 0:
            fx.memref_store(fx.Int32(fx.block_idx.x), Out, 0)

    @flyc.jit
    def launch(Out: fx.Tensor, blocks: fx.Constexpr[int], stream: fx.Stream = fx.Stream(None)):
        emu_last_block_id(Out).launch(grid=(blocks, 1, 1), block=(WAVE, 1, 1), stream=stream)

    return launch


SHUFFLE_XOR_MASK = 5  # lanes swap inside groups of 8 (bits 0 and 2): neither a DPP row nor a half
READLANE_LANE = 17  # an arbitrary lane in the second 16-lane row


@functools.lru_cache(maxsize=None)
def wave_shuffles(arch: str):
    """One wave of int32: out[0] = x[l ^ 5], out[1] = x[63 - l], out[2] = sum of the wave
    (butterfly of xor shuffles 32, 16, ..., 1), out[3] = x[17] on every lane (readlane).
    Integer sums are exact, so every lane of out[2] must hold the same total."""

    @flyc.kernel
    def emu_wave_shuffles(X: fx.Tensor, Out: fx.Tensor):
        lane = fx.thread_idx.x
        x = fx.memref_load(X, lane)
        fx.memref_store(gpu.shuffle_xor(x, SHUFFLE_XOR_MASK, WAVE), Out, lane)
        fx.memref_store(gpu.shuffle_idx(x, (WAVE - 1) - lane, WAVE), Out, WAVE + lane)
        total = x
        for step in range_constexpr(6):  # log2(WAVE) butterfly stages
            total = total + gpu.shuffle_xor(total, WAVE >> (step + 1), WAVE)
        fx.memref_store(total, Out, 2 * WAVE + lane)
        fx.memref_store(fx.rocdl.readlane(fx.Int32.ir_type, x, READLANE_LANE), Out, 3 * WAVE + lane)

    @flyc.jit
    def launch(X: fx.Tensor, Out: fx.Tensor, stream: fx.Stream = fx.Stream(None)):
        emu_wave_shuffles(X, Out).launch(grid=(1, 1, 1), block=(WAVE, 1, 1), stream=stream)

    return launch


MFMA_TILE = 32  # a 2x2 grid of 16x16 MFMA tiles, one per wave
# (m, n, k) of the MFMA instruction per (arch, dtype): f32 16x16x4 on both; bf16 16x16x16 on
# gfx942 and the gfx950-only 16x16x32 (the one flyquant's GEMM uses there).
MFMA_SHAPES = {
    ("gfx942", "f32"): (16, 16, 4),
    ("gfx950", "f32"): (16, 16, 4),
    ("gfx942", "bf16"): (16, 16, 16),
    ("gfx950", "bf16"): (16, 16, 32),
}


@functools.lru_cache(maxsize=None)
def mfma_tile(arch: str, dtype: str):
    """C (32x32 f32) = A (32xK) @ B (32xK)^T with MFMA, the K loop inside fx.gemm; operands
    come in through (sub-dword for bf16) buffer loads."""
    m, n, k = MFMA_SHAPES[arch, dtype]
    elem = {"f32": fx.Float32, "bf16": fx.BFloat16}[dtype]
    copy_op = {"f32": fx.rocdl.BufferCopy32b, "bf16": fx.rocdl.BufferCopy16b}[dtype]

    @flyc.kernel
    def emu_mfma_tile(A: fx.Tensor, B: fx.Tensor, C: fx.Tensor, K: fx.Constexpr[int]):
        tid = fx.thread_idx.x
        # The (only) tile of each operand, with a static shape the MMA partitioning needs.
        A = fx.slice(fx.zipped_divide(fx.rocdl.make_buffer_tensor(A), (MFMA_TILE, K)), (None, 0))
        B = fx.slice(fx.zipped_divide(fx.rocdl.make_buffer_tensor(B), (MFMA_TILE, K)), (None, 0))
        C = fx.slice(fx.zipped_divide(fx.rocdl.make_buffer_tensor(C), (MFMA_TILE, MFMA_TILE)), (None, 0))
        mma_atom = fx.make_mma_atom(fx.rocdl.MFMA(m, n, k, elem))
        tiled_mma = fx.make_tiled_mma(mma_atom, fx.make_layout((2, 2, 1), (1, 2, 0)))
        thr_mma = tiled_mma.thr_slice(tid)
        atom_ab = fx.make_copy_atom(copy_op(), elem)
        atom_c = fx.make_copy_atom(fx.rocdl.BufferCopy32b(), fx.Float32)
        copy_a = fx.make_tiled_copy_A(atom_ab, tiled_mma).get_slice(tid)
        copy_b = fx.make_tiled_copy_B(atom_ab, tiled_mma).get_slice(tid)
        copy_c = fx.make_tiled_copy_C(atom_c, tiled_mma).get_slice(tid)
        frag_a = thr_mma.make_fragment_A(A)
        frag_b = thr_mma.make_fragment_B(B)
        frag_c = thr_mma.make_fragment_C(C)
        fx.copy(atom_ab, copy_a.partition_S(A), copy_a.retile(frag_a), pred=None)
        fx.copy(atom_ab, copy_b.partition_S(B), copy_b.retile(frag_b), pred=None)
        frag_c.fill(0)
        fx.gemm(mma_atom, frag_c, frag_a, frag_b, frag_c)
        fx.copy(atom_c, copy_c.retile(frag_c), copy_c.partition_S(C), pred=None)

    @flyc.jit
    def launch(A: fx.Tensor, B: fx.Tensor, C: fx.Tensor, K: fx.Constexpr[int], stream: fx.Stream = fx.Stream(None)):
        emu_mfma_tile(A, B, C, K).launch(grid=(1, 1, 1), block=(4 * WAVE, 1, 1), stream=stream)

    return launch


TAIL_VEC = 4  # floats per thread: one 128-bit buffer load
TAIL_TILE = WAVE * TAIL_VEC  # floats per workgroup (one wave)


@functools.lru_cache(maxsize=None)
def buffer_tail(arch: str):
    """For each 256-float tile of X (N floats, the descriptor's num_records = 4N bytes), with no
    predicate anywhere: Raw[i] = X[i] (plain global stores into a tile-padded tensor) and
    Y[i] = X[i] + 1 through buffer stores. Past N the buffer loads must read 0 and the buffer
    stores must be dropped: the tail is correct only by the out-of-range rules."""

    @flyc.kernel
    def emu_buffer_tail(X: fx.Tensor, Y: fx.Tensor, Raw: fx.Tensor):
        tid = fx.thread_idx.x
        bid = fx.block_idx.x
        atom = fx.make_copy_atom(fx.rocdl.BufferCopy128b(), fx.Float32)
        x_vec = fx.logical_divide(fx.rocdl.make_buffer_tensor(X, max_size=False), fx.make_layout(TAIL_VEC, 1))
        y_vec = fx.logical_divide(fx.rocdl.make_buffer_tensor(Y, max_size=False), fx.make_layout(TAIL_VEC, 1))
        index = bid * WAVE + tid
        loaded = fx.make_rmem_tensor(TAIL_VEC, fx.Float32)
        fx.copy(atom, fx.slice(x_vec, (None, index)), loaded)
        values = fx.memref_load_vec(loaded)
        for i in range_constexpr(TAIL_VEC):
            fx.memref_store(values[i], Raw, index * TAIL_VEC + i)
        result = fx.make_rmem_tensor(TAIL_VEC, fx.Float32)
        fx.memref_store_vec(values + 1.0, result)
        fx.copy(atom, result, fx.slice(y_vec, (None, index)))

    @flyc.jit
    def launch(X: fx.Tensor, Y: fx.Tensor, Raw: fx.Tensor, tiles: fx.Constexpr[int], stream: fx.Stream = fx.Stream(None)):
        emu_buffer_tail(X, Y, Raw).launch(grid=(tiles, 1, 1), block=(WAVE, 1, 1), stream=stream)

    return launch


SCALED_MFMA_OPERAND_REGS = 8  # A and B of a scaled MFMA: 8 registers (fp4 uses the first 4)


@functools.lru_cache(maxsize=None)
def mfma_scale(m: int, cbsz: int, blgp: int, opsel_a: int, opsel_b: int):
    """One wave, one v_mfma_scale_f32_{16x16x128,32x32x64}_f8f6f4: D = scaled(A) scaled(B)^T + C
    (gfx950 only: build and call it under ``toolchain.target("gfx950")``).
    Every operand is a (registers, 64 lanes) row-major tensor of raw register words: A and B
    int32 (8, 64), scale A and scale B int32 (1, 64), C (in) and D (out, in place) f32
    (m * m / 64, 64). cbsz/blgp: the A/B formats; opsel_a/opsel_b: the scale byte (0..3)."""
    acc_regs = m * m // WAVE
    mfma = {16: rocdl.mfma_scale_f32_16x16x128_f8f6f4, 32: rocdl.mfma_scale_f32_32x32x64_f8f6f4}[m]

    @flyc.kernel
    def emu_mfma_scale(A: fx.Tensor, B: fx.Tensor, SA: fx.Tensor, SB: fx.Tensor, C: fx.Tensor):
        lane = fx.thread_idx.x

        def regs(t, n, dtype):
            return Vec.from_elements([fx.memref_load(t, r * WAVE + lane) for r in range_constexpr(n)], dtype)

        a = regs(A, SCALED_MFMA_OPERAND_REGS, fx.Int32)
        b = regs(B, SCALED_MFMA_OPERAND_REGS, fx.Int32)
        d = Vec(mfma(T.vec(acc_regs, T.f32), [a, b, regs(C, acc_regs, fx.Float32), cbsz, blgp,
                                               opsel_a, fx.memref_load(SA, lane), opsel_b, fx.memref_load(SB, lane)]))
        for r in range_constexpr(acc_regs):
            fx.memref_store(d[r], C, r * WAVE + lane)

    @flyc.jit
    def launch(A: fx.Tensor, B: fx.Tensor, SA: fx.Tensor, SB: fx.Tensor, C: fx.Tensor,
               stream: fx.Stream = fx.Stream(None)):
        emu_mfma_scale(A, B, SA, SB, C).launch(grid=(1, 1, 1), block=(WAVE, 1, 1), stream=stream)

    return launch
