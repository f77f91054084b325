"""Make the toy data of the whole pipeline (README "The whole pipeline"), offline, in a second.

The task is the quickstart's (examples/make_quickstart_model.py): two-number addition, "23+45="
-> "68". Its model adds but rambles ("68, so 45+23=68"). The preferred answer is the bare
correct sum; a rejected answer is either the sum followed by a restatement (half of the pairs)
or a wrong sum (the other half: one digit changed).

Prompts come from examples/data/train.jsonl (training files) and examples/data/eval.jsonl
(held-out files), so nothing held out was seen in any training stage.

Writes, into examples/pipeline/ (deterministic for a given --seed):
  sft.jsonl         {"prompt", "response"}                the bare correct sum
  sft_eval.jsonl    held-out SFT rows
  pairs.jsonl       {"prompt", "chosen", "rejected"}      preference pairs
  pairs_eval.jsonl  held-out pairs
  kto.jsonl         {"prompt", "completion", "label"}     each pair's answers, unpaired
  kto_eval.jsonl    held-out KTO rows
  steps.jsonl       {"input", "label"}                    process rewards: chains of additions, "@" after
                                                          each step, labels "+" (right) or "-" (wrong)
  steps_eval.jsonl  held-out chains

    python examples/pipeline/make_data.py [--seed 0] [--out examples/pipeline]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
DATA = HERE.parent / "data"


def problems(path: Path) -> list[tuple[int, int]]:
    out = []
    for line in path.read_text().splitlines():
        a, b = json.loads(line)["prompt"].rstrip("=").split("+")
        out.append((int(a), int(b)))
    return out


def wrong_sum(total: int, rng: random.Random) -> str:
    """The sum with one digit changed (never the right sum, never a leading zero)."""
    digits = list(str(total))
    while True:
        position = rng.randrange(len(digits))
        choices = [d for d in "0123456789" if d != digits[position] and not (d == "0" and position == 0
                                                                               and len(digits) > 1)]
        changed = digits[:position] + [rng.choice(choices)] + digits[position + 1:]
        return "".join(changed)


def pair(a: int, b: int, rng: random.Random) -> dict[str, str]:
    total = a + b
    rejected = (f"{total}, so {b}+{a}={total}" if rng.random() < 0.5 else wrong_sum(total, rng))
    return {"prompt": f"{a}+{b}=", "chosen": str(total), "rejected": rejected}


def chain(a: int, b: int, rng: random.Random, steps: int = 3) -> dict[str, object]:
    """``a+b=c @ c+d=e @ ...``, each step's sum wrong with probability 1/2 (the chain goes on from
    what was written)."""
    text, labels, current, term = [], [], a, b
    for _ in range(steps):
        total = current + term
        right = rng.random() < 0.5
        written = str(total) if right else wrong_sum(total, rng)
        text.append(f"{current}+{term}={written} @")
        labels.append("+" if right else "-")
        current, term = int(written), rng.randrange(1, 10)
    return {"input": " ".join(text), "label": labels}


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(HERE))
    parser.add_argument("--train", type=int, default=1000, help="rows of each training file")
    parser.add_argument("--eval", type=int, default=200, help="rows of each held-out file")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    train, held_out = problems(DATA / "train.jsonl")[:args.train], problems(DATA / "eval.jsonl")[:args.eval]

    write_jsonl(out / "sft.jsonl", [{"prompt": f"{a}+{b}=", "response": str(a + b)} for a, b in train])
    write_jsonl(out / "sft_eval.jsonl", [{"prompt": f"{a}+{b}=", "response": str(a + b)} for a, b in held_out])
    pairs = [pair(a, b, rng) for a, b in train]
    eval_pairs = [pair(a, b, rng) for a, b in held_out]
    write_jsonl(out / "pairs.jsonl", pairs)
    write_jsonl(out / "pairs_eval.jsonl", eval_pairs)
    for name, rows in (("kto.jsonl", pairs), ("kto_eval.jsonl", eval_pairs)):
        unpaired = []
        for row in rows:  # one of the two answers per prompt, so desirable and undesirable are unpaired
            desirable = rng.random() < 0.5
            unpaired.append({"prompt": row["prompt"], "completion": row["chosen" if desirable else "rejected"],
                             "label": desirable})
        write_jsonl(out / name, unpaired)
    write_jsonl(out / "steps.jsonl", [chain(a, b, rng) for a, b in train])
    write_jsonl(out / "steps_eval.jsonl", [chain(a, b, rng) for a, b in held_out])
    print(f"wrote {len(train)} training and {len(held_out)} held-out rows per file to {out}")


if __name__ == "__main__":
    main()
