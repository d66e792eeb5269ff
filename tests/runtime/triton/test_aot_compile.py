"""Every Triton kernel compiles for Hopper (sm_90a) and MI300 (gfx942) at Kimi-K2.5 shapes in bf16,
within the target's shared memory / LDS and without spilling registers, with no GPU (Triton lowers
to cubin / hsaco on the CPU; the figures are read from the compiled code). One compile per kernel
and target serves both checks. The interpreter runs the numerics; this catches what it cannot
(tl.dot shape and dtype rules, fp8 types, constexpr branches, resource use). Running on real GPUs
stays unverified here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("triton")

from eagle3.runtime.kernels.triton import aot_check, compiled_code  # noqa: E402

TARGETS = ("cuda:90", "hip:gfx942")


Aot = tuple[subprocess.CompletedProcess[str], dict[str, Any], Path]  # the run, its --json report, its cache


@pytest.fixture(scope="module")
def aot(tmp_path_factory: pytest.TempPathFactory) -> Aot:
    tmp = tmp_path_factory.mktemp("aot")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp / "cache")  # hermetic: compile for real, leave no cache behind
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # triton 3.9 warns when unset; 1 is its default
    out = tmp / "aot.json"
    proc = subprocess.run([sys.executable, "-m", "eagle3.runtime.kernels.triton.aot_check", "--bf16-only",
                           "--json", str(out), *TARGETS], env=env, capture_output=True, text=True, timeout=600)
    return proc, json.loads(out.read_text()) if out.is_file() else {}, tmp / "cache"


def test_kernels_compile_for_hopper_and_mi300(aot: Aot) -> None:
    proc, report, _ = aot
    assert proc.returncode == 0, proc.stdout + proc.stderr
    expected = [(t, label) for t in TARGETS for label, *_ in aot_check._cases()
                if aot_check.production(label) and aot_check.applies(label, aot_check.parse_target(t))]
    got = [(r["target"], r["kernel"]) for r in report["kernels"]]
    assert got == expected
    assert all(r["error"] is None for r in report["kernels"])
    # triton 3.9 compiles capability 90 for sm_90a (wgmma / setmaxnreg allowed), read from the cubin
    assert {r["arch"] for r in report["kernels"]} == {"sm_90a", "gfx942"}
    for r in report["kernels"]:
        assert r["shared_bytes"] <= aot_check.SHARED_LIMIT[r["target"]], r
        assert r["registers"] > 0 and sum(r["loads"].values()) > 0, r  # every kernel reads global memory


def test_no_production_kernel_spills(aot: Aot) -> None:
    """No register spills beyond the KNOWN_SPILLS list, which only shrinks: a listed kernel that
    stops spilling must leave it (which also shows the spill reader sees spills at all)."""
    _, report, _ = aot
    spilling = [f"{r['target']} {r['kernel']}" for r in report["kernels"] if r["spills"] and not r["known_spill"]]
    assert spilling == [], f"spill registers (see aot_check --table): {spilling}"
    assert report["stale_known_spills"] == [], "no longer spill: remove from aot_check.KNOWN_SPILLS"


def test_batched_disassembly_reads_what_cuobjdump_reads(aot: Aot) -> None:
    """The sm_90a rows come from one nvdisasm run over all the kernels' code, split back by offset
    (compiled_code.nvidia_resources_many): ``cuobjdump -sass`` of one cubin on its own must give its
    row's counts. MLA's serial kernel: mid-batch (its code starts at an offset), with spills,
    wgmma and async copies, so every counter is non-zero."""
    _, report, cache = aot
    cubins = list(cache.glob("*/_mla_serial_kernel.cubin"))
    assert len(cubins) == 1, cubins  # the [cuda] serial case is the only one compiled to a cubin
    tool = compiled_code.nvidia_tool("cuobjdump")
    alone = compiled_code.parse_sass(subprocess.run([tool, "-sass", str(cubins[0])], capture_output=True, text=True,
                                                    check=True).stdout)
    row = next(r for r in report["kernels"] if r["target"] == "cuda:90" and r["kernel"].startswith("mla serial"))
    assert alone["spill_store_bytes"] > 0 and alone["async_loads"] > 0 and alone["mma"]
    assert {k: row[k] for k in alone} == alone

SASS = """
	code for sm_90a
        /*0210*/               @P1 LDG.E.U16 R46, desc[UR10][R2.64] ;
        /*0220*/                   LDG.E.128.CONSTANT R4, desc[UR10][R2.64] ;
        /*0230*/                   LDG.E.64 R8, desc[UR10][R2.64] ;
        /*0240*/              @!P0 LDG.E R9, desc[UR10][R2.64] ;
        /*0250*/                   LDGSTS.E.BYPASS.LTC128B.128 [R3], desc[UR10][R4.64] ;
        /*0260*/                   LDGDEPBAR ;
        /*0270*/                   STL.64 [R1+0x8], R10 ;
        /*0280*/                   LDL R12, [R1+0x8] ;
        /*0290*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24 ;
        /*02a0*/                   STG.E.U16 desc[UR10][R2.64], R5 ;
"""

AMDGCN = """
	global_load_dwordx4 v[0:3], v[4:5], off
	buffer_load_ushort v1, v66, s[24:27], 0 offen
	global_load_short_d16_hi v2, v[4:5], off
	global_load_lds_dword v[4:5], off
	v_mfma_f32_32x32x8_bf16 v[0:15], v[16:17], v[18:19], v[0:15]
	global_store_short v[4:5], v1, off
; Occupancy: 2
amdhsa.kernels:
  - .agpr_count:     0
    .group_segment_fixed_size: 32768
    .private_segment_fixed_size: 804
    .sgpr_count:     106
    .sgpr_spill_count: 141
    .vgpr_count:     256
    .vgpr_spill_count: 200
"""


def test_compiled_code_readers_count_widths_and_spills() -> None:
    sass = compiled_code.parse_sass(SASS)
    assert sass["arch"] == "sm_90a"
    # LTC128B is a cache hint, not a width: the LDGSTS copies 16 B per thread
    assert sass["loads"] == {"128": 2, "96": 0, "64": 1, "32": 1, "narrow": 1}
    assert sass["async_loads"] == 1 and sass["stores"]["narrow"] == 1
    assert (sass["spill_store_bytes"], sass["spill_load_bytes"]) == (8, 4)
    assert sass["mma"] == {"HGMMA": 1}
    assert compiled_code.parse_res_usage(" REG:254 STACK:80 SHARED:1024 LOCAL:0 CONSTANT[0]:616")["registers"] == 254
    r = compiled_code.amd_resources(AMDGCN, "gfx942")
    assert r.loads == {"128": 1, "96": 0, "64": 0, "32": 1, "narrow": 2} and r.async_loads == 1
    assert (r.registers, r.agprs, r.sgprs, r.shared_bytes, r.occupancy) == (256, 0, 106, 32768, 2)
    assert r.spills and (r.vgpr_spills, r.sgpr_spills, r.scratch_bytes) == (200, 141, 804)
    assert not compiled_code.amd_resources(AMDGCN.replace("804", "0").replace("200", "0"), "gfx942").spills


def test_table_marks_spills(tmp_path: Path) -> None:
    res = compiled_code.amd_resources(AMDGCN, "gfx942")
    rows = [aot_check.Row("hip:gfx942", "mla x", 8, True, 1.0, res)]
    text = aot_check.table(rows)
    assert "**mla x** (spills)" in text and "200 / 141 (804)" in text
    doc = tmp_path / "k.md"
    doc.write_text(f"a\n{aot_check.DOC_BEGIN}\nold\n{aot_check.DOC_END}\nb\n")
    aot_check.update_doc(doc, text)
    assert doc.read_text() == f"a\n{aot_check.DOC_BEGIN}\n{text}{aot_check.DOC_END}\nb\n"
    # a KNOWN_SPILLS entry that names no case is stale too (a kernel renamed or removed)
    known = next(iter(aot_check.KNOWN_SPILLS))
    assert aot_check.stale_known_spills([], [known]) == [f"{k} (no such case)" for k in aot_check.KNOWN_SPILLS
                                                           if k != known]
    with pytest.raises(ValueError, match="expected cuda:CAPABILITY"):
        aot_check.parse_target("cuda:sm90")
