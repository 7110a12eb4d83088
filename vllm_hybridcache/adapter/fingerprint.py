"""Engine fingerprints: which engines compute the same state for the same tokens.

A link stored beyond one engine's life (a file on disk, a copy on another replica) may only be
read by an engine that would have computed the very same bytes. The domain (adapter/domain.py)
already separates what changes *meaning* inside one engine (tenant, LoRA, route); the
fingerprint adds what changes *arithmetic* between engines:

- the weights by content, not by path: two paths with the same files agree, a re-trained
  checkpoint under the old path does not. Files are hashed once and the digest is remembered by
  (path, size, mtime, inode), so a restart does not re-read tens of GB;
- the model's config (architecture sizes), dtypes and the state layout digest;
- the kernel backend and what it ran on (CPU ISA flags or GPU architecture): vLLM's CPU kernels
  take other paths without AVX-512, and a GPU build differs from a CPU one;
- torch, vLLM and plugin versions, and the segmentation settings (where links are cut);
- the speculative decoding setup (method, draft tokens, drafter path): the draft head's rows
  and a verify step's states are computed on batches shaped by it, so two engines that differ
  there share nothing (on doubt, miss; the domain's `route` only separates AR from drafts).

Nothing here is a secret; the digest is sha256 over a canonical JSON of these fields, and
`fields` is kept so a log line can say *why* two engines differ.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
CONFIG_FILES = ("config.json",)
_ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile", "fma",
              "asimd", "sve")


@dataclass(frozen=True)
class Fingerprint:
    """What an engine's state depends on, and its digest (32 bytes)."""

    fields: Mapping[str, str]
    digest: bytes

    @property
    def hex(self) -> str:
        return self.digest.hex()

    def differences(self, other: Fingerprint) -> list[str]:
        """Field names whose values differ (for a log line when files are refused)."""
        keys = set(self.fields) | set(other.fields)
        return sorted(k for k in keys if self.fields.get(k) != other.fields.get(k))


def make_fingerprint(fields: Mapping[str, str]) -> Fingerprint:
    payload = json.dumps({"v": 1, **fields}, sort_keys=True, separators=(",", ":"))
    return Fingerprint(dict(fields), hashlib.sha256(payload.encode()).digest())


def _file_digest(path: Path, memo: dict[str, dict], memo_key: str) -> str:
    st = path.stat()
    stamp = [st.st_size, st.st_mtime_ns, st.st_ino]
    hit = memo.get(memo_key)
    if hit is not None and hit.get("stamp") == stamp:
        return str(hit["sha256"])
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    memo[memo_key] = {"stamp": stamp, "sha256": h.hexdigest()}
    return h.hexdigest()


def weights_digest(model_dir: Path, memo_file: Path | None = None) -> str:
    """sha256 over the names and contents of a checkpoint's weight and config files.

    memo_file: a JSON file remembering file digests by (size, mtime, inode); unreadable or
    damaged memos are ignored (the files are hashed again), never trusted blindly.
    """
    files = sorted(p for p in model_dir.rglob("*") if p.is_file() and (
        p.name in CONFIG_FILES or p.suffix in WEIGHT_SUFFIXES))
    if not any(p.suffix in WEIGHT_SUFFIXES for p in files):
        raise FileNotFoundError(f"no weight files under {model_dir}")
    memo: dict[str, dict] = {}
    if memo_file is not None:
        try:
            loaded = json.loads(memo_file.read_text())
            memo = loaded if isinstance(loaded, dict) else {}
        except (OSError, ValueError):
            memo = {}
    h = hashlib.sha256()
    for p in files:
        rel = p.relative_to(model_dir).as_posix()
        h.update(rel.encode() + b"\0")
        h.update(_file_digest(p, memo, str(p.resolve())).encode() + b"\0")
    if memo_file is not None:
        tmp = memo_file.with_name(f".{memo_file.name}.{os.getpid()}")
        try:
            tmp.write_text(json.dumps(memo, sort_keys=True))
            os.replace(tmp, memo_file)
        except OSError:
            tmp.unlink(missing_ok=True)  # a read-only directory only costs the next start
    return h.hexdigest()


def cpu_isa() -> str:
    """The CPU features that select vLLM's and torch's CPU kernel paths."""
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    present = [f for f in _ISA_FLAGS if f in flags]
    capability = ""
    try:
        import torch

        capability = str(torch.backends.cpu.get_cpu_capability())
    except Exception:
        capability = ""
    return f"{platform.machine()}:{capability}:{','.join(present)}"


def gpu_arch() -> str:
    """The accelerator's architecture name ('' without one): gfx1201, sm_90, ..."""
    try:
        import torch

        if not torch.cuda.is_available():
            return ""
        props = torch.cuda.get_device_properties(0)
        arch = getattr(props, "gcnArchName", "") or ""
        return arch.split(":")[0] if arch else f"sm_{props.major}{props.minor}"
    except Exception:
        return ""


def resolve_model_dir(model: str, revision: str | None) -> Path | None:
    """The local folder of a checkpoint: the path itself, or its Hugging Face cache snapshot."""
    p = Path(model)
    if p.is_dir():
        return p
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, revision=revision, local_files_only=True))
    except Exception:
        return None


def kernel_backend(vllm_config) -> str:
    """The kernel choices that change an engine's arithmetic beyond the device: vLLM's device
    type and attention backend setting, the Flash-Next implementation, kernel backend and
    split-invariant forward chosen by our environment variables (empty = the platform
    default), and the pin of vLLM's CPU attention when it is on."""
    from vllm_hybridcache.config import FLASH_NEXT_IMPL_ENV, FLASH_NEXT_OPS_ENV
    from vllm_hybridcache.flash_next.ops import split_invariant
    from vllm_hybridcache.registrations import cpu_attention_pinned

    device = str(getattr(getattr(vllm_config, "device_config", None), "device_type", ""))
    attn = os.environ.get("VLLM_ATTENTION_BACKEND", "")
    # the CPU attention pin changes the attention's bits; named only when on, so engines
    # without it keep their fingerprint
    pinned = ";cpu_attention_split_invariant=1" if cpu_attention_pinned() else ""
    return (f"device={device};attention={attn};flash_next_impl="
            f"{os.environ.get(FLASH_NEXT_IMPL_ENV, '')};flash_next_ops="
            f"{os.environ.get(FLASH_NEXT_OPS_ENV, '')};flash_next_split_invariant="
            f"{int(split_invariant.enabled())}{pinned}")


def speculative_setup(vllm_config) -> str:
    """The speculative decoding settings that shape a draft or verify batch ('' without)."""
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None:
        return ""
    return (f"method={spec.method};k={spec.num_speculative_tokens};padded="
            f"{int(not spec.disable_padded_drafter_batch)};parallel="
            f"{int(bool(getattr(spec, 'parallel_drafting', False)))}")


def engine_fingerprint(vllm_config, layout_digest: str, segmentation: str, backend: str,
                       memo_file: Path | None = None) -> Fingerprint:
    """The fingerprint of this engine (see the module docstring for what goes in and why).

    A checkpoint whose files cannot be found locally is fingerprinted by name and revision
    (field `weights` then starts with `name:`), which is what vLLM itself would load again.
    """
    import torch

    import vllm_hybridcache

    try:
        from importlib.metadata import version

        vllm_version = version("vllm")
    except Exception:
        vllm_version = "unknown"
    mc = vllm_config.model_config
    cc = vllm_config.cache_config
    model_dir = resolve_model_dir(str(mc.model), mc.revision)
    weights = (f"sha256:{weights_digest(model_dir, memo_file)}" if model_dir is not None
               else f"name:{mc.model}@{mc.revision or ''}")
    fields = {
        "weights": weights,
        "dtype": str(mc.dtype),
        "kv_cache_dtype": str(cc.cache_dtype),
        "mamba_ssm_dtype": str(getattr(cc, "mamba_ssm_cache_dtype", "")),
        "layout": layout_digest,
        "backend": backend,
        "device": gpu_arch() or cpu_isa(),
        "torch": torch.__version__,
        "vllm": vllm_version,
        "plugin": vllm_hybridcache.__version__,
        "segmentation": segmentation,
        "speculative": speculative_setup(vllm_config),
    }
    return make_fingerprint(fields)
