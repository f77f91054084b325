"""``rlhf eval``: the eval of ``rlhf train --eval-data`` as a command of its own (docs/generate.md).

The model samples ``--n-samples`` completions per prompt through the same rollout, engine and
reward sources a training run's eval uses, and the metrics are the same, by the same names
(`rlhf.runtime.run.evaluation.metrics_of`): ``eval/reward/mean``, ``eval/reward/<source>``,
``eval/pass@1``, ``eval/pass@N``, ``eval/response/length_mean``, ``eval/response/truncated_rate``,
``eval/prompts``. Prompts go through in batches of ``--batch-size``; ``--temperature 0`` is greedy.
One process (not under torchrun).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlhf.core.errors import ConfigError
from rlhf.datagen.config import EvalConfig

log = logging.getLogger(__name__)


@dataclass
class EvalReport:
    metrics: dict[str, float]
    rows: list[dict[str, Any]]  # one per sample: prompt, completion, reward, rewards, label, finish_reason

    def table(self) -> str:
        width = max(len(name) for name in self.metrics)
        return "\n".join(f"{name:<{width}}  {value:.4f}" if isinstance(value, float) else f"{name:<{width}}  {value}"
                         for name, value in self.metrics.items())


def evaluate(config: EvalConfig, *, plugins: Any = None) -> EvalReport:
    """Run ``rlhf eval`` in this process; the metrics and the per-sample rows."""
    from rlhf.core.distributed import launched_with_ranks
    from rlhf.core.plugin_host.loading import build_plugin_manager
    from rlhf.core.protocols.rollout import SamplingParams
    from rlhf.datagen.components import data_settings, load_reward_set, sampling_components
    from rlhf.runtime.run.data import PromptFormatter, load_prompts
    from rlhf.runtime.run.evaluation import metrics_of, sampled
    from rlhf.runtime.run.lifecycle import seed_everything
    from rlhf.runtime.rl.rollout import EnvFactory, RolloutSettings, RolloutWorker
    from rlhf.runtime.run.threads import set_threads
    from rlhf.runtime.rl.workers import RewardWorker

    config.check()
    if launched_with_ranks():
        raise ConfigError("rlhf eval runs in one process: start it without torchrun")
    plugins = plugins or build_plugin_manager()
    set_threads(config.threads)
    (adapter_cls, adapter_config), (engine_cls, engine_config), values = sampling_components(config, plugins)
    rewards = load_reward_set(config, plugins)
    rewards.check_labels_given(config.label_key)
    adapter = adapter_cls(adapter_config)
    tokenizer = adapter.load_tokenizer(config.tokenizer or config.model)
    data = data_settings(config)
    dataset = load_prompts(data)
    formatter = PromptFormatter(tokenizer, data)
    prompts = [formatter(dataset[i]) for i in range(len(dataset))]
    seed_everything(config.seed)
    model = adapter.load(config.model, role="reference")
    rollout = RolloutWorker(engine_cls(model, tokenizer, engine_config), tokenizer,
                            EnvFactory(plugins.registry("env"), lambda name, config_cls: {}, values),
                            RolloutSettings(max_turns=1, max_total_tokens=config.max_prompt_length
                                            + config.max_new_tokens))
    reward = RewardWorker(rewards)
    params = SamplingParams(max_new_tokens=config.max_new_tokens, temperature=config.temperature, top_p=config.top_p,
                            top_k=config.top_k, repetition_penalty=config.repetition_penalty)
    trajectories, result = sampled(rollout, reward, prompts, config.n, params, batch_size=config.batch_size,
                                   assign=True)
    greedy = config.temperature == 0
    metrics = metrics_of(trajectories, result, config.n, greedy=greedy)
    if greedy and config.n > 1:
        log.warning("--temperature 0 is greedy: the %d samples of a prompt are one answer, so pass@%d would only "
                    "repeat pass@1 and is not reported; sample with --temperature > 0 for pass@%d", config.n, config.n,
                    config.n)
    if formatter.truncated_count:
        log.warning("%d prompt(s) were longer than --max-prompt-length %d and lost their start",
                    formatter.truncated_count, config.max_prompt_length)
    rows = [{"prompt": t.prompt, "completion": t.completion_text, "reward": t.reward, "rewards": dict(t.rewards),
             "label": t.label, "finish_reason": t.finish_reason} for t in trajectories]
    return EvalReport(metrics=metrics, rows=rows)


def write_rows(rows: list[dict[str, Any]], path: str) -> None:
    """The per-sample rows as JSONL, written beside ``path`` and renamed into place."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp")
    tmp.write_text("".join(json.dumps(row, default=str) + "\n" for row in rows))
    tmp.replace(target)
