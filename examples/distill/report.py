"""Print what on-policy distillation did (examples/distill/run.sh): the student's reverse KL to the
teacher and its greedy exact match on held-out prompts, before and after.

    python examples/distill/report.py --student examples/tiny-model --distilled runs/distill/opd/final \\
        --teacher runs/distill/sft/final [--json report.json]

The held-out prompts are the first 64 of examples/data/eval.jsonl (in no stage's training data).
Reverse KL: KL(π_S ‖ π_T) = Σ_v π_S(v) (log π_S(v) − log π_T(v)), exact over the whole vocabulary,
at every position of 4 completions the student samples per prompt (temperature 1), up to and with its
end-of-sequence token, summed over the completion and averaged over completions: the quantity
`--algo opd` descends, measured on prompts it never trained on. Exact match: the greedy answer,
stripped, equals the prompt's "answer".

Shape legend: ``B`` sequences, ``P`` prompt tokens, ``N`` new tokens, ``V`` vocabulary.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

HELD_OUT_FILE = Path(__file__).resolve().parents[1] / "data" / "eval.jsonl"


def held_out_rows(count: int = 64) -> list[dict]:
    return [json.loads(line) for line in HELD_OUT_FILE.read_text().splitlines()][:count]


def held_out_figures(student_dir: str | Path, teacher_dir: str | Path, samples: int = 4,
                     max_new: int = 12) -> tuple[float, float]:
    """(greedy exact-match accuracy, reverse KL per completion) of the student on the held-out prompts."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rows = held_out_rows()
    tokenizer = AutoTokenizer.from_pretrained(student_dir)  # left padding
    student = AutoModelForCausalLM.from_pretrained(student_dir).eval()
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir).eval()
    prompts = tokenizer([row["prompt"] for row in rows], return_tensors="pt", padding=True)
    width = prompts.input_ids.shape[1]
    with torch.no_grad():
        greedy = student.generate(**prompts, do_sample=False, max_new_tokens=max_new,
                                  pad_token_id=tokenizer.pad_token_id)
        answers = tokenizer.batch_decode(greedy[:, width:], skip_special_tokens=True)
        accuracy = sum(a.strip() == row["answer"] for a, row in zip(answers, rows)) / len(rows)
        torch.manual_seed(0)
        input_ids = prompts.input_ids.repeat_interleave(samples, 0)  # (B, P)
        attention = prompts.attention_mask.repeat_interleave(samples, 0)  # (B, P)
        out = student.generate(input_ids=input_ids, attention_mask=attention, do_sample=True, temperature=1.0,
                               top_k=0, top_p=1.0, max_new_tokens=max_new, pad_token_id=tokenizer.pad_token_id)
        new = out[:, width:]  # (B, N)
        is_eos = (new == tokenizer.eos_token_id).long()  # (B, N)
        alive = (is_eos.cumsum(1) - is_eos) == 0  # (B, N) up to and with the first EOS
        mask = torch.cat([attention, alive.long()], dim=1)  # (B, P + N)
        positions = (mask.cumsum(1) - 1).clamp(min=0)  # (B, P + N)
        log_s = torch.log_softmax(student(out, attention_mask=mask, position_ids=positions).logits[:, width - 1:-1]
                                  .float(), dim=-1)  # (B, N, V)
        log_t = torch.log_softmax(teacher(out, attention_mask=mask, position_ids=positions).logits[:, width - 1:-1]
                                  .float(), dim=-1)  # (B, N, V)
        kl = (log_s.exp() * (log_s - log_t)).sum(-1) * alive  # (B, N)
    return accuracy, float(kl.sum() / out.shape[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--student", required=True, help="the student before distillation")
    parser.add_argument("--distilled", required=True, help="the student after (the run's final/)")
    parser.add_argument("--teacher", required=True)
    parser.add_argument("--json", help="also write the four figures here")
    args = parser.parse_args()
    accuracy_before, kl_before = held_out_figures(args.student, args.teacher)
    accuracy_after, kl_after = held_out_figures(args.distilled, args.teacher)
    print(f"opd: held-out reverse KL to the teacher {kl_before:.3f} -> {kl_after:.3f}, "
          f"greedy exact match {accuracy_before:.2f} -> {accuracy_after:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"kl_before": kl_before, "kl_after": kl_after,
                                               "exact_match_before": accuracy_before,
                                               "exact_match_after": accuracy_after}) + "\n")


if __name__ == "__main__":
    main()
