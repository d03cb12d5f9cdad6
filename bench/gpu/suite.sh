#!/usr/bin/env bash
# The GPU suite as one command, for a machine with the GPU's own python3 and no network:
#     bash bench/gpu/suite.sh OUTDIR [--budget S] [--tier 1|2] [--sections a,b] [--dry-run]
# Wheels placed in bench/wheels/ (`make gpu-wheels`: TRL and its missing dependencies, Liger, CCE) are
# installed first; rows needing what is missing are skipped and say so. A compile cache of an earlier loan in
# bench/gpu_cache/compile_cache.tar.gz (carried) is restored. The suite's deadline is --budget (default
# bench/gpu/suite.py's BUDGET_S, 480 s); this script kills it at budget + SHELL_MARGIN_S whatever happens.
# Everything printed also lands in OUTDIR/gpu_suite.log. Exit status 1 when a section errored, 124 on a kill.
# The commit measured: GRPO_FAST_GIT_COMMIT if set (a copy of the tree without .git), else git's HEAD here.
set -uo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
out="$(mkdir -p "${1:-$repo/bench/results/h200}" && cd "${1:-$repo/bench/results/h200}" && pwd)"
shift || true
if [ -z "${GRPO_FAST_GIT_COMMIT:-}" ] && head="$(git -C "$repo" rev-parse --short HEAD 2>/dev/null)"; then
  dirty="$(git -C "$repo" status --porcelain --untracked-files=no -- . ':!bench/results' 2>/dev/null)"
  GRPO_FAST_GIT_COMMIT="$head${dirty:+-dirty}"
fi
export GRPO_FAST_GIT_COMMIT="${GRPO_FAST_GIT_COMMIT:-unknown}"
site="$(mktemp -d)"
trap 'rm -rf "$site"' EXIT
log="$out/gpu_suite.log"
: > "$log"
if compgen -G "$repo/bench/wheels/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" "$repo"/bench/wheels/*.whl \
    2>&1 | tee -a "$log" || echo "gpu_suite: could not install the wheels in bench/wheels; going on without them"
fi
# grpo_fast with kernels/ at grpo_fast/kernels, as the package installs it, without pip or network
mkdir -p "$site/grpo_fast"
cp -r "$repo"/grpo_fast/. "$site/grpo_fast/"
cp -r "$repo/kernels" "$site/grpo_fast/kernels"
cp -r "$repo/bench" "$site/bench"
rm -rf "$site/bench/wheels" "$site/bench/results" "$site/bench/gpu_cache"
cache=()
[ -f "$repo/bench/gpu_cache/compile_cache.tar.gz" ] && cache=(--cache-from "$repo/bench/gpu_cache/compile_cache.tar.gz")
# a dry run is on this CPU: the carried cache holds the GPU's compiled graphs (another torch, CUDA code), so
# it starts cold
case " $* " in *" --dry-run "*) export TRITON_INTERPRET=1; cache=() ;; esac
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
cd "$site" || exit 1
limit="$(python3 -c 'import sys; from bench.gpu import suite as g; print(g.budget_of(sys.argv[1:]) + g.SHELL_MARGIN_S)' \
  "$@")" || exit 2
# SIGTERM first (the suite records the section in flight), SIGKILL 5 s later
timeout -k 5 "$limit" python3 -m bench.gpu.suite "$out" "${cache[@]}" "$@" 2>&1 | tee -a "$log"
