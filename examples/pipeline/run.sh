#!/usr/bin/env bash
# The whole pipeline on the toy addition task, on a CPU in a few minutes (README "The whole pipeline"):
#   SFT -> reward model -> PPO with that reward model, and SFT -> DPO.
# Run from the repository root: bash examples/pipeline/run.sh [OUT_DIR]   (default runs/pipeline)
set -euo pipefail
OUT=${1:-runs/pipeline}
P=examples/pipeline

rlhf sft --model examples/tiny-model --data $P/sft.jsonl --eval-data $P/sft_eval.jsonl --max-samples 200 \
    --batch-size 32 --micro-batch-size 16 --epochs 2 --lr 1e-4 --out $OUT/sft
rlhf rm --model $OUT/sft/final --data $P/pairs.jsonl --eval-data $P/pairs_eval.jsonl \
    --batch-size 16 --micro-batch-size 16 --lr 5e-4 --eval-every 25 --normalize-reward --out $OUT/rm
rlhf train --algo ppo --model $OUT/sft/final --data examples/data/train.jsonl --input-key prompt \
    --reward $OUT/rm/final --n-samples 4 --prompts-per-step 16 --max-new-tokens 12 --steps 30 --lr 1e-4 \
    --out $OUT/ppo
rlhf dpo --model $OUT/sft/final --data $P/pairs.jsonl --eval-data $P/pairs_eval.jsonl \
    --batch-size 32 --micro-batch-size 16 --lr 1e-4 --beta 0.1 --eval-every 10 --out $OUT/dpo
python $P/report.py $OUT
