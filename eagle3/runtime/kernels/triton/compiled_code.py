"""What a compiled Triton kernel uses, read from its machine code with no GPU: registers, spills,
shared memory / LDS, and the widths of its global loads (``aot_check --table``; docs/kernels.md).

NVIDIA (a cubin for sm_90a): ``cuobjdump -res-usage`` gives the registers per thread, the stack
frame and shared memory, ``cuobjdump -lelf`` the architecture; ``nvdisasm`` the instructions (of
many cubins in one run: :func:`nvidia_resources_many`), from which the spill stores / loads
(``STL`` / ``LDL``, in bytes by their width), the global loads by width (``LDG.E.128`` 16 B per
thread, ``.64``, plain ``LDG.E`` 4 B, ``.U16`` / ``.U8`` narrower), the asynchronous global ->
shared copies (``LDGSTS``, the bulk tensor copy ``UTMALDG``) and the matrix instructions
(``HGMMA`` = Hopper's wgmma, ``HMMA`` / ``IMMA`` the older warp-level ones) are counted. Both tools
ship inside the triton wheel (``triton/backends/nvidia/bin``). A load's width is per thread: a warp's 32
threads at 128 bits read 512 contiguous bytes in one instruction, at 16 bits 64.

AMD (AMDGCN assembly for gfx942 / gfx950): the code object's metadata gives ``.vgpr_count``,
``.agpr_count``, ``.sgpr_count``, ``.vgpr_spill_count`` (VGPRs spilled to scratch memory),
``.sgpr_spill_count`` (SGPRs spilled into VGPR lanes: no memory traffic unless scratch is used too),
``.group_segment_fixed_size`` (LDS) and ``.private_segment_fixed_size`` (scratch); the instructions
the ``global_load_*`` / ``buffer_load_*`` widths (``dwordx4`` = 16 B per lane, ...), the loads
straight into LDS (``global_load_lds_*``) and ``v_mfma`` / ``v_smfmac`` matrix instructions.

Counts are of instructions in the code (static), not of executions: a load in a loop counts once.
"""

from __future__ import annotations

import bisect
import re
import struct
import subprocess
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

WIDTHS = ("128", "96", "64", "32", "narrow")  # bits per thread / lane; narrow: 16 and 8
_SASS_LINE = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)")
_SASS_WIDTH = {"128": 128, "64": 64, "U16": 16, "S16": 16, "U8": 8, "S8": 8}
_RES = re.compile(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)")
_GCN_LOAD = re.compile(r"^\s*(global|buffer)_load_(lds_)?([a-z0-9_]+)\b")
_GCN_WIDTH = {"dwordx4": 128, "dwordx3": 96, "dwordx2": 64, "dword": 32, "b128": 128, "b96": 96, "b64": 64,
              "b32": 32}
_GCN_META = re.compile(r"^\s*(?:-\s+)?\.(vgpr_count|agpr_count|sgpr_count|vgpr_spill_count|sgpr_spill_count|"
                       r"group_segment_fixed_size|private_segment_fixed_size):\s+(\d+)", re.M)
_GCN_OCC = re.compile(r"^; Occupancy: (\d+)", re.M)


class ToolError(RuntimeError):
    """A disassembler that ships with triton is missing or failed (the message names it)."""


@dataclass
class Resources:
    """One kernel as compiled for one target. NVIDIA fills the ``spill_*_bytes`` fields, AMD the
    ``*_spills`` (registers) and ``agprs`` / ``sgprs`` / ``occupancy`` fields; None = not reported."""

    arch: str  # what the code is for, read from the code: "sm_90a", "gfx942"
    registers: int  # per thread (NVIDIA) / architectural VGPRs per lane (AMD)
    shared_bytes: int  # shared memory / LDS per program: what triton launches it with (its metadata)
    static_shared_bytes: int  # what the code object states (NVIDIA: the static part only, sm90's 1 KiB reserve)
    scratch_bytes: int  # stack frame / local memory (NVIDIA), private segment (AMD), per thread
    loads: dict[str, int]  # global loads by width in bits ("128", "96", "64", "32", "narrow"), async ones too
    async_loads: int  # of which global -> shared copies (LDGSTS; AMD's loads into LDS), + bulk UTMALDG copies
    mma: dict[str, int]  # matrix instructions by mnemonic (HGMMA, HMMA, IMMA, QGMMA / v_mfma_*)
    spill_store_bytes: int | None = None
    spill_load_bytes: int | None = None
    vgpr_spills: int | None = None
    sgpr_spills: int | None = None
    agprs: int | None = None
    sgprs: int | None = None
    occupancy: int | None = None  # waves per SIMD (AMD's compiler note)
    stores: dict[str, int] = field(default_factory=dict)  # global stores by width, as ``loads``

    @property
    def spills(self) -> bool:
        """Whether registers spill to memory: NVIDIA's spill stores / loads (local memory), AMD's
        VGPR spills or any scratch (SGPR spills alone go to VGPR lanes, not memory)."""
        if self.spill_store_bytes is not None:
            return bool(self.spill_store_bytes or self.spill_load_bytes)
        return bool(self.vgpr_spills or self.scratch_bytes)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "spills": self.spills}


def _empty_widths() -> dict[str, int]:
    return dict.fromkeys(WIDTHS, 0)


def _bucket(bits: int) -> str:
    return str(bits) if bits >= 32 else "narrow"


# ---------------------------------------------------------------------------------------------
# NVIDIA
# ---------------------------------------------------------------------------------------------


def nvidia_tool(name: str) -> Path:
    """``cuobjdump`` / ``nvdisasm`` as shipped in the triton wheel."""
    from triton.backends.nvidia import compiler

    path = Path(compiler.__file__).parent / "bin" / name
    if not path.is_file():
        raise ToolError(f"{path}: not found (the triton wheel ships it; reinstall triton)")
    return path


def _run(cmd: list[str]) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise ToolError(f"{Path(cmd[0]).name} failed ({proc.returncode}): {proc.stderr.strip()[:300]}")
    return proc.stdout


def parse_sass(sass: str) -> dict[str, Any]:
    """Counts from ``cuobjdump -sass`` text: loads / stores by width, async copies, spills, MMAs."""
    loads, stores, mma = _empty_widths(), _empty_widths(), {}
    async_loads = spill_st = spill_ld = 0
    arch = ""
    for line in sass.splitlines():
        if arch == "" and line.strip().startswith("code for sm_"):
            arch = line.split()[-1]
        m = _SASS_LINE.match(line)
        if m is None:
            continue
        parts = m.group(1).split(".")
        op, mods = parts[0], parts[1:]
        bits = next((_SASS_WIDTH[t] for t in reversed(mods) if t in _SASS_WIDTH), 32)
        if op in ("LDG", "LDGSTS"):
            loads[_bucket(bits)] += 1
            async_loads += op == "LDGSTS"
        elif op == "STG":
            stores[_bucket(bits)] += 1
        elif op in ("UTMALDG", "UBLKCP"):  # bulk copies: no per-thread width
            async_loads += 1
        elif op == "STL":
            spill_st += bits // 8
        elif op == "LDL":
            spill_ld += bits // 8
        elif op in ("HGMMA", "HMMA", "IMMA", "QGMMA", "IGMMA", "BGMMA"):
            mma[op] = mma.get(op, 0) + 1
    return {"arch": arch, "loads": loads, "stores": stores, "async_loads": async_loads,
            "spill_store_bytes": spill_st, "spill_load_bytes": spill_ld, "mma": mma}


def parse_res_usage(text: str) -> dict[str, int]:
    """``cuobjdump -res-usage``: registers per thread, stack frame, shared and local bytes."""
    m = _RES.search(text)
    if m is None:
        raise ToolError(f"cuobjdump -res-usage: no resource line in {text.strip()[:200]!r}")
    reg, stack, shared, local = (int(g) for g in m.groups())
    return {"registers": reg, "stack": stack, "shared_bytes": shared, "local": local}


_LELF = re.compile(r"\.(sm_\w+)\.cubin\s*$", re.M)  # cuobjdump -lelf: "ELF file 1: name.sm_90a.cubin"
_SASS_OFFSET = re.compile(r"^\s*/\*([0-9a-f]+)\*/")


def cubin_text(cubin: bytes) -> bytes:
    """The machine code of a cubin: its ``.text.<function>`` sections (a kernel and any function it
    calls), in file order, read from the ELF64 section headers."""
    if cubin[:4] != b"\x7fELF" or cubin[4] != 2 or cubin[5] != 1:
        raise ToolError("cubin: not a little-endian ELF64 file")
    (shoff,) = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    headers = [struct.unpack_from("<IIQQQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    names = headers[shstrndx][4]  # the section-name string table's file offset

    def name(h: tuple[int, ...]) -> bytes:
        return cubin[names + h[0]:cubin.index(b"\0", names + h[0])]
    return b"".join(cubin[h[4]:h[4] + h[5]] for h in headers if name(h).startswith(b".text."))


def split_sass(sass: str, spans: list[tuple[int, int]]) -> list[str]:
    """The lines of one ``nvdisasm --binary`` run over concatenated code, back to their pieces: a
    line belongs to the (offset, size) span its ``/*offset*/`` falls in (lines outside any span,
    labels and headers, are dropped)."""
    starts = [s for s, _ in spans]
    out: list[list[str]] = [[] for _ in spans]
    for line in sass.splitlines():
        m = _SASS_OFFSET.match(line)
        if m is None:
            continue
        off = int(m.group(1), 16)
        i = bisect.bisect_right(starts, off) - 1
        if i >= 0 and off < spans[i][0] + spans[i][1]:
            out[i].append(line)
    return ["\n".join(lines) for lines in out]


def nvidia_resources_many(cubins: list[bytes]) -> list[Resources]:
    """Resources of each cubin, read with the triton wheel's ``cuobjdump`` (registers, stack and
    shared memory: ``-res-usage``; the architecture: ``-lelf``) and ``nvdisasm``. nvdisasm's start-up
    costs about 0.3-0.5 s of CPU, far more than disassembling a kernel, so the code of all the
    cubins of one architecture is disassembled in one ``nvdisasm --binary`` run (raw instructions,
    concatenated) and split back by offset: the instructions, hence every count, are those
    ``cuobjdump -sass`` prints for each cubin on its own."""
    cuobjdump, nvdisasm = str(nvidia_tool("cuobjdump")), str(nvidia_tool("nvdisasm"))
    usage, archs = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i, cubin in enumerate(cubins):
            path = Path(tmp) / f"kernel{i}.cubin"
            path.write_bytes(cubin)
            usage.append(parse_res_usage(_run([cuobjdump, "-res-usage", str(path)])))
            m = _LELF.search(_run([cuobjdump, "-lelf", str(path)]))
            if m is None:
                raise ToolError(f"cuobjdump -lelf: no sm_ architecture for kernel {i}")
            archs.append(m.group(1))
        sass = [""] * len(cubins)
        for arch in dict.fromkeys(archs):
            mine = [i for i, a in enumerate(archs) if a == arch]
            texts = [cubin_text(cubins[i]) for i in mine]
            starts = [sum(len(t) for t in texts[:j]) for j in range(len(texts))]
            raw = Path(tmp) / f"{arch}.bin"
            raw.write_bytes(b"".join(texts))
            # -novliw: as cuobjdump -sass runs it
            text = _run([nvdisasm, "--binary", "SM" + arch[3:], "-novliw", str(raw)])
            parts = split_sass(text, [(s, len(t)) for s, t in zip(starts, texts, strict=True)])
            for i, part in zip(mine, parts, strict=True):
                sass[i] = part
    out = []
    for res, arch, text in zip(usage, archs, sass, strict=True):
        counts = parse_sass(text)
        out.append(Resources(arch=arch, registers=res["registers"], shared_bytes=res["shared_bytes"],
                             static_shared_bytes=res["shared_bytes"], scratch_bytes=max(res["stack"], res["local"]),
                             loads=counts["loads"], stores=counts["stores"], async_loads=counts["async_loads"],
                             mma=counts["mma"], spill_store_bytes=counts["spill_store_bytes"],
                             spill_load_bytes=counts["spill_load_bytes"]))
    return out


# ---------------------------------------------------------------------------------------------
# AMD
# ---------------------------------------------------------------------------------------------


def amd_resources(amdgcn: str, arch: str) -> Resources:
    """Resources of one kernel's AMDGCN assembly (its code-object metadata and instructions)."""
    meta: dict[str, int] = {}
    for key, val in _GCN_META.findall(amdgcn):
        meta.setdefault(key, int(val))  # the kernel's own entry comes first
    missing = [k for k in ("vgpr_count", "sgpr_count", "group_segment_fixed_size") if k not in meta]
    if missing:
        raise ToolError(f"AMDGCN for {arch}: no {', '.join(missing)} in the code-object metadata")
    loads, stores, mma = _empty_widths(), _empty_widths(), {}
    async_loads = 0
    for line in amdgcn.splitlines():
        s = line.strip()
        if not s or s[0] in ".;":
            continue
        m = _GCN_LOAD.match(s)
        if m is not None:
            async_loads += bool(m.group(2))
            suffix = m.group(3)
            bits = _GCN_WIDTH.get(suffix.split("_")[0], 16 if "short" in suffix or "16" in suffix else 8)
            loads[_bucket(bits)] += 1
            continue
        op = s.split()[0]
        if op.startswith(("global_store_", "buffer_store_")):
            stores[_bucket(_GCN_WIDTH.get(op.split("_")[2], 16 if "short" in op else 8))] += 1
        elif op.startswith(("v_mfma", "v_smfmac")):
            mma[op] = mma.get(op, 0) + 1
    occ = _GCN_OCC.search(amdgcn)
    return Resources(arch=arch, registers=meta["vgpr_count"], shared_bytes=meta["group_segment_fixed_size"],
                     static_shared_bytes=meta["group_segment_fixed_size"],
                     scratch_bytes=meta.get("private_segment_fixed_size", 0), loads=loads, stores=stores,
                     async_loads=async_loads, mma=mma, vgpr_spills=meta.get("vgpr_spill_count", 0),
                     sgpr_spills=meta.get("sgpr_spill_count", 0), agprs=meta.get("agpr_count"),
                     sgprs=meta["sgpr_count"], occupancy=int(occ.group(1)) if occ else None)


def resources(kernel: Any, backend: str, arch: str) -> Resources:
    """Resources of a ``triton.compile`` result for ``backend`` ("cuda" / "hip"). Shared memory is
    what triton launches the kernel with: on NVIDIA that is dynamic shared memory, which the cubin does
    not state (its own figure is the static part: 1 KiB on sm90 for every kernel, the reserve)."""
    return resources_many([kernel], backend, arch)[0]


def resources_many(kernels: list[Any], backend: str, arch: str) -> list[Resources]:
    """:func:`resources` of several kernels of one target; NVIDIA's disassembled in one run."""
    if backend == "cuda":
        out = nvidia_resources_many([k.asm["cubin"] for k in kernels])
    else:
        out = [amd_resources(k.asm["amdgcn"], arch) for k in kernels]
    for res, k in zip(out, kernels, strict=True):
        res.shared_bytes = int(k.metadata.shared)
    return out


__all__ = ["WIDTHS", "Resources", "ToolError", "amd_resources", "cubin_text",
           "nvidia_resources_many", "parse_res_usage", "parse_sass", "resources", "resources_many", "split_sass"]
