#!/bin/bash
# A/B: steps_per_generation 1 vs 2 on the SmolLM2 task preset (C 32, and C 96), interleaved, 8 steps each
cd "$(dirname "$0")/../../../.."
rm -rf ${OUT:-/tmp/spgb}; mkdir -p ${OUT:-/tmp/spgb}
for rep in 1 2; do
  for C in 32 96; do
    for spg in 1 2; do
      out=${OUT:-/tmp/spgb}/c$C-r$rep-s$spg
      .venv/bin/python -m grpo_fast.train --task smollm2 --output-dir $out --max-steps 8 --eval-steps 0 \
        --eval-max-samples 0 --save-steps 0 --time-budget-s 0 --steps-per-generation $spg \
        --max-completion-length $C > $out.log 2>&1
    done
  done
done
