"""Read an AMDGPU code object (the ELF FlyDSL links for gfx942/gfx950) into plain Python data.

What the emulator needs from the ELF, and where it lives (AMDGPU-Usage in LLVM's docs):

- the target, in ``e_flags`` bits 0-7 (EF_AMDGPU_MACH): 0x4c gfx942, 0x4f gfx950;
- the bytes of the loaded image, by virtual address (PT_LOAD program headers);
- each kernel's 64-byte kernel descriptor, the symbol ``<name>.kd``: LDS/scratch/kernarg sizes,
  where the code starts (byte 16, relative to the descriptor), COMPUTE_PGM_RSRC1/2/3 (bytes
  48/52/44: float modes, user SGPR count, enabled workgroup-id SGPRs and workitem-id VGPRs,
  accum_offset) and kernel_code_properties (byte 56: which user SGPRs are set up);
- the code object metadata, a MessagePack map in the NT_AMDGPU_METADATA note ("AMDGPU", 32):
  argument offsets/sizes/kinds and resource counts.

Only the subset of ELF and MessagePack that such code objects use is parsed; anything
unexpected is a ``CodeObjectError`` rather than a guess.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

# --- ELF constants (System V gABI + AMDGPU-Usage) -----------------------------------------------
ELF_MAGIC = b"\x7fELF"
ELFCLASS64 = 2
ELFDATA2LSB = 1
EM_AMDGPU = 224
PT_LOAD = 1
PT_NOTE = 4
SHT_SYMTAB = 2
SHT_DYNSYM = 11
EF_AMDGPU_MACH_MASK = 0x0FF
MACH_TO_ARCH = {0x04C: "gfx942", 0x04F: "gfx950"}
NT_AMDGPU_METADATA = 32
NOTE_NAME_AMDGPU = b"AMDGPU"

# --- Kernel descriptor layout (64 bytes, AMDGPU-Usage "Kernel Descriptor") ----------------------
KD_SIZE = 64
KD_SUFFIX = ".kd"
# group, private, kernarg sizes (u32 each), reserved, entry offset (i64), reserved 20 bytes,
# rsrc3, rsrc1, rsrc2 (u32 each), kernel_code_properties (u16), kernarg_preload (u16), reserved.
_KD_STRUCT = struct.Struct("<III4xq20xIIIHH4x")
assert _KD_STRUCT.size == KD_SIZE

# FLOAT_DENORM_MODE_* values in COMPUTE_PGM_RSRC1.
DENORM_FLUSH_SRC_DST = 0
DENORM_FLUSH_DST = 1
DENORM_FLUSH_SRC = 2
DENORM_FLUSH_NONE = 3

# kernel_code_properties bits, in the order the hardware loads the user SGPRs, with their size
# in SGPRs. The kernarg segment pointer is the one FlyDSL kernels use.
_USER_SGPRS = (
    (0, "private_segment_buffer", 4),
    (1, "dispatch_ptr", 2),
    (2, "queue_ptr", 2),
    (3, "kernarg_segment_ptr", 2),
    (4, "dispatch_id", 2),
    (5, "flat_scratch_init", 2),
    (6, "private_segment_size", 1),
)
KCP_WAVEFRONT_SIZE32 = 1 << 10
KCP_USES_DYNAMIC_STACK = 1 << 11


class CodeObjectError(ValueError):
    """The bytes are not a gfx942/gfx950 code object this emulator can read."""


def _bits(value: int, lo: int, hi: int) -> int:
    """Bits lo..hi (inclusive) of value."""
    return (value >> lo) & ((1 << (hi - lo + 1)) - 1)


@dataclass(frozen=True)
class KernelDescriptor:
    """The 64-byte ``<kernel>.kd`` record, raw fields plus the decoded bits the launcher needs."""

    group_segment_fixed_size: int
    private_segment_fixed_size: int
    kernarg_size: int
    kernel_code_entry_byte_offset: int
    compute_pgm_rsrc3: int  # fields in descriptor byte order: rsrc3 (44) precedes rsrc1 (48), rsrc2 (52)
    compute_pgm_rsrc1: int
    compute_pgm_rsrc2: int
    kernel_code_properties: int
    kernarg_preload: int

    # COMPUTE_PGM_RSRC1
    @property
    def float_round_mode_32(self) -> int:
        return _bits(self.compute_pgm_rsrc1, 12, 13)

    @property
    def float_round_mode_16_64(self) -> int:
        return _bits(self.compute_pgm_rsrc1, 14, 15)

    @property
    def float_denorm_mode_32(self) -> int:
        """DENORM_* value for f32: FlyDSL kernels use DENORM_FLUSH_NONE (3)."""
        return _bits(self.compute_pgm_rsrc1, 16, 17)

    @property
    def float_denorm_mode_16_64(self) -> int:
        return _bits(self.compute_pgm_rsrc1, 18, 19)

    @property
    def enable_dx10_clamp(self) -> bool:
        return bool(_bits(self.compute_pgm_rsrc1, 21, 21))

    @property
    def enable_ieee_mode(self) -> bool:
        return bool(_bits(self.compute_pgm_rsrc1, 23, 23))

    @property
    def fp16_overflow(self) -> bool:
        return bool(_bits(self.compute_pgm_rsrc1, 26, 26))

    # COMPUTE_PGM_RSRC2
    @property
    def enable_private_segment(self) -> bool:
        return bool(_bits(self.compute_pgm_rsrc2, 0, 0))

    @property
    def user_sgpr_count(self) -> int:
        return _bits(self.compute_pgm_rsrc2, 1, 5)

    @property
    def enable_sgpr_workgroup_id_x(self) -> bool:
        return bool(_bits(self.compute_pgm_rsrc2, 7, 7))

    @property
    def enable_sgpr_workgroup_id_y(self) -> bool:
        return bool(_bits(self.compute_pgm_rsrc2, 8, 8))

    @property
    def enable_sgpr_workgroup_id_z(self) -> bool:
        return bool(_bits(self.compute_pgm_rsrc2, 9, 9))

    @property
    def enable_sgpr_workgroup_info(self) -> bool:
        return bool(_bits(self.compute_pgm_rsrc2, 10, 10))

    @property
    def enable_vgpr_workitem_id(self) -> int:
        """0: only X in v0; 1: X, Y; 2: X, Y, Z (gfx90a+: packed 10 bits each into v0)."""
        return _bits(self.compute_pgm_rsrc2, 11, 12)

    @property
    def granulated_lds_size(self) -> int:
        return _bits(self.compute_pgm_rsrc2, 15, 23)

    # COMPUTE_PGM_RSRC3 (gfx90a and later)
    @property
    def accum_offset(self) -> int:
        """First AGPR-backed register index of the unified file: (ACCUM_OFFSET + 1) * 4."""
        return (_bits(self.compute_pgm_rsrc3, 0, 5) + 1) * 4

    @property
    def tg_split(self) -> bool:
        return bool(_bits(self.compute_pgm_rsrc3, 16, 16))

    # kernel_code_properties
    def _kcp(self, bit: int) -> bool:
        return bool(self.kernel_code_properties >> bit & 1)

    @property
    def enable_sgpr_private_segment_buffer(self) -> bool:
        return self._kcp(0)

    @property
    def enable_sgpr_dispatch_ptr(self) -> bool:
        return self._kcp(1)

    @property
    def enable_sgpr_queue_ptr(self) -> bool:
        return self._kcp(2)

    @property
    def enable_sgpr_kernarg_segment_ptr(self) -> bool:
        return self._kcp(3)

    @property
    def enable_sgpr_dispatch_id(self) -> bool:
        return self._kcp(4)

    @property
    def enable_sgpr_flat_scratch_init(self) -> bool:
        return self._kcp(5)

    @property
    def enable_sgpr_private_segment_size(self) -> bool:
        return self._kcp(6)

    @property
    def wavefront_size32(self) -> bool:
        return bool(self.kernel_code_properties & KCP_WAVEFRONT_SIZE32)

    @property
    def uses_dynamic_stack(self) -> bool:
        return bool(self.kernel_code_properties & KCP_USES_DYNAMIC_STACK)

    @property
    def kernarg_preload_length(self) -> int:
        """Kernarg dwords preloaded into SGPRs after the user SGPRs (gfx940+)."""
        return _bits(self.kernarg_preload, 0, 6)

    @property
    def kernarg_preload_offset(self) -> int:
        """Dword offset in the kernarg segment of the first preloaded dword."""
        return _bits(self.kernarg_preload, 7, 15)

    def sgpr_layout(self) -> dict[str, int]:
        """Initial SGPR index of every value the hardware sets up before the first instruction.

        User SGPRs come first in kernel_code_properties bit order, then the preloaded kernarg
        dwords ("kernarg_preload", its first SGPR), then the system SGPRs (workgroup ids x/y/z,
        workgroup info, private segment wave offset), each only if enabled.
        """
        layout: dict[str, int] = {}
        sgpr = 0
        for bit, name, size in _USER_SGPRS:
            if self._kcp(bit):
                layout[name] = sgpr
                sgpr += size
        if self.kernarg_preload_length:
            layout["kernarg_preload"] = sgpr
            sgpr += self.kernarg_preload_length
        if sgpr != self.user_sgpr_count:
            raise CodeObjectError(
                f"kernel descriptor enables {sgpr} user SGPRs but USER_SGPR_COUNT is {self.user_sgpr_count}"
            )
        for enabled, name in (
            (self.enable_sgpr_workgroup_id_x, "workgroup_id_x"),
            (self.enable_sgpr_workgroup_id_y, "workgroup_id_y"),
            (self.enable_sgpr_workgroup_id_z, "workgroup_id_z"),
            (self.enable_sgpr_workgroup_info, "workgroup_info"),
            (self.enable_private_segment, "private_segment_wave_offset"),
        ):
            if enabled:
                layout[name] = sgpr
                sgpr += 1
        return layout


@dataclass(frozen=True)
class KernelArg:
    """One entry of the metadata's ``.args``: where HIP writes the argument in the kernarg segment."""

    offset: int
    size: int
    value_kind: str  # global_buffer, by_value, hidden_block_count_x, ...
    address_space: str | None = None
    name: str | None = None


@dataclass(frozen=True)
class KernelInfo:
    """One kernel of a code object: descriptor, entry address and metadata."""

    name: str
    kd_vaddr: int
    entry: int  # vaddr of the first instruction: kd vaddr + kernel_code_entry_byte_offset
    kd: KernelDescriptor
    args: tuple[KernelArg, ...]
    kernarg_segment_size: int
    kernarg_segment_align: int
    group_segment_fixed_size: int
    private_segment_fixed_size: int
    vgpr_count: int
    agpr_count: int
    sgpr_count: int
    vgpr_spill_count: int
    sgpr_spill_count: int
    wavefront_size: int
    max_flat_workgroup_size: int
    metadata: dict = field(repr=False)  # the kernel's full metadata map, for anything not above


@dataclass(frozen=True)
class CodeObject:
    """A parsed code object. ``read(vaddr, n)`` gives loaded bytes; NOBITS tails read as zero."""

    arch: str
    image: bytes
    kernels: dict[str, KernelInfo]
    symbols: dict[str, int] = field(repr=False)  # symbol name -> value (vaddr), .symtab and .dynsym
    metadata: dict = field(repr=False)
    segments: tuple[tuple[int, int, int, int], ...] = field(repr=False)  # (vaddr, memsz, offset, filesz)

    def read(self, vaddr: int, n: int) -> bytes:
        """`n` bytes of the loaded image at virtual address `vaddr` (within one PT_LOAD segment)."""
        for seg_vaddr, memsz, offset, filesz in self.segments:
            if seg_vaddr <= vaddr and vaddr + n <= seg_vaddr + memsz:
                rel = vaddr - seg_vaddr
                data = self.image[offset + min(rel, filesz) : offset + min(rel + n, filesz)]
                return data + bytes(n - len(data))
        raise CodeObjectError(f"address range [{vaddr:#x}, {vaddr + n:#x}) is not in any loaded segment")


# --- MessagePack (the subset the AMDGPU metadata uses: maps, arrays, strings, ints, bools) -------


def _msgpack(data: bytes, pos: int = 0):
    """Decode one MessagePack value at `pos`; returns (value, next position)."""
    b = data[pos]
    pos += 1
    if b <= 0x7F:
        return b, pos
    if b >= 0xE0:
        return b - 0x100, pos
    if 0x80 <= b <= 0x8F:
        return _msgpack_map(data, pos, b & 0x0F)
    if 0x90 <= b <= 0x9F:
        return _msgpack_array(data, pos, b & 0x0F)
    if 0xA0 <= b <= 0xBF:
        n = b & 0x1F
        return data[pos : pos + n].decode(), pos + n
    fixed = {
        0xC0: None,
        0xC2: False,
        0xC3: True,
    }
    if b in fixed:
        return fixed[b], pos
    ints = {0xCC: "<B", 0xCD: ">H", 0xCE: ">I", 0xCF: ">Q", 0xD0: "b", 0xD1: ">h", 0xD2: ">i", 0xD3: ">q"}
    if b in ints:
        fmt = ints[b]
        size = struct.calcsize(fmt)
        return struct.unpack_from(fmt, data, pos)[0], pos + size
    if b in (0xCA, 0xCB):
        fmt = ">f" if b == 0xCA else ">d"
        return struct.unpack_from(fmt, data, pos)[0], pos + struct.calcsize(fmt)
    lengths = {0xD9: ">B", 0xDA: ">H", 0xDB: ">I", 0xC4: ">B", 0xC5: ">H", 0xC6: ">I"}
    if b in lengths:
        fmt = lengths[b]
        n = struct.unpack_from(fmt, data, pos)[0]
        pos += struct.calcsize(fmt)
        raw = data[pos : pos + n]
        return (raw.decode() if b >= 0xD9 else bytes(raw)), pos + n
    if b in (0xDC, 0xDD):
        fmt = ">H" if b == 0xDC else ">I"
        n = struct.unpack_from(fmt, data, pos)[0]
        return _msgpack_array(data, pos + struct.calcsize(fmt), n)
    if b in (0xDE, 0xDF):
        fmt = ">H" if b == 0xDE else ">I"
        n = struct.unpack_from(fmt, data, pos)[0]
        return _msgpack_map(data, pos + struct.calcsize(fmt), n)
    raise CodeObjectError(f"unsupported MessagePack type byte {b:#04x} in the code object metadata")


def _msgpack_array(data: bytes, pos: int, n: int):
    out = []
    for _ in range(n):
        value, pos = _msgpack(data, pos)
        out.append(value)
    return out, pos


def _msgpack_map(data: bytes, pos: int, n: int):
    out = {}
    for _ in range(n):
        key, pos = _msgpack(data, pos)
        value, pos = _msgpack(data, pos)
        out[key] = value
    return out, pos


# --- ELF ----------------------------------------------------------------------------------------

_EHDR = struct.Struct("<16sHHIQQQIHHHHHH")
_PHDR = struct.Struct("<IIQQQQQQ")
_SHDR = struct.Struct("<IIQQQQIIQQ")
_SYM = struct.Struct("<IBBHQQ")


def image_size(header: bytes) -> int:
    """Total file size of an ELF64 image from its 64-byte header: the section header table ends it.

    (The HIP stand-in computes the same from the header to know how many bytes
    ``hipModuleLoadData`` was given; lld writes the section headers last.)
    """
    if len(header) < _EHDR.size or header[:4] != ELF_MAGIC:
        raise CodeObjectError("not an ELF image")
    _, _, _, _, _, phoff, shoff, _, _, phentsize, phnum, shentsize, shnum, _ = _EHDR.unpack_from(header)
    return max(phoff + phentsize * phnum, shoff + shentsize * shnum)


def _cstr(table: bytes, offset: int) -> str:
    end = table.index(b"\0", offset)
    return table[offset:end].decode()


def _notes(image: bytes, offset: int, size: int):
    """Yield (name, type, desc) of the ELF notes in image[offset:offset+size] (4-byte aligned)."""
    pos, end = offset, offset + size
    while pos + 12 <= end:
        namesz, descsz, ntype = struct.unpack_from("<III", image, pos)
        pos += 12
        name = image[pos : pos + namesz].rstrip(b"\0")
        pos += (namesz + 3) & ~3
        desc = image[pos : pos + descsz]
        pos += (descsz + 3) & ~3
        yield name, ntype, desc


def _kernel_info(meta: dict, symbols: dict[str, int], co_read) -> KernelInfo:
    name = meta[".name"]
    symbol = meta.get(".symbol", name + KD_SUFFIX)
    if symbol not in symbols:
        raise CodeObjectError(f"kernel {name!r}: descriptor symbol {symbol!r} not in the symbol table")
    kd_vaddr = symbols[symbol]
    kd = KernelDescriptor(*_KD_STRUCT.unpack(co_read(kd_vaddr, KD_SIZE)))
    rsrc = dict(
        group_segment_fixed_size=kd.group_segment_fixed_size,
        private_segment_fixed_size=kd.private_segment_fixed_size,
        kernarg_segment_size=kd.kernarg_size,
    )
    for key, value in rsrc.items():
        if meta.get("." + key, value) != value:
            raise CodeObjectError(f"kernel {name!r}: metadata {key} {meta['.' + key]} != descriptor {value}")
    if kd.wavefront_size32 or meta.get(".wavefront_size", 64) != 64:
        raise CodeObjectError(f"kernel {name!r} is wave32; gfx942/gfx950 kernels run in wave64")
    args = tuple(
        KernelArg(
            offset=a[".offset"],
            size=a[".size"],
            value_kind=a[".value_kind"],
            address_space=a.get(".address_space"),
            name=a.get(".name"),
        )
        for a in meta.get(".args", [])
    )
    return KernelInfo(
        name=name,
        kd_vaddr=kd_vaddr,
        entry=kd_vaddr + kd.kernel_code_entry_byte_offset,
        kd=kd,
        args=args,
        kernarg_segment_size=kd.kernarg_size,
        kernarg_segment_align=meta.get(".kernarg_segment_align", 8),
        group_segment_fixed_size=kd.group_segment_fixed_size,
        private_segment_fixed_size=kd.private_segment_fixed_size,
        vgpr_count=meta.get(".vgpr_count", 0),
        agpr_count=meta.get(".agpr_count", 0),
        sgpr_count=meta.get(".sgpr_count", 0),
        vgpr_spill_count=meta.get(".vgpr_spill_count", 0),
        sgpr_spill_count=meta.get(".sgpr_spill_count", 0),
        wavefront_size=meta.get(".wavefront_size", 64),
        max_flat_workgroup_size=meta.get(".max_flat_workgroup_size", 1024),
        metadata=meta,
    )


def load(image: bytes) -> CodeObject:
    """Parse a gfx942/gfx950 code object; raises CodeObjectError on anything else."""
    image = bytes(image)
    if len(image) < _EHDR.size or image[:4] != ELF_MAGIC:
        raise CodeObjectError("not an ELF image (bad magic)")
    ident, _etype, machine, _ver, _entry, phoff, shoff, eflags, _ehsize, phentsize, phnum, shentsize, shnum, _ = (
        _EHDR.unpack_from(image)
    )
    if ident[4] != ELFCLASS64 or ident[5] != ELFDATA2LSB or machine != EM_AMDGPU:
        raise CodeObjectError(f"not a little-endian ELF64 AMDGPU code object (e_machine {machine})")
    mach = eflags & EF_AMDGPU_MACH_MASK
    arch = MACH_TO_ARCH.get(mach)
    if arch is None:
        raise CodeObjectError(
            f"code object targets EF_AMDGPU_MACH {mach:#x}; the emulator runs gfx942 (0x4c) and gfx950 (0x4f) only"
        )
    if image_size(image) > len(image):
        raise CodeObjectError(f"truncated ELF image: {len(image)} bytes, headers describe {image_size(image)}")

    segments = []
    metadata = None
    for i in range(phnum):
        ptype, _flags, offset, vaddr, _paddr, filesz, memsz, _align = _PHDR.unpack_from(image, phoff + i * phentsize)
        if ptype == PT_LOAD:
            segments.append((vaddr, memsz, offset, filesz))
        elif ptype == PT_NOTE:
            for name, ntype, desc in _notes(image, offset, filesz):
                if name == NOTE_NAME_AMDGPU and ntype == NT_AMDGPU_METADATA:
                    metadata, _ = _msgpack(desc)
    if metadata is None:
        raise CodeObjectError("code object has no NT_AMDGPU_METADATA note (code object v3+ expected)")

    sections = [_SHDR.unpack_from(image, shoff + i * shentsize) for i in range(shnum)]
    symbols: dict[str, int] = {}
    for _name, shtype, _flags, _addr, offset, size, link, _info, _align, entsize in sections:
        if shtype not in (SHT_SYMTAB, SHT_DYNSYM):
            continue
        strtab_off, strtab_size = sections[link][4], sections[link][5]
        strtab = image[strtab_off : strtab_off + strtab_size]
        for pos in range(offset, offset + size, entsize or _SYM.size):
            st_name, _info, _other, _shndx, value, _size = _SYM.unpack_from(image, pos)
            if st_name:
                symbols.setdefault(_cstr(strtab, st_name), value)

    co = CodeObject(arch=arch, image=image, kernels={}, symbols=symbols, metadata=metadata, segments=tuple(segments))
    for meta in metadata.get("amdhsa.kernels", []):
        info = _kernel_info(meta, symbols, co.read)
        co.kernels[info.name] = info
    return co


__all__ = [
    "CodeObject",
    "CodeObjectError",
    "KernelArg",
    "KernelDescriptor",
    "KernelInfo",
    "DENORM_FLUSH_NONE",
    "DENORM_FLUSH_SRC_DST",
    "DENORM_FLUSH_DST",
    "DENORM_FLUSH_SRC",
    "image_size",
    "load",
]
