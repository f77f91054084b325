#!/usr/bin/env bash
# The reward-model check of the pipeline, on a CPU in about half a minute: does a GRPO policy trained
# against OUR reward model raise that reward model's reward on HELD-OUT prompts, for its greedy answers
# (not only the mean over its training samples)?
#   SFT (the reward model's base) -> reward model -> GRPO from the quickstart's base model (which rambles)
#   against that reward model -> the reward model scores the greedy answers to 64 held-out prompts
#   (examples/data/eval.jsonl, never seen in any stage) of the policy before and after GRPO.
# Run from the repository root: bash examples/pipeline/rm_check.sh [OUT_DIR] [SEED]   (default runs/rm_check 0)
# It prints one line: "rm check: held-out greedy reward-model reward BEFORE -> AFTER (sft model: SFT)".
# Why the base model and not the SFT model: docs/objectives.md, "A policy against our reward model".
set -euo pipefail
OUT=${1:-runs/rm_check}
SEED=${2:-0}
P=examples/pipeline
QUIET="--seed $SEED --no-progress"

rlhf sft --model examples/tiny-model --data $P/sft.jsonl --max-samples 200 --batch-size 32 \
    --micro-batch-size 16 --epochs 2 --lr 1e-4 $QUIET --out $OUT/sft
rlhf rm --model $OUT/sft/final --data $P/pairs.jsonl --batch-size 16 --micro-batch-size 16 --lr 5e-4 \
    --normalize-reward $QUIET --out $OUT/rm
rlhf train --algo grpo --model examples/tiny-model --data examples/data/train.jsonl --input-key prompt \
    --reward $OUT/rm/final --n-samples 4 --prompts-per-step 16 --max-new-tokens 12 --steps 30 --lr 1e-4 \
    $QUIET --out $OUT/grpo

held_out() {  # the reward model's mean reward for MODEL's greedy answers to the held-out prompts
    rlhf eval --model "$1" --data examples/data/eval.jsonl --max-samples 64 --reward $OUT/rm/final \
        --temperature 0 --n-samples 1 --max-new-tokens 12 --seed "$SEED" --json --out "$2" \
        | python -c 'import json, sys; print(json.load(sys.stdin)["eval/reward/mean"])'
}
BEFORE=$(held_out examples/tiny-model $OUT/greedy_before.jsonl)
AFTER=$(held_out $OUT/grpo/final $OUT/greedy_after.jsonl)
SFT=$(held_out $OUT/sft/final $OUT/greedy_sft.jsonl)
python -c "print(f'rm check: held-out greedy reward-model reward {$BEFORE:.2f} -> {$AFTER:.2f} (sft model: {$SFT:.2f})')"
