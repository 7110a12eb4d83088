"""Engine fingerprints: which engines compute the same state for the same tokens.

A link stored beyond one engine's life (a file on disk, a copy on another replica) may only be
read by an engine that would have computed the very same bytes. The domain (adapter/domain.py)
already separates what changes *meaning* inside one engine (tenant, LoRA, route); the
fingerprint adds what changes *arithmetic* between engines:

- the weights by content, not by name or path: two paths with the same files agree, a
  re-trained checkpoint under the old path or the old hub name does not. The files are found
  where vLLM loads them (a local folder, or the Hugging Face cache snapshot of the name under
  `--download-dir` or `HF_HUB_CACHE` / `HF_HOME`); each is hashed once and its digest is
  remembered by (path, size, mtime, inode), and a file the Hugging Face cache already names by
  its sha256 (an LFS blob) is not read at all. A checkpoint whose weights cannot be found and
  hashed (streamed from object storage, a tensorizer or dummy load, a hub name not in the
  cache) has no fingerprint: `FingerprintUnavailable`, and the callers run without the tiers
  that outlive the engine. Never a guess by name: an updated checkpoint under an old name would
  read the old checkpoint's links after a restart;
- the model's config as vLLM loaded it (`hf_config`, which `--hf-overrides` changes), the
  overrides themselves, the quantization method and its configs, the load format, the model
  implementation, dtypes and the state layout digest;
- the preprocessor of a multimodal model (`preprocessor_config.json` and the other processor
  files, vLLM's `mm_processor_kwargs`) and vLLM's encoder settings;
- the kernel backend and what it ran on (CPU ISA flags or GPU architecture): vLLM's CPU kernels
  take other paths without AVX-512, and a GPU build differs from a CPU one; vLLM's compilation
  settings (its own graph hash), the LoRA setup;
- torch (and its CUDA / ROCm build), Triton, vLLM and plugin versions, and the segmentation
  settings (where links are cut);
- the speculative decoding setup (method, draft tokens, drafter path): the draft head's rows
  and a verify step's states are computed on batches shaped by it, so two engines that differ
  there share nothing (on doubt, miss; the domain's `route` only separates AR from drafts).

Nothing here is a secret; the digest is sha256 over a canonical JSON of these fields, and
`fields` is kept (short values: names, versions, digests) so a log line can say *why* two
engines differ.

Why one module over ~500 lines: every input that names the engine's arithmetic (weights,
processor files, settings, kernels, ISA, versions) is gathered here, so one file is what a
reviewer reads to know that two engines with the same fingerprint compute the same bytes.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import logging
import os
import platform
import re
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from vllm_hybridcache.core.auth import PREFERRED_MAC, LinkKey, MacAlgorithm
from vllm_hybridcache.core.identity import FingerprintUnavailable  # raised here, caught by tiers

logger = logging.getLogger("vllm_hybridcache")

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
CONFIG_FILES = ("config.json", "params.json", "quant_config.json", "quantize_config.json",
                "hf_quant_config.json", "quantization_config.json")
"""Files next to the weights that change how they are read: the model's config, Mistral's
`params.json`, the quantization configs of GPTQ/AWQ/ModelOpt checkpoints; and every
`*.safetensors.index.json` (vLLM drops the safetensors files its index does not name)."""
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json",
                   "video_preprocessor_config.json", "image_processor_config.json")
"""A multimodal checkpoint's processor settings: they decide the pixels' processed tensors."""
FILE_LOAD_FORMATS = frozenset({
    "auto", "hf", "safetensors", "fastsafetensors", "instanttensor", "pt", "npcache", "mistral",
    "bitsandbytes", "sharded_state", "gguf", "runai_streamer", "runai_streamer_sharded"})
"""vLLM load formats that read the weights from the checkpoint's files (the runai streamer
only when those are local: `model_config.model_weights` empty). Any other (`dummy`: random
weights, `tensorizer`, `ipc_cache`, `modelexpress`, a plugin's) loads weights this module
cannot see, so such an engine has no fingerprint."""
_ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile", "fma",
              "asimd", "sve")
_SHA256_NAME = re.compile(r"[0-9a-f]{64}")
_PROCESS_MEMO: dict[str, dict] = {}
"""File digests by path and stamp for this process: a second caller (the cluster tier after
the disk tier, every LoRA request) does not read a file again."""
PROGRESS_INTERVAL_S = 30.0
"""Hashing a large checkpoint's files (an 80B-class one is ~160 GB) takes minutes on the
first start: a bar on a terminal, else a line in the server log this often (progress.py);
work shorter than that says nothing."""
LARGE_HASH_BYTES = 1 << 30
"""Bytes to read from which the start of the hashing is announced in the log."""


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
    payload = json.dumps({"v": 2, **fields}, sort_keys=True, separators=(",", ":"))
    return Fingerprint(dict(fields), hashlib.sha256(payload.encode()).digest())


def hub_blob_sha256(path: Path) -> str | None:
    """The sha256 of a Hugging Face cache file's content when the cache already names it.

    In a hub cache (`models--org--name/snapshots/<rev>/<file>`), each file is a symlink to
    `../../blobs/<etag>`; for LFS files (every weight file) the etag is the sha256 of the
    content as the Hub reports it. A blob with a 40-hex name (a git blob id: small files such
    as config.json) is read instead. The name is trusted as the content's digest (this
    huggingface_hub does not re-hash what it downloads into its cache): a blob damaged or
    rewritten in place under its name is not noticed, and vLLM would load it all the same.
    """
    if not path.is_symlink():
        return None
    try:
        target = path.resolve(strict=True)
    except (OSError, RuntimeError):
        return None
    blobs = target.parent
    if (blobs.name != "blobs" or not blobs.parent.name.startswith("models--")
            or not _SHA256_NAME.fullmatch(target.name) or not target.is_file()):
        return None
    return target.name


def _remembered(path: Path, memo: dict[str, dict] | None) -> tuple[str, list[int], dict | None]:
    """(the memo key of `path`, its stamp, the remembered entry for that stamp or None)."""
    st = path.stat()
    stamp = [st.st_size, st.st_mtime_ns, st.st_ino]
    key = str(path.resolve())
    for m in (_PROCESS_MEMO, memo):  # this process's own digests first
        hit = m.get(key) if m is not None else None
        if isinstance(hit, dict) and hit.get("stamp") == stamp and isinstance(
                hit.get("sha256"), str):
            return key, stamp, hit
    return key, stamp, None


def file_digest(path: Path, memo: dict[str, dict] | None = None,
                progress: Callable[[int], None] | None = None) -> str:
    """sha256 of a file's content: the hub cache's blob name when it has one, else a digest
    remembered by (path, size, mtime, inode) in `memo` and in this process, else the bytes
    (`progress(n)` is told of every n bytes read)."""
    named = hub_blob_sha256(path)
    if named is not None:
        return named
    key, stamp, hit = _remembered(path, memo)
    if hit is not None:
        if memo is not None:
            memo[key] = hit
        _PROCESS_MEMO[key] = hit
        return hit["sha256"]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
            if progress is not None:
                progress(len(chunk))
    entry = {"stamp": stamp, "sha256": h.hexdigest()}
    if memo is not None:
        memo[key] = entry
    _PROCESS_MEMO[key] = entry
    return entry["sha256"]


_MEMO_PERSON = b"hc-weights-memo"


def _read_memo(memo_file: Path | None, key: LinkKey | None = None) -> dict[str, dict]:
    """The remembered file digests, or {} when there are none to trust. With `key` (the disk
    key: the memo lives in the cache folder) the file must carry a valid MAC, since a memo
    that names an old digest for a changed file would give a changed checkpoint its
    predecessor's fingerprint; a memo without one is ignored (the files are hashed again)."""
    if memo_file is None:
        return {}
    try:
        fd = os.open(memo_file, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            raw = f.read(64 << 20)
        loaded = json.loads(raw)
    except (OSError, ValueError):
        return {}
    if key is not None:
        if not isinstance(loaded, dict) or not isinstance(loaded.get("files"), dict):
            return {}
        body = json.dumps(loaded["files"], sort_keys=True).encode()
        try:
            mac = bytes.fromhex(str(loaded.get("mac", "")))
            alg = MacAlgorithm(int(loaded.get("alg", MacAlgorithm.BLAKE2B)))
        except ValueError:
            return {}
        if not LinkKey.equal(key.mac(body, person=_MEMO_PERSON, alg=alg), mac):
            return {}
        loaded = loaded["files"]
    return loaded if isinstance(loaded, dict) else {}


def _write_memo(memo_file: Path | None, memo: dict[str, dict],
                key: LinkKey | None = None) -> None:
    if memo_file is None:
        return
    body = json.dumps(memo, sort_keys=True)
    if key is not None:  # the algorithm is recorded: another CPU class reads it all the same
        body = json.dumps({"files": memo, "alg": int(PREFERRED_MAC),
                           "mac": key.mac(body.encode(), person=_MEMO_PERSON).hex()})
    tmp = memo_file.with_name(f".{memo_file.name}.{os.getpid()}.{uuid.uuid4().hex}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
        with os.fdopen(fd, "w") as f:
            f.write(body)
        os.replace(tmp, memo_file)
    except OSError:
        tmp.unlink(missing_ok=True)  # a read-only directory only costs the next start


def _is_config_file(name: str) -> bool:
    return name in CONFIG_FILES or name.endswith(".safetensors.index.json")


def files_digest(files: Iterable[tuple[str, Path]], memo: dict[str, dict] | None = None) -> str:
    """sha256 over (name, content digest) pairs, in name order. The files that must be read
    (no hub blob name, no remembered digest) are shown as they are read (PROGRESS_INTERVAL_S)."""
    from vllm_hybridcache.progress import Progress

    files = sorted(files)
    todo = [p for _, p in files if hub_blob_sha256(p) is None and _remembered(p, memo)[2] is None]
    total = sum(p.stat().st_size for p in todo)
    if total >= LARGE_HASH_BYTES:
        logger.info("hybridcache: hashing %d checkpoint file(s), %.1f GiB, for the engine "
                    "fingerprint (the disk and cluster tiers' links are keyed by the weights' "
                    "content; a digest is remembered, so a restart does not read them again)",
                    len(todo), total / (1 << 30))
    h = hashlib.sha256()
    with Progress(total, "hybridcache: hashing the checkpoint", unit="B", logger=logger,
                  interval_s=PROGRESS_INTERVAL_S) as bar:
        for name, p in files:
            h.update(name.encode() + b"\0")
            h.update(file_digest(p, memo, bar.update).encode() + b"\0")
    return h.hexdigest()


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The weight and config files of a checkpoint folder, where vLLM reads them: the folder's
    own files (vLLM globs `<folder>/*.safetensors` and the like; subfolders such as Llama's
    `original/` are not loaded), or the file itself for a single-file checkpoint (GGUF)."""
    if model_dir.is_file():
        return [model_dir]
    return sorted(p for p in model_dir.iterdir() if p.is_file() and (
        _is_config_file(p.name) or p.suffix in WEIGHT_SUFFIXES))


def weights_digest(model_dir: Path, memo_file: Path | None = None,
                   memo_key: LinkKey | None = None) -> str:
    """sha256 over the names and contents of a checkpoint's weight and config files.

    memo_file: a JSON file remembering file digests by (size, mtime, inode); unreadable or
    damaged memos are ignored (the files are hashed again), never trusted blindly. Raises
    FileNotFoundError when the folder holds no weight file.
    """
    files = checkpoint_files(model_dir)
    if not any(p.suffix in WEIGHT_SUFFIXES for p in files):
        raise FileNotFoundError(f"no weight files under {model_dir}")
    memo = _read_memo(memo_file, memo_key)
    root = model_dir if model_dir.is_dir() else model_dir.parent
    digest = files_digest(((p.relative_to(root).as_posix(), p) for p in files), memo)
    _write_memo(memo_file, memo, memo_key)
    return digest


def processor_digest(folders: Iterable[Path]) -> str:
    """sha256 over a checkpoint's processor files ('none' when it has none)."""
    found = {}
    for folder in folders:
        if folder.is_dir():
            for name in PROCESSOR_FILES:
                p = folder / name
                if p.is_file() and name not in found:
                    found[name] = p
    return files_digest(found.items()) if found else "none"


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


def hub_snapshot(repo_id: str, revision: str | None, cache_dir: str | None) -> Path | None:
    """The Hugging Face cache snapshot of `repo_id` at `revision` under `cache_dir` (None: the
    default hub cache, `HF_HUB_CACHE` / `HF_HOME` as huggingface_hub read them, which is where
    vLLM looks too), or None when the cache has none. Never downloads: `local_files_only`."""
    try:
        from huggingface_hub import constants, snapshot_download

        folder = snapshot_download(repo_id, revision=revision,
                                   cache_dir=cache_dir or constants.HF_HUB_CACHE,
                                   local_files_only=True)
    except Exception:
        return None
    return Path(folder)


def _modelscope() -> bool:
    try:
        import vllm.envs as envs

        return bool(envs.VLLM_USE_MODELSCOPE)
    except Exception:
        return os.environ.get("VLLM_USE_MODELSCOPE", "").lower() in ("1", "true")


def model_folders(vllm_config) -> tuple[Path, Path | None]:
    """Where vLLM loads this engine's checkpoint from: (the weights' folder or single file, the
    folder it read the config from when that is another one), as vLLM's default loader finds
    them: the model path itself when it is local, else the hub cache snapshot of the name
    under `load_config.download_dir` (vLLM's `download_weights_from_hf` passes it as
    `cache_dir`), the config from the default hub cache (vLLM's config loading takes no
    `download_dir`). Raises FingerprintUnavailable when the weights are not local files."""
    mc = vllm_config.model_config
    lc = getattr(vllm_config, "load_config", None)
    load_format = str(getattr(lc, "load_format", None) or "auto").lower()
    if load_format not in FILE_LOAD_FORMATS:
        raise FingerprintUnavailable(
            f"load_format {load_format!r} does not load the weights from checkpoint files "
            "this engine can hash")
    remote = getattr(mc, "model_weights", "") or ""
    if remote:
        raise FingerprintUnavailable(f"the weights are streamed from {remote!r}, not read from "
                                     "local files")
    model = str(mc.model)
    local = Path(model).expanduser()
    if local.is_dir() or local.is_file():
        return local, None
    if _modelscope():
        raise FingerprintUnavailable(f"{model!r} is loaded through ModelScope "
                                     "(VLLM_USE_MODELSCOPE), whose cache this plugin does not "
                                     "read")
    download_dir = getattr(lc, "download_dir", None) or None
    revision = getattr(mc, "revision", None)
    weights = hub_snapshot(model, revision, download_dir)
    if weights is None:
        where = f"--download-dir {download_dir!r}" if download_dir else "the Hugging Face cache"
        raise FingerprintUnavailable(
            f"the checkpoint {model!r} (revision {revision or 'main'}) is neither a local folder "
            f"nor in {where}")
    config = hub_snapshot(model, revision, None) if download_dir else None
    return weights, (config if config is not None and config != weights else None)


def checkpoint_digest(vllm_config, memo_file: Path | None = None,
                      memo_key: LinkKey | None = None) -> tuple[str, str]:
    """('sha256:<weights and config files>', processor digest) of the engine's checkpoint.

    Raises FingerprintUnavailable when the files cannot be found or read."""
    weights_at, config_at = model_folders(vllm_config)
    try:
        files = checkpoint_files(weights_at)
        if not any(p.suffix in WEIGHT_SUFFIXES for p in files):
            raise FileNotFoundError(f"no weight files under {weights_at}")
        root = weights_at if weights_at.is_dir() else weights_at.parent
        named = [(p.relative_to(root).as_posix(), p) for p in files]
        if config_at is not None:
            named += [(f"config-folder/{p.name}", p) for p in checkpoint_files(config_at)
                      if _is_config_file(p.name)]
        memo = _read_memo(memo_file, memo_key)
        weights = files_digest(named, memo)
        _write_memo(memo_file, memo, memo_key)
        processor = processor_digest([f for f in (weights_at, config_at) if f is not None])
    except OSError as e:
        raise FingerprintUnavailable(f"the checkpoint at {weights_at} cannot be hashed "
                                     f"({type(e).__name__}: {e})") from e
    return f"sha256:{weights}", processor


def _json_default(o: object) -> object:
    """Canonical JSON for what vLLM's configs hold beyond JSON; anything else is refused
    (TypeError), never stringified by `repr` (which may carry addresses)."""
    if isinstance(o, enum.Enum):
        return f"{type(o).__name__}.{o.name}"
    if isinstance(o, (set, frozenset)):
        return sorted(json.dumps(x, sort_keys=True, default=_json_default) for x in o)
    if isinstance(o, Path):
        return str(o)
    for method in ("to_dict", "model_dump"):  # transformers configs, pydantic models
        fn = getattr(o, method, None)
        if callable(fn):
            return fn()
    if dataclasses.is_dataclass(o) and not isinstance(o, type):
        return dataclasses.asdict(o)
    if type(o).__module__ == "torch" and type(o).__name__ == "dtype":
        return str(o)
    raise TypeError(f"{type(o).__name__} has no canonical form")


def _strip_private(obj: object) -> object:
    """Drop transformers' bookkeeping keys (`_name_or_path`: the path the config was read
    from, `_commit_hash`, ...): two paths with the same files must agree."""
    if isinstance(obj, dict):
        return {k: _strip_private(v) for k, v in obj.items()
                if not (isinstance(k, str) and k.startswith("_"))}
    if isinstance(obj, (list, tuple)):
        return [_strip_private(v) for v in obj]
    return obj


def canonical_digest(obj: object, what: str, strip_private: bool = False) -> str:
    """'sha256:<hex>' of a canonical JSON of `obj` (keys sorted; `strip_private`: without
    transformers' bookkeeping keys); FingerprintUnavailable names `what` when `obj` has no
    canonical form."""
    try:
        value = json.loads(json.dumps(obj, sort_keys=True, default=_json_default))
        if strip_private:
            value = _strip_private(value)
        text = json.dumps(value, sort_keys=True, separators=(",", ":"))
    except Exception as e:  # a config whose to_dict() fails is no better than one refused
        raise FingerprintUnavailable(f"{what} has no canonical form ({e})") from e
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def _vllm_hash(config: object, what: str) -> str:
    """vLLM's own `compute_hash()` of a sub-config (made for its compile cache: what changes
    the computation graph), 'none' without that config."""
    if config is None:
        return "none"
    fn = getattr(config, "compute_hash", None)
    if not callable(fn):
        raise FingerprintUnavailable(f"{what} has no compute_hash()")
    try:
        return str(fn())
    except Exception as e:
        raise FingerprintUnavailable(f"vLLM's hash of {what} failed ({type(e).__name__}: {e})"
                                     ) from e


def model_settings(vllm_config) -> dict[str, str]:
    """The model-side settings that change the arithmetic beyond the files (see module)."""
    mc = vllm_config.model_config
    lc = getattr(vllm_config, "load_config", None)
    hf_config = getattr(mc, "hf_config", None)
    overrides = getattr(mc, "hf_overrides", None) or {}
    if callable(overrides):  # its effect is in hf_config; the function is named here
        overrides_field = (f"callable:{getattr(overrides, '__module__', '')}."
                           f"{getattr(overrides, '__qualname__', type(overrides).__name__)}")
    else:
        overrides_field = canonical_digest(overrides, "hf_overrides")
    mm = getattr(mc, "multimodal_config", None)
    multimodal = "none"
    if mm is not None:
        kwargs = canonical_digest(getattr(mm, "mm_processor_kwargs", None) or {},
                                  "mm_processor_kwargs")
        multimodal = (f"kwargs={kwargs};"
                      f"encoder={_vllm_hash(mm, 'multimodal_config')};"
                      f"language_only={int(bool(getattr(mm, 'language_model_only', False)))}")
    return {
        "hf_config": ("none" if hf_config is None
                      else canonical_digest(hf_config, "the model's hf_config", True)),
        "hf_overrides": overrides_field,
        "quantization": str(getattr(mc, "quantization", None) or "none"),
        "quantization_config": canonical_digest(
            {"engine": getattr(mc, "quantization_config", None),
             "checkpoint": getattr(hf_config, "quantization_config", None)},
            "the quantization config"),
        "load_format": str(getattr(lc, "load_format", None) or "auto").lower(),
        "model_impl": str(getattr(mc, "model_impl", None) or "auto"),
        "multimodal": multimodal,
        "compilation": _vllm_hash(getattr(vllm_config, "compilation_config", None),
                                  "compilation_config"),
        "lora": _vllm_hash(getattr(vllm_config, "lora_config", None), "lora_config"),
    }


def triton_version() -> str:
    """The importable Triton's version ('none' without one): its kernels (vLLM's GDN and
    attention ops on GPUs) change with it."""
    import importlib.util

    try:
        if importlib.util.find_spec("triton") is None:
            return "none"
    except (ImportError, ValueError):
        return "none"
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("triton", "pytorch-triton-rocm", "pytorch-triton", "triton-xpu"):
        try:
            return f"{dist}=={version(dist)}"
        except PackageNotFoundError:
            continue
    try:
        import triton

        return f"triton=={triton.__version__}"
    except Exception as e:
        return f"unimportable:{type(e).__name__}"


def kernel_backend(vllm_config) -> str:
    """The kernel choices that change an engine's arithmetic beyond the device: vLLM's device
    type and attention backend setting, the Flash-Next implementation, kernel backend and
    split-invariant forward chosen by our environment variables (empty = the platform
    default) with, on CPU, the form of its GEMMs, and the pin of vLLM's CPU attention or our
    split-invariant kernel when either computes vLLM's attention."""
    from vllm_hybridcache.compat import split_attention_plan
    from vllm_hybridcache.config import (
        FLASH_NEXT_IMPL_ENV,
        FLASH_NEXT_OPS_ENV,
        cpu_attention_pinned,
    )
    from vllm_hybridcache.flash_next.ops import split_invariant

    device = str(getattr(getattr(vllm_config, "device_config", None), "device_type", ""))
    attn = os.environ.get("VLLM_ATTENTION_BACKEND", "")
    # the CPU attention pin changes the attention's bits; named only when on, so engines
    # without it keep their fingerprint
    pinned = ";cpu_attention_split_invariant=1" if cpu_attention_pinned() else ""
    if not pinned and split_attention_plan(vllm_config)[0]:
        pinned = ";cpu_attention_split_invariant=kernel"
    # the split-invariant forward's GEMM form (row-invariant kernel or 64-row tiles) changes
    # its bits too; named only when the forward is on
    invariant = "0"
    if split_invariant.enabled(vllm_config) and _auto_applies(vllm_config):
        invariant = "1"
        if device == "cpu":
            form = split_invariant.invariant_form()
            invariant += f";flash_next_invariant_form={form}"
            if form == "rowwise":  # the kernel's sums differ by host ISA and by dtype
                from vllm_hybridcache.ops import rowwise_linear

                sums = rowwise_linear.arithmetic() if rowwise_linear.available() else "unbuilt"
                invariant += f";rowwise_arithmetic={sums}"
    return (f"device={device};attention={attn};flash_next_impl="
            f"{os.environ.get(FLASH_NEXT_IMPL_ENV, '')};flash_next_ops="
            f"{os.environ.get(FLASH_NEXT_OPS_ENV, '')};flash_next_split_invariant="
            f"{invariant}{pinned}")


def _auto_applies(vllm_config) -> bool:
    """Whether the split-invariant forward's `auto` answer concerns this engine's model: only
    Flash-Next (a class with `inner_capture_plan`) runs it, so `auto` names it for no other
    model (a setting of `1` is named as set, whatever the model)."""
    from vllm_hybridcache.flash_next.ops import split_invariant

    if split_invariant.setting() != split_invariant.AUTO:
        return True
    try:
        from vllm.model_executor.models import ModelRegistry

        mc = vllm_config.model_config
        cls, _ = ModelRegistry.resolve_model_cls(mc.architectures, mc)
    except Exception:
        return False
    return hasattr(cls, "inner_capture_plan")


def speculative_setup(vllm_config) -> str:
    """The speculative decoding settings that shape a draft or verify batch ('' without)."""
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None:
        return ""
    return (f"method={spec.method};k={spec.num_speculative_tokens};padded="
            f"{int(not spec.disable_padded_drafter_batch)};parallel="
            f"{int(bool(getattr(spec, 'parallel_drafting', False)))}")


def engine_fingerprint(vllm_config, layout_digest: str, segmentation: str, backend: str,
                       memo_file: Path | None = None,
                       memo_key: LinkKey | None = None) -> Fingerprint:
    """The fingerprint of this engine (see the module docstring for what goes in and why).

    Raises FingerprintUnavailable when the checkpoint's weights cannot be found and hashed, or
    a setting has no canonical form: the caller then runs without the tiers that outlive the
    engine (never a fingerprint by name).
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
    weights, processor = checkpoint_digest(vllm_config, memo_file, memo_key)
    fields = {
        "weights": weights,
        "processor": processor,
        **model_settings(vllm_config),
        "dtype": str(mc.dtype),
        "kv_cache_dtype": str(cc.cache_dtype),
        "mamba_ssm_dtype": str(getattr(cc, "mamba_ssm_cache_dtype", "")),
        "layout": layout_digest,
        "backend": backend,
        "device": gpu_arch() or cpu_isa(),
        "torch": torch.__version__,
        "torch_cuda": str(torch.version.cuda or "none"),
        "torch_hip": str(getattr(torch.version, "hip", None) or "none"),
        "triton": triton_version(),
        "vllm": vllm_version,
        "plugin": vllm_hybridcache.__version__,
        "segmentation": segmentation,
        "speculative": speculative_setup(vllm_config),
    }
    return make_fingerprint(fields)
