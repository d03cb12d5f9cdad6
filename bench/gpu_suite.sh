#!/usr/bin/env bash
# The GPU suite as one command, for a machine with the GPU's own python3 and no network:
#     bash bench/gpu_suite.sh OUTDIR [--dry-run]
# Wheels placed in bench/wheels/ (liger-kernel, ...) are installed first; what is missing is skipped and said.
# Finishes in under 8 minutes on an H200 (a 470 s limit guards it). --dry-run: tiny shapes on the CPU.
set -uo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
out="$(mkdir -p "${1:-$repo/bench/results/h200}" && cd "${1:-$repo/bench/results/h200}" && pwd)"
shift || true
site="$(mktemp -d)"
if compgen -G "$repo/bench/wheels/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" "$repo"/bench/wheels/*.whl \
    || echo "gpu_suite: could not install the wheels in bench/wheels; going on without them"
fi
# grpo_fast with kernels/ at grpo_fast/kernels, as the package installs it, without pip or network
mkdir -p "$site/grpo_fast"
cp -r "$repo"/grpo_fast/. "$site/grpo_fast/"
cp -r "$repo/kernels" "$site/grpo_fast/kernels"
cp -r "$repo/bench" "$site/bench"
case " $* " in *" --dry-run "*) export TRITON_INTERPRET=1 ;; esac
cd "$site" && PYTHONPATH="$site" timeout 470 python3 -m bench.gpu_suite "$out" "$@"
status=$?
rm -rf "$site"
exit $status
