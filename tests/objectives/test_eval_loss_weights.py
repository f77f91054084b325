"""The fit loop's eval (rlhf/runtime/fit/loop.py, ``FitLoop.evaluate``) weighs each micro-batch's loss
by its units, as docs/objectives.md says: tokens for ``sft`` (the mean NLL per response token over
the whole eval set), pairs for ``rm`` (the mean pair loss). So ``eval/loss`` is the same with
``--micro-batch-size`` 1, 3 or all of the eval set (micro-batches of different sizes and lengths),
and equals the one computed by hand, example by example, with the model itself."""

from __future__ import annotations

import pytest
import torch

from rlhf.core.plugin_host.loading import build_plugin_manager
from tests.helpers import write_jsonl

pytestmark = pytest.mark.run

WORDS = ["cat", "hello world", "the quick brown fox jumps", "12 + 7 = 19", "dog", "say hello to me", "a"]


@pytest.fixture(scope="module")
def eval_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval-weights")
    n = len(WORDS)
    write_jsonl(root / "sft.jsonl", [{"prompt": f"Q{i}:", "response": " ".join([w] * (1 + i % 3))}
                                     for i, w in enumerate(WORDS)])  # responses of 1 to 19 tokens
    write_jsonl(root / "pairs.jsonl", [{"prompt": f"Q: {w}?", "chosen": w, "rejected": WORDS[(i + 2) % n] * 2}
                                       for i, w in enumerate(WORDS)])
    return root


def loop_for(tiny_model_dir, data, objective, micro_batch_size, out):
    from rlhf.runtime.config.fit_config import FitConfig
    from rlhf.runtime.config.fit_plan import FitPlan
    from rlhf.runtime.fit.local import build_parts
    from rlhf.runtime.fit.loop import FitLoop

    plugins = build_plugin_manager(load_entrypoints=False)
    config = FitConfig.from_dict({"model": str(tiny_model_dir), "data": [str(data)], "eval_data": [str(data)],
                                  "objective": objective, "batch_size": 7, "micro_batch_size": micro_batch_size,
                                  "out": str(out), "progress": False})
    parts, plan = build_parts(FitPlan.make(config, plugins))
    return FitLoop(plan, plugins, parts)


@pytest.mark.parametrize("objective", ["sft", "rm"])
def test_eval_loss_does_not_depend_on_the_micro_batch_size(objective, tiny_model_dir, eval_files, tmp_path):
    data = eval_files / ("sft.jsonl" if objective == "sft" else "pairs.jsonl")
    losses = {}
    for size in (1, 3, 7):
        loop = loop_for(tiny_model_dir, data, objective, size, tmp_path / f"mb{size}")
        assert len(loop.parts.eval_examples) == 7
        losses[size] = loop.evaluate()["eval/loss"]
    assert losses[1] == pytest.approx(losses[7], rel=1e-6) and losses[3] == pytest.approx(losses[7], rel=1e-6)
    assert losses[7] == pytest.approx(by_hand(objective, loop), rel=1e-5)


def by_hand(objective, loop):
    """The eval loss from the model, one example at a time."""
    model = loop.trained.model.eval()
    examples = loop.parts.eval_examples
    with torch.no_grad():
        if objective == "sft":
            nll, tokens = 0.0, 0
            for ids, mask in examples:
                logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].float()  # (T-1, V)
                logps = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
                learnt = torch.tensor(mask[1:], dtype=torch.bool)
                nll -= float(logps[learnt].sum())
                tokens += int(learnt.sum())
            assert len({len(ids) for ids, _ in examples}) > 3  # lengths differ: a plain mean over batches would not do
            return nll / tokens
        pair_losses = []
        for chosen, rejected, _ in examples:
            scores = [float(model(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long))[0, -1])
                      for ids in (chosen, rejected)]
            pair_losses.append(-float(torch.nn.functional.logsigmoid(torch.tensor(scores[0] - scores[1]))))
        assert max(pair_losses) - min(pair_losses) > 1e-3  # pairs differ: the weighting matters
        return sum(pair_losses) / len(pair_losses)
