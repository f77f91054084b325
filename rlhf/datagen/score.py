"""``rlhf score``: reward sources over the completions of an existing JSONL file (batch reward-model
inference, or any reward function or server), written resumably like ``rlhf generate``'s output.

A row's ``--completions-key`` holds a list of completions (scored into ``"rewards"``) or one string
(scored into ``"reward"``); every other column is kept. ``--best-of-n``, ``--pairs`` and
``--conditional`` write the rows ``rlhf generate`` writes in those modes instead. Rewards see the
prompt as the model did: through ``--input-template``, or the chat template of ``--tokenizer`` under
``--apply-chat-template``.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from rlhf.core.errors import ConfigError
from rlhf.datagen.components import load_reward_set
from rlhf.datagen.config import ScoreConfig
from rlhf.datagen.generate import Report, open_output, row_settings, run_batches
from rlhf.datagen.rows import Sample, Selection, make_rows
from rlhf.runtime.run.run_lock import NoLock, RunLock


class PromptText:
    """The prompt as the model saw it, for rewards that read ``queries`` / ``prompt_texts``."""

    def __init__(self, config: ScoreConfig):
        self.template, self.tokenizer = config.input_template, None
        if config.input_template is not None and "{}" not in config.input_template:
            raise ConfigError(f"--input-template must contain {{}} where the prompt goes: {config.input_template!r}")
        if config.apply_chat_template:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(config.tokenizer)
            if not getattr(self.tokenizer, "chat_template", None):
                raise ConfigError(f"--apply-chat-template: the tokenizer {config.tokenizer} has no chat template")

    def __call__(self, prompt: Any) -> str:
        from rlhf.rewards.source import render_prompt

        if self.tokenizer is not None:
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        if isinstance(prompt, str) and self.template:
            return self.template.replace("{}", prompt)
        return render_prompt(prompt)


def score(config: ScoreConfig, *, plugins: Any = None) -> Report | None:
    """Run ``rlhf score`` in this process (one rank under torchrun); returns what was written
    (None on ranks other than the main one)."""
    from rlhf.core.distributed import init_from_environment
    from rlhf.core.plugin_host.loading import build_plugin_manager
    from rlhf.runtime.run.data import load_rows, row_origin, row_values

    from rlhf.runtime.run.threads import set_threads

    mode = config.check()
    plugins = plugins or build_plugin_manager()
    set_threads(config.threads)  # --threads, else the machine's fixed default (rlhf.runtime.run.threads)
    rewards = load_reward_set(config, plugins)
    text = PromptText(config)
    dataset = load_rows(list(config.data), split=config.data_split,
                        columns=[config.input_key, config.completions_key, config.label_key],
                        probs=config.mixing_probs, max_samples=config.max_samples, seed=config.seed,
                        hint="set --input-key / --completions-key / --label-key")
    # the labels: --label-key's column, else the "label" column `rlhf generate` writes
    label_key = config.label_key or ("label" if "label" in dataset.column_names else None)
    rewards.check_labels_given(label_key)
    selection = Selection(mode=mode, reward_template=config.reward_template, conditional_rows=config.conditional_rows,
                          seed=config.seed, has_label=False)
    dist = init_from_environment()
    lock = RunLock.for_file(config.out).acquire() if dist.is_main else NoLock()  # one job per output file
    try:
        out = open_output(config.out, row_settings(config), config.overwrite, dist)

        def batch(begin: int, end: int, batch_index: int) -> tuple[list[dict], Counter, int]:
            rows = [dataset[i] for i in range(begin, end)]
            completions = [_completions(row, config.completions_key, row_origin(row)) for row in rows]
            flat = [(j, c) for j, cs in enumerate(completions) for c in cs]
            values = [row_values(row) for row in rows]
            prompts = [values[j][config.input_key] for j, _ in flat]
            others = [k for k in values[0] if k not in (config.input_key, config.completions_key)] if values else []
            result = rewards.score(prompts, [c for _, c in flat],
                                   [values[j].get(label_key) if label_key else None for j, _ in flat],
                                   prompt_texts=[text(p) for p in prompts],
                                   **{k: [values[j].get(k) for j, _ in flat] for k in others})
            per_row: list[list[float | None]] = [[] for _ in rows]
            for (j, _), reward in zip(flat, result.total):
                per_row[j].append(reward)
            skipped: Counter = Counter()
            out_rows = []
            for j, value in enumerate(values):
                if mode == "samples":
                    single = isinstance(value[config.completions_key], str)
                    out_rows.append({**value, **({"reward": per_row[j][0]} if single else {"rewards": per_row[j]})})
                    continue
                sample = Sample(prompt=value[config.input_key], completions=completions[j], rewards=per_row[j],
                                index=begin + j)
                out_rows += make_rows(sample, selection, skipped)
            return out_rows, skipped, 0

        if not out.finished:
            run_batches(out, len(dataset), config.batch_size, dist, batch, progress=config.progress, what="rows")
        return out.report()
    finally:
        dist.close()
        lock.release()


def _completions(row: dict[str, Any], key: str, origin: str) -> list[str]:
    value = row[key]
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(c, str) for c in value):
        return list(value)
    raise ConfigError(f"{origin}: {key!r} must be a string or a list of strings, got {type(value).__name__}")
