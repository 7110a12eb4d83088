"""Build csrc/: the CPU twin, the torch GPU extension and the AMD code objects.

Why three builds of one header: the element logic (``csrc/snapshot_copy.h``) must be the same on
every path, but the machines differ. CI has only a CPU and Debian's clang-19: it builds the CPU
twin (a torch C++ extension, g++) to test against torch and compiles the device code for
gfx1151/gfx1201 to check the code objects. The ROCm image has a ROCm torch: it builds the torch
GPU extension for ``PYTORCH_ROCM_ARCH`` (hipcc) and ships it in the wheel (``_prebuilt/``).

    python -m vllm_hybridcache.ops.csrc_build code-objects --targets gfx1151 gfx1201 --out DIR
    python -m vllm_hybridcache.ops.csrc_build prebuild --out vllm_hybridcache/ops/_prebuilt
    python -m vllm_hybridcache.ops.csrc_build warm     # CPU twin and the host's kernels, cached

The split-invariant CPU attention (``csrc/split_attention_cpu.cpp``, ``ops/cpu_attention.py``)
and the row-invariant linear (``csrc/rowwise_linear_cpu.cpp``, ``ops/rowwise_linear.py``) are
built the same way as the CPU twin, for the host they run on (``-march=native``): they serve
the CPU only, so no wheel ships them.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

from vllm_hybridcache.config import CLANG_ENV, CSRC_ENV

PACKAGE_DIR = Path(__file__).resolve().parent
PREBUILT_DIR = PACKAGE_DIR / "_prebuilt"
CPU_NAME = "hybridcache_copy_cpu"
ATTENTION_NAME = "hybridcache_attention_cpu"
ROWWISE_NAME = "hybridcache_rowwise_cpu"
DEVICE_NAME = "hybridcache_copy_device"
CODEOBJ_SOURCE = "snapshot_copy_codeobj.hip"
CLANG = "clang-19"
TARGETS = ("gfx1151", "gfx1201")
# How long a load waits for another live process that is compiling the same build; past it the
# load fails and the copy backend falls back (``copy_select``), the server keeps starting.
BUILD_WAIT_S = 900.0
logger = logging.getLogger(__name__)


def csrc_dir() -> Path | None:
    """The csrc/ sources: beside the package in a checkout (editable install) or an image build
    context; None in an installed wheel, which carries prebuilt modules instead."""
    env = os.environ.get(CSRC_ENV)
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


def _source_key(src: Path, sources: list[Path]) -> str:
    """A short digest of what a build depends on: where the sources are (torch's ninja file
    names them by absolute path, so two checkouts sharing one directory rebuild for each other),
    their bytes, and the torch and Python versions the module links against."""
    import torch

    h = hashlib.sha256(f"{src.resolve()}|{torch.__version__}|{sys.version_info[:2]}".encode())
    for path in sorted(sources):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:12]


def _build_dir(name: str, src: Path, out: Path | None, salt: str = "") -> Path:
    """``out`` when given, else a directory of torch's extension cache per source tree (and
    ``salt``: what else the build depends on)."""
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        return out
    from torch.utils.cpp_extension import _get_build_directory

    sources = [p for p in src.iterdir() if p.suffix in (".h", ".cuh", ".cpp", ".cu", ".hip")]
    key = _source_key(src, sources)
    if salt:
        key = hashlib.sha256(f"{key}|{salt}".encode()).hexdigest()[:12]
    return Path(_get_build_directory(f"{name}-{key}", verbose=False))


def host_isa() -> str:
    """What ``-march=native`` compiles for on this host: the CPU's model and flags, so a
    build cache shared by hosts of another ISA never hands one host the other's module."""
    import platform

    flags = model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags") and not flags:
                flags = line.split(":", 1)[1].strip()
            elif line.startswith("model name") and not model:
                model = line.split(":", 1)[1].strip()
    except OSError:
        pass
    return f"{platform.machine()}|{model}|{flags}"


@contextmanager
def build_lock(build_dir: Path, wait_s: float = BUILD_WAIT_S) -> Iterator[None]:
    """Hold an ``flock`` (``build_dir/build.flock``) around torch's ``load``.

    Why: torch guards a build with a ``lock`` file it creates and removes itself; a process killed
    while compiling (a server stopped during its first start) leaves that file behind and every
    later load waits on it forever. The kernel drops an ``flock`` when its holder dies, and every
    load of ours takes this one first, so a ``lock`` file found while holding it belongs to a
    builder that is gone: it is removed, and the build runs again.
    """
    fd = os.open(build_dir / "build.flock", os.O_CREAT | os.O_RDWR, 0o644)
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"another process has been building {build_dir} for "
                                       f"over {wait_s:.0f} s") from None
                time.sleep(0.2)
        stale = build_dir / "lock"
        if stale.exists():
            logger.warning("hybridcache: removing %s, left by a build that did not finish", stale)
            stale.unlink(missing_ok=True)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the flock


def load_cpu_twin(out: Path | None = None, verbose: bool = False) -> ModuleType:
    """The CPU twin: prebuilt if the wheel has it, else compiled from csrc/ (cached by torch)."""
    mod = _load_prebuilt(CPU_NAME) if out is None else None
    if mod is not None:
        return mod
    src = csrc_dir()
    if src is None:
        raise FileNotFoundError("csrc/ sources not found and no prebuilt CPU twin in the wheel")
    from torch.utils.cpp_extension import load

    build = _build_dir(CPU_NAME, src, out)
    with build_lock(build):
        return load(name=CPU_NAME, sources=[str(src / "snapshot_copy_cpu.cpp")],
                    extra_include_paths=[str(src)], extra_cflags=["-O3"],
                    build_directory=str(build), verbose=verbose)


def _load_native(name: str, source: str, extra_cflags: tuple[str, ...] = (),
                 out: Path | None = None, verbose: bool = False) -> ModuleType:
    """A module of csrc/ built for this host (``-march=native``, OpenMP), cached by torch per
    source tree and host ISA: the first load on a host compiles it."""
    src = csrc_dir()
    if src is None or not (src / source).is_file():
        raise FileNotFoundError(f"csrc/{source} not found (an installed wheel carries no "
                                "host-built CPU kernels: they are built for their host)")
    from torch.utils.cpp_extension import load

    build = _build_dir(name, src, out, salt=host_isa())
    with build_lock(build):
        return load(name=name, sources=[str(src / source)],
                    extra_cflags=["-O3", "-march=native", "-fopenmp", *extra_cflags],
                    extra_ldflags=["-fopenmp"], build_directory=str(build), verbose=verbose)


def load_cpu_attention(out: Path | None = None, verbose: bool = False) -> ModuleType:
    """The split-invariant CPU attention, compiled from csrc/ for this host (cached by torch:
    the first load on a host compiles, about a minute on two cores)."""
    return _load_native(ATTENTION_NAME, "split_attention_cpu.cpp", out=out, verbose=verbose)


def load_rowwise_linear(out: Path | None = None, verbose: bool = False) -> ModuleType:
    """The row-invariant CPU linear layer (Flash-Next's split-invariant forward), compiled
    for this host like the attention. ``-ffp-contract=off``: its multiply-adds are fused
    where the source says so and nowhere else, the same in every code path."""
    return _load_native(ROWWISE_NAME, "rowwise_linear_cpu.cpp", ("-ffp-contract=off",),
                        out=out, verbose=verbose)


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

    build = _build_dir(DEVICE_NAME, src, out)
    with build_lock(build):
        return load(name=DEVICE_NAME, sources=[str(src / "snapshot_copy_device.cu")],
                    extra_include_paths=[str(src)], extra_cflags=["-O3"],
                    extra_cuda_cflags=["-O3"], build_directory=str(build), verbose=verbose)


def clang() -> str | None:
    """Path of the clang that compiles the AMD code objects (Debian's clang-19)."""
    return shutil.which(os.environ.get(CLANG_ENV, CLANG))


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
    sub.add_parser("warm", help="compile the CPU twin, the split-invariant CPU attention and "
                   "the row-invariant linear "
                   "into torch's extension cache (make toolchain), so the first server start "
                   "does not compile them")
    args = ap.parse_args(argv)
    if args.cmd == "warm":
        try:
            mod = load_cpu_twin()
        except Exception as e:  # the torch copy path still works; say why the twin will not
            print(f"csrc CPU twin not built ({e}); the CPU copy path stays on torch")
            return 0
        print(f"csrc CPU twin: {mod.__file__}")
        try:
            att = load_cpu_attention()
        except Exception as e:  # engines then run vLLM's attention in step mode; say why
            print(f"csrc CPU attention not built ({e}); Qwen3-Next on CPU stays in step mode")
            return 0
        print(f"csrc CPU attention: {att.__file__}")
        try:
            lin = load_rowwise_linear()
        except Exception as e:  # Flash-Next's split-invariant forward then tiles its GEMMs
            print(f"csrc row-invariant linear not built ({e}); Flash-Next's split-invariant "
                  "forward runs its GEMMs on 64-row tiles")
            return 0
        print(f"csrc row-invariant linear: {lin.__file__}")
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
