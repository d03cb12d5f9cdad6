#!/usr/bin/env bash
# The GPU suite as one command, for a machine with the GPU's own python3 and no network:
#     bash bench/gpu_suite.sh OUTDIR [--dry-run]
# Wheels placed in bench/wheels/ (`make gpu-wheels`: TRL and its missing dependencies, Liger) are installed
# first; rows needing what is missing are skipped and say so. Ends within 470 s (bench/gpu_suite.py's budget,
# enforced here too). --dry-run: tiny shapes on the CPU. Exit status 1 when a section errored.
# The commit measured: GRPO_FAST_GIT_COMMIT if set (a copy of the tree without .git), else git's HEAD here.
set -uo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
out="$(mkdir -p "${1:-$repo/bench/results/h200}" && cd "${1:-$repo/bench/results/h200}" && pwd)"
shift || true
if [ -z "${GRPO_FAST_GIT_COMMIT:-}" ] && head="$(git -C "$repo" rev-parse --short HEAD 2>/dev/null)"; then
  dirty="$(git -C "$repo" status --porcelain --untracked-files=no -- . ':!bench/results' 2>/dev/null)"
  GRPO_FAST_GIT_COMMIT="$head${dirty:+-dirty}"
fi
export GRPO_FAST_GIT_COMMIT="${GRPO_FAST_GIT_COMMIT:-unknown}"
site="$(mktemp -d)"
trap 'rm -rf "$site"' EXIT
if compgen -G "$repo/bench/wheels/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" "$repo"/bench/wheels/*.whl \
    || echo "gpu_suite: could not install the wheels in bench/wheels; going on without them"
fi
# grpo_fast with kernels/ at grpo_fast/kernels, as the package installs it, without pip or network
mkdir -p "$site/grpo_fast"
cp -r "$repo"/grpo_fast/. "$site/grpo_fast/"
cp -r "$repo/kernels" "$site/grpo_fast/kernels"
cp -r "$repo/bench" "$site/bench"
rm -rf "$site/bench/wheels" "$site/bench/results"
case " $* " in *" --dry-run "*) export TRITON_INTERPRET=1 ;; esac
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
cd "$site" && timeout 470 python3 -m bench.gpu_suite "$out" "$@"
