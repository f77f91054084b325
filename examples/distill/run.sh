#!/usr/bin/env bash
# On-policy distillation on a CPU in about a minute: the pipeline's SFT model (bare answers, "68") is
# the teacher, the quickstart's untrained tiny base (which rambles: "68, so 45+23=68") the student.
# `rlhf train --algo opd` samples from the student and rewards each token with minus its reverse KL
# to the teacher (no reward function at all), 40 steps; report.py then prints the student's reverse KL
# to the teacher and its greedy exact match on 64 held-out prompts, before and after.
# Run from the repository root: bash examples/distill/run.sh [OUT_DIR] [TEACHER_DIR]
#   (default runs/distill; without TEACHER_DIR the SFT teacher is trained first, as examples/pipeline/run.sh does)
set -euo pipefail
OUT=${1:-runs/distill}
TEACHER=${2:-}
P=examples/pipeline

if [ -z "$TEACHER" ]; then
    rlhf sft --model examples/tiny-model --data $P/sft.jsonl --max-samples 200 --batch-size 32 \
        --micro-batch-size 16 --epochs 2 --lr 1e-4 --seed 0 --no-progress --out $OUT/sft
    TEACHER=$OUT/sft/final
fi
rlhf train --algo opd --teacher "$TEACHER" --model examples/tiny-model --data examples/data/train.jsonl \
    --input-key prompt --n-samples 4 --prompts-per-step 8 --max-new-tokens 12 --steps 40 --lr 1e-4 --seed 0 \
    --no-progress --out $OUT/opd
python examples/distill/report.py --student examples/tiny-model --distilled $OUT/opd/final --teacher "$TEACHER" \
    --json $OUT/report.json
