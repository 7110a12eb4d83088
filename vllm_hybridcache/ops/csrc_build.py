"""Build csrc/: the CPU twin, the torch GPU extension and the AMD code objects.

Why three builds of one header: the element logic (``csrc/snapshot_copy.h``) must be the same on
every path, but the machines differ. CI has only a CPU and Debian's clang-19: it builds the CPU
twin (a torch C++ extension, g++) to test against torch and compiles the device code for
gfx1151/gfx1201 to check the code objects. The ROCm image has a ROCm torch: it builds the torch
GPU extension for ``PYTORCH_ROCM_ARCH`` (hipcc) and ships it in the wheel (``_prebuilt/``).

    python -m vllm_hybridcache.ops.csrc_build code-objects --targets gfx1151 gfx1201 --out DIR
    python -m vllm_hybridcache.ops.csrc_build prebuild --out vllm_hybridcache/ops/_prebuilt
    python -m vllm_hybridcache.ops.csrc_build warm     # CPU twin into torch's cache
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

PACKAGE_DIR = Path(__file__).resolve().parent
PREBUILT_DIR = PACKAGE_DIR / "_prebuilt"
CPU_NAME = "hybridcache_copy_cpu"
DEVICE_NAME = "hybridcache_copy_device"
CODEOBJ_SOURCE = "snapshot_copy_codeobj.hip"
CLANG = "clang-19"
TARGETS = ("gfx1151", "gfx1201")


def csrc_dir() -> Path | None:
    """The csrc/ sources: beside the package in a checkout (editable install) or an image build
    context; None in an installed wheel, which carries prebuilt modules instead."""
    env = os.environ.get("VLLM_HYBRIDCACHE_CSRC")
    for cand in ([Path(env)] if env else []) + [PACKAGE_DIR.parents[1] / "csrc"]:
        if (cand / "snapshot_copy.h").is_file():
            return cand
    return None


def _load_prebuilt(name: str) -> ModuleType | None:
    for path in sorted(PREBUILT_DIR.glob(f"{name}*.so")):
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            continue
        import torch  # noqa: F401  (the extension links against libtorch)

        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    return None


def _build_dir(name: str, out: Path | None) -> Path:
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        return out
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(name, verbose=False))


def load_cpu_twin(out: Path | None = None, verbose: bool = False) -> ModuleType:
    """The CPU twin: prebuilt if the wheel has it, else compiled from csrc/ (cached by torch)."""
    mod = _load_prebuilt(CPU_NAME) if out is None else None
    if mod is not None:
        return mod
    src = csrc_dir()
    if src is None:
        raise FileNotFoundError("csrc/ sources not found and no prebuilt CPU twin in the wheel")
    from torch.utils.cpp_extension import load

    return load(name=CPU_NAME, sources=[str(src / "snapshot_copy_cpu.cpp")],
                extra_include_paths=[str(src)], extra_cflags=["-O3"],
                build_directory=str(_build_dir(CPU_NAME, out)), verbose=verbose)


def load_device_extension(out: Path | None = None, verbose: bool = False) -> ModuleType:
    """The torch GPU extension (hipcc on a ROCm torch, nvcc on a CUDA torch)."""
    mod = _load_prebuilt(DEVICE_NAME) if out is None else None
    if mod is not None:
        return mod
    import torch

    if not (torch.version.hip or torch.version.cuda):
        raise RuntimeError("the GPU copy extension needs a ROCm or CUDA build of torch "
                           f"(this torch is {torch.__version__})")
    src = csrc_dir()
    if src is None:
        raise FileNotFoundError("csrc/ sources not found and no prebuilt GPU extension")
    from torch.utils.cpp_extension import load

    return load(name=DEVICE_NAME, sources=[str(src / "snapshot_copy_device.cu")],
                extra_include_paths=[str(src)], extra_cflags=["-O3"],
                extra_cuda_cflags=["-O3"], build_directory=str(_build_dir(DEVICE_NAME, out)),
                verbose=verbose)


def clang() -> str | None:
    """Path of the clang that compiles the AMD code objects (Debian's clang-19)."""
    return shutil.which(os.environ.get("VLLM_HYBRIDCACHE_CLANG", CLANG))


def compile_code_object(target: str, out_dir: Path, extra: tuple[str, ...] = ()) -> Path:
    """Compile csrc's kernels for one AMD target into a code object (an AMDGPU ELF).

    Device code only (no host side, no HIP runtime headers, no device libraries), which is
    what Debian's clang-19 can do for RDNA3.5/RDNA4 without a ROCm install. ``HIP_PLATFORM=amd``
    keeps clang on the AMD path where an nvcc is installed.
    """
    cc = clang()
    src = csrc_dir()
    if cc is None or src is None:
        raise FileNotFoundError(f"needs {CLANG} (make toolchain) and the csrc/ sources")
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"snapshot_copy-{target}.co"
    cmd = [cc, "-x", "hip", "--cuda-device-only", "--no-gpu-bundle-output", "-nogpulib",
           "-nogpuinc", "-O3", "-std=c++17", f"--offload-arch={target}", f"-I{src}",
           *extra, str(src / CODEOBJ_SOURCE), "-o", str(out)]
    env = dict(os.environ, HIP_PLATFORM="amd")
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{res.stderr}")
    return out


def prebuild(out: Path, verbose: bool = True) -> list[Path]:
    """Build the modules a wheel ships (the image's builder stage runs this before
    ``pip wheel``): the GPU extension when torch has a GPU build, and the CPU twin."""
    import torch

    out.mkdir(parents=True, exist_ok=True)
    built: list[Path] = []
    names = [CPU_NAME] + ([DEVICE_NAME] if (torch.version.hip or torch.version.cuda) else [])
    for name in names:
        tmp = out / f".build-{name}"
        (load_device_extension if name == DEVICE_NAME else load_cpu_twin)(tmp, verbose)
        for so in tmp.glob(f"{name}*.so"):
            dst = out / so.name
            shutil.copy2(so, dst)
            built.append(dst)
        shutil.rmtree(tmp, ignore_errors=True)
    return built


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    co = sub.add_parser("code-objects", help="compile and check AMD code objects (clang-19)")
    co.add_argument("--targets", nargs="+", default=list(TARGETS))
    co.add_argument("--out", type=Path, required=True)
    pb = sub.add_parser("prebuild", help="build the extensions a wheel ships")
    pb.add_argument("--out", type=Path, default=PREBUILT_DIR)
    sub.add_parser("warm", help="compile the CPU twin into torch's extension cache (make "
                   "toolchain), so the first server start does not compile it")
    args = ap.parse_args(argv)
    if args.cmd == "warm":
        try:
            mod = load_cpu_twin()
        except Exception as e:  # the torch copy path still works; say why the twin will not
            print(f"csrc CPU twin not built ({e}); the CPU copy path stays on torch")
            return 0
        print(f"csrc CPU twin: {mod.__file__}")
        return 0
    if args.cmd == "code-objects":
        from vllm_hybridcache.ops.codeobj import check

        bad = 0
        for t in args.targets:
            path = compile_code_object(t, args.out)
            problems = check(path, t)
            print(f"{path}: {'ok' if not problems else '; '.join(problems)}")
            bad += bool(problems)
        return 1 if bad else 0
    for path in prebuild(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
