"""Read AMD GPU code objects (AMDGPU ELF) without ROCm: target, wave size, symbols.

Why: CI has no AMD GPU, so the proof that csrc/ builds for the R9700 (gfx1201) and Strix Halo
(gfx1151) is the code object itself. A wrong target, a wave64 kernel (RDNA runs wave32 natively;
wave64 halves occupancy for this copy) or a call left unresolved into a device library that
has no build for these chips would each load fine on the build machine and fail on the box.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path

EM_AMDGPU = 224
EF_AMDGPU_MACH = 0xFF
# EF_AMDGPU_MACH_AMDGCN_* values (LLVM's ELF.h)
MACH = {"gfx1150": 0x43, "gfx1151": 0x4A, "gfx1152": 0x55, "gfx1200": 0x48, "gfx1201": 0x4E,
        "gfx942": 0x4C, "gfx1100": 0x41}
NT_AMDGPU_METADATA = 32
KD_SIZE = 64
KD_CODE_PROPERTIES = 56          # u16 kernel_code_properties in the kernel descriptor
KD_WAVEFRONT_SIZE32 = 1 << 10    # ENABLE_WAVEFRONT_SIZE32


@dataclass
class Kernel:
    name: str
    wave32_descriptor: bool
    wavefront_size: int | None     # from the metadata note
    vgpr_count: int | None
    sgpr_count: int | None
    private_segment_bytes: int | None


@dataclass
class CodeObject:
    machine: int
    flags: int
    target: str | None
    kernels: list[Kernel] = field(default_factory=list)
    undefined: list[str] = field(default_factory=list)


def _cstr(buf: bytes, off: int) -> str:
    end = buf.index(b"\0", off)
    return buf[off:end].decode()


def read(path: Path) -> CodeObject:
    """Parse the ELF header, symbol tables, kernel descriptors and the metadata note."""
    data = Path(path).read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2:
        raise ValueError(f"{path} is not a 64-bit ELF file")
    (_, machine, _, _, _, shoff, flags, _, _, _, shentsize, shnum, _) = struct.unpack_from(
        "<HHIQQQIHHHHHH", data, 16)
    secs = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    # (name, type, flags, addr, offset, size, link, info, addralign, entsize)
    mach = flags & EF_AMDGPU_MACH
    target = next((k for k, v in MACH.items() if v == mach), None)
    co = CodeObject(machine=machine, flags=flags, target=target)

    def file_offset(addr: int) -> int | None:
        for s in secs:
            if s[1] != 8 and s[3] <= addr < s[3] + s[5]:  # not NOBITS
                return s[4] + addr - s[3]
        return None

    meta: dict[str, dict] = {}
    for s in secs:
        if s[1] != 7:  # SHT_NOTE
            continue
        off, end = s[4], s[4] + s[5]
        while off + 12 <= end:
            namesz, descsz, ntype = struct.unpack_from("<III", data, off)
            name = data[off + 12: off + 12 + namesz].rstrip(b"\0")
            doff = off + 12 + ((namesz + 3) & ~3)
            if name == b"AMDGPU" and ntype == NT_AMDGPU_METADATA:
                import msgspec

                doc = msgspec.msgpack.decode(data[doff: doff + descsz])
                for k in doc.get("amdhsa.kernels", []):
                    meta[k.get(".name", "")] = k
            off = doff + ((descsz + 3) & ~3)

    seen: set[str] = set()
    for s in secs:
        if s[1] not in (2, 11):  # SYMTAB, DYNSYM
            continue
        strtab = secs[s[6]]
        strs = data[strtab[4]: strtab[4] + strtab[5]]
        for i in range(1, s[5] // 24):
            st_name, _, _, shndx, value, _ = struct.unpack_from(
                "<IBBHQQ", data, s[4] + i * 24)
            name = _cstr(strs, st_name)
            if shndx == 0 and name:
                if name not in co.undefined:
                    co.undefined.append(name)
                continue
            if name.endswith(".kd") and name not in seen:
                seen.add(name)
                off = file_offset(value)
                props = (struct.unpack_from("<H", data, off + KD_CODE_PROPERTIES)[0]
                         if off is not None else 0)
                kname = name[:-3]
                m = meta.get(kname, {})
                co.kernels.append(Kernel(
                    name=kname, wave32_descriptor=bool(props & KD_WAVEFRONT_SIZE32),
                    wavefront_size=m.get(".wavefront_size"), vgpr_count=m.get(".vgpr_count"),
                    sgpr_count=m.get(".sgpr_count"),
                    private_segment_bytes=m.get(".private_segment_fixed_size")))
    return co


def check(path: Path, target: str, kernels: tuple[str, ...] = ()) -> list[str]:
    """Problems that would stop the code object from running well on ``target`` (empty: ok)."""
    co = read(path)
    problems: list[str] = []
    if co.machine != EM_AMDGPU:
        problems.append(f"e_machine {co.machine}, not EM_AMDGPU")
    if co.flags & EF_AMDGPU_MACH != MACH[target]:
        problems.append(f"e_flags mach 0x{co.flags & EF_AMDGPU_MACH:x} is {co.target}, "
                        f"not {target} (0x{MACH[target]:x})")
    if not co.kernels:
        problems.append("no kernels")
    for k in co.kernels:
        if not k.wave32_descriptor or k.wavefront_size != 32:
            problems.append(f"{k.name} is not wave32 (descriptor bit {k.wave32_descriptor}, "
                            f"metadata wavefront_size {k.wavefront_size})")
    missing = set(kernels) - {k.name for k in co.kernels}
    if missing:
        problems.append(f"kernels missing: {sorted(missing)}")
    if co.undefined:
        problems.append(f"unresolved symbols: {co.undefined}")
    return problems
