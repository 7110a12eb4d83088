"""csrc's HIP kernels compile for the R9700 (gfx1201) and Strix Halo (gfx1151), and the code
objects are what those chips load: the right EF_AMDGPU_MACH in e_flags, every kernel wave32
(descriptor bit and metadata), no symbol left for a device library to resolve.

Debian's clang-19 does this without ROCm (`make toolchain` installs it). Negative controls show
the reader catches each defect: a wave64 build, the other target, an unresolved call.
"""

from __future__ import annotations

import shutil
import subprocess

import pytest

from vllm_hybridcache.ops import codeobj, csrc_build

KERNELS = ("hc_snapshot_copy_w16", "hc_snapshot_copy_w8", "hc_snapshot_copy_w4",
           "hc_snapshot_copy_w1")


@pytest.fixture(scope="module")
def clang() -> str:
    cc = csrc_build.clang()
    if cc is None:
        if shutil.which("apt-get") is None:
            pytest.skip("clang-19 is not installed and apt-get is unavailable here, so "
                        "`make toolchain` could not install it")
        pytest.fail("clang-19 missing although apt-get exists: run `make toolchain`")
    return cc


@pytest.mark.parametrize("target,mach", [("gfx1151", 0x4A), ("gfx1201", 0x4E)])
def test_code_object_for_target(clang, tmp_path, target, mach) -> None:
    path = csrc_build.compile_code_object(target, tmp_path)
    co = codeobj.read(path)
    assert co.machine == codeobj.EM_AMDGPU
    assert co.flags & codeobj.EF_AMDGPU_MACH == mach
    assert sorted(k.name for k in co.kernels) == sorted(KERNELS)
    for k in co.kernels:
        assert k.wave32_descriptor and k.wavefront_size == 32, k
        assert k.private_segment_bytes == 0, k  # no scratch: nothing spilled
    assert co.undefined == []
    assert codeobj.check(path, target, KERNELS) == []


def test_reader_catches_wave64_and_wrong_target(clang, tmp_path) -> None:
    path = csrc_build.compile_code_object("gfx1201", tmp_path, ("-mwavefrontsize64",))
    problems = codeobj.check(path, "gfx1201")
    assert problems and all("not wave32" in p for p in problems)
    ok = csrc_build.compile_code_object("gfx1201", tmp_path / "w32")
    assert any("not gfx1151" in p for p in codeobj.check(ok, "gfx1151"))


def test_reader_catches_unresolved_symbols(clang, tmp_path) -> None:
    src = tmp_path / "u.c"
    src.write_text("extern float ext_fn(float);\nfloat f(float x) { return ext_fn(x); }\n")
    obj = tmp_path / "u.o"
    subprocess.run([clang, "--target=amdgcn-amd-amdhsa", "-mcpu=gfx1201", "-nogpulib", "-O2",
                    "-c", str(src), "-o", str(obj)], check=True)
    assert "ext_fn" in codeobj.read(obj).undefined
    assert any("unresolved" in p for p in codeobj.check(obj, "gfx1201"))


def test_cli_compiles_and_checks(clang, tmp_path) -> None:
    assert csrc_build.main(["code-objects", "--targets", "gfx1151", "gfx1201",
                            "--out", str(tmp_path)]) == 0


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc on this machine")
def test_same_header_compiles_for_cuda(tmp_path) -> None:
    """The CUDA build of the same kernels (threadIdx/blockIdx path) compiles for sm_90."""
    src = csrc_build.csrc_dir()
    res = subprocess.run(["nvcc", "-x", "cu", "-c", "-arch=sm_90", f"-I{src}",
                          str(src / csrc_build.CODEOBJ_SOURCE), "-o", str(tmp_path / "k.o")],
                         capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stderr
