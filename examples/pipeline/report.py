"""Print the figures of a pipeline run (examples/pipeline/run.sh): python report.py OUT_DIR."""

import json
import sys
from pathlib import Path


def metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def main(out: Path) -> None:
    def last_eval(stage: str) -> dict:
        return [m for m in metrics(out / stage / "metrics.jsonl") if "eval/loss" in m][-1]

    sft = metrics(out / "sft" / "metrics.jsonl")
    print(f"sft: train loss {sft[0]['train/loss']:.3f} at step 1 -> held-out loss {last_eval('sft')['eval/loss']:.3f}")
    rm = last_eval("rm")
    print(f"rm:  held-out pair accuracy {rm['eval/accuracy']:.3f}, mean margin {rm['eval/margin']:.2f}")
    rewards = [m["reward/mean"] for m in metrics(out / "ppo" / "metrics.jsonl")]
    tenth = max(1, len(rewards) // 3)
    print(f"ppo: reward-model reward {sum(rewards[:tenth]) / tenth:.2f} (first {tenth} steps) -> "
          f"{sum(rewards[-tenth:]) / tenth:.2f} (last {tenth} steps)")
    dpo = last_eval("dpo")
    print(f"dpo: held-out implicit-reward accuracy {dpo['eval/accuracy']:.3f}, margin {dpo['eval/margin']:.2f}")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "runs/pipeline"))
