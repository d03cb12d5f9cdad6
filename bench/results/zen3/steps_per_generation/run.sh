#!/bin/bash
# A/B: steps_per_generation 1 vs 2 on the SmolLM2 task preset (C 32, and C 96), interleaved, 8 steps each;
# then the table: per run, seconds per optimizer step (generation, training) after the warm-up
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
.venv/bin/python - "${OUT:-/tmp/spgb}" <<'EOF'
import glob
import json
import sys


def main(out: str) -> None:
    for path in sorted(glob.glob(out + "/c*-r*-s*/metrics.jsonl")):
        records = [json.loads(line) for line in open(path) if '"loss"' in line]
        name = path.split("/")[-2]
        spg = int(name[-1])
        records = records[1:] if spg == 2 else records[2:]  # the first two optimizer steps: warm-up
        steps = len(records) * spg

        def seconds(r):
            return r["time_generate_s"] + r["time_reward_s"] + r["time_train_s"]

        total = sum(seconds(r) for r in records) / steps
        generate = sum(r["time_generate_s"] for r in records) / steps
        train = sum(r["time_train_s"] for r in records) / steps
        tokens_s = sum(r["tokens_per_s"] * seconds(r) for r in records) / (total * steps)
        skipped = sum(r["zero_advantage_groups_skipped"] for r in records) / (steps * 4)
        length = sum(r["completion_len_mean"] for r in records) / len(records)
        per_group = train * steps / max(1e-9, steps * 4 * (1 - skipped))  # 4 prompts a step
        row = [name, steps, f"{total:.2f}", f"{generate:.2f}", f"{train:.2f}", f"{per_group:.2f}"]
        row += [f"{tokens_s:.0f}", f"{skipped:.2f}", f"{length:.1f}"]
        print("| " + " | ".join(map(str, row)) + " |")


main(sys.argv[1])
EOF
