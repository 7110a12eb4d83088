#!/usr/bin/env bash
# One-command smoke test on a real AMD box (R9700 or Strix Halo), from the repository root:
#
#   deploy/smoke.sh                 # GPU_TARGET from rocminfo, else gfx1201
#   GPU_TARGET=gfx1151 BASE_TAG=v0.32.0 deploy/smoke.sh
#
# Builds the image, checks the copy kernels on the GPU (bit-exact vs torch, timings), starts the
# server on the embedded flash-next-tiny model, runs the exactness check (warm == cold, bit for
# bit) and the cache-on/off TTFT comparison, and prints one report. Needs docker and python3 on
# the host; leaves nothing running (containers are removed on exit; the volume is kept for the
# Triton cache and removed with `docker volume rm hybridcache-smoke`).
set -euo pipefail
cd "$(dirname "$0")/.."

detect_target() {
  if command -v rocminfo >/dev/null 2>&1; then
    rocminfo 2>/dev/null | grep -oE 'gfx1(151|201)' | head -n1
  fi
}
GPU_TARGET=${GPU_TARGET:-$(detect_target)}
GPU_TARGET=${GPU_TARGET:-gfx1201}
BASE_TAG=${BASE_TAG:-v0.32.0}
IMAGE=${IMAGE:-vllm-hybridcache:rocm-${GPU_TARGET}}
PORT=${PORT:-18000}
VOLUME=hybridcache-smoke
MODEL=flash-next-tiny
RENDER_GID=${RENDER_GID:-$(getent group render | cut -d: -f3 || true)}
OUT=$(mktemp -d)
NAME=hybridcache-smoke-$$

GPU_ARGS=(--device /dev/kfd --device /dev/dri --group-add video --ipc=host
          --security-opt seccomp=unconfined)
if [[ -n "${RENDER_GID}" ]]; then GPU_ARGS+=(--group-add "${RENDER_GID}"); fi

cleanup() { docker rm -f "${NAME}" >/dev/null 2>&1 || true; }
trap cleanup EXIT

log() { printf '== %s\n' "$*" | tee -a "${OUT}/report.txt"; }

log "build ${IMAGE} (GPU_TARGET=${GPU_TARGET}, base tag ${BASE_TAG})"
docker build -f Dockerfile.rocm --build-arg GPU_TARGET="${GPU_TARGET}" \
  --build-arg BASE_TAG="${BASE_TAG}" -t "${IMAGE}" . >"${OUT}/build.log" 2>&1 \
  || { tail -n 40 "${OUT}/build.log"; exit 1; }

log "copy kernels on the GPU (csrc / triton / torch vs index ops)"
docker run --rm "${GPU_ARGS[@]}" -v "${VOLUME}:/cache" --entrypoint python3 "${IMAGE}" \
  -m vllm_hybridcache.ops.selfcheck | tee -a "${OUT}/report.txt"

log "embedded model ${MODEL}"
MODEL_PATH=$(docker run --rm -v "${VOLUME}:/cache" --entrypoint vllm-hybridcache "${IMAGE}" \
  make-model "${MODEL}" | tail -n1)
echo "${MODEL_PATH}" | tee -a "${OUT}/report.txt"

serve() {  # $1: label, $2: cache budget in bytes ("" = default), rest: extra vLLM flags
  local label=$1 budget=$2; shift 2
  local env_args=()
  if [[ -n "${budget}" ]]; then env_args=(-e "VLLM_HYBRIDCACHE_BUDGET_BYTES=${budget}"); fi
  cleanup
  docker run -d --name "${NAME}" "${GPU_ARGS[@]}" -p "127.0.0.1:${PORT}:8000" \
    -v "${VOLUME}:/cache" "${env_args[@]}" "${IMAGE}" "${MODEL_PATH}" \
    --served-model-name "${MODEL}" --max-model-len 16384 "$@" >/dev/null
  for _ in $(seq 1 180); do
    if curl -fs "http://127.0.0.1:${PORT}/health" >/dev/null 2>&1; then
      log "${label}: server up"; return 0
    fi
    if [[ "$(docker inspect -f '{{.State.Running}}' "${NAME}")" != true ]]; then break; fi
    sleep 5
  done
  docker logs --tail 60 "${NAME}"; log "${label}: server did not come up"; exit 1
}

URL="http://127.0.0.1:${PORT}"
serve cache-on ""
log "exactness: warm == cold"
EXACT=0
python3 deploy/smoke_client.py exact --url "${URL}" --model "${MODEL}" \
  >>"${OUT}/report.txt" || EXACT=$?
tail -n1 "${OUT}/report.txt"
python3 deploy/smoke_client.py ttft --url "${URL}" --model "${MODEL}" --label on \
  --out "${OUT}/on.json"
curl -fs "${URL}/metrics" | grep -E '^vllm:hybridcache_(hits|lookups|cached_tokens)_total' \
  >>"${OUT}/report.txt" || true

# Cache off = the plugin's budget 0 plus vLLM's own prefix caching off (for hybrid models vLLM
# would otherwise turn on its align mode, which Flash-Next's recurrent layers do not support).
serve cache-off 0 --no-enable-prefix-caching
python3 deploy/smoke_client.py ttft --url "${URL}" --model "${MODEL}" --label off \
  --out "${OUT}/off.json"

log "TTFT per turn, cache on vs off"
python3 deploy/smoke_client.py report "${OUT}/on.json" "${OUT}/off.json" \
  | tee -a "${OUT}/report.txt"
printf '\nreport: %s\n' "${OUT}/report.txt"
if [[ ${EXACT} -ne 0 ]]; then echo "FAILED: warm != cold (see the exactness line)"; exit 1; fi
echo "smoke test passed"
