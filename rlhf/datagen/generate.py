"""``rlhf generate``: batch inference with a rollout-engine plugin, n samples per prompt, scored by
any reward sources, written as JSONL rows the trainers read (docs/generate.md; formats in `rows.py`).

Prompts are formatted as ``rlhf train`` formats them (chat template, input template, left
truncation to ``--max-prompt-length``) and cut into batches of ``--batch-size`` prompts in data
order. Batch ``b`` is sampled after seeding torch with ``(seed, b)``, so the output depends on
the seed, the data and the batch size only: not on a resume, nor on the number of ranks. Under
torchrun each rank samples and scores every W-th batch; rank 0 gathers them and writes them in
order to the one output file (`output.ResumableJsonl`: a killed run continues after the last
whole batch).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlhf.core.errors import ConfigError, RlhfError
from rlhf.datagen.components import data_settings, load_reward_set, sampling_components
from rlhf.datagen.config import GenerateConfig
from rlhf.datagen.rows import Sample, Selection, make_rows
from rlhf.runtime.run.run_lock import NoLock, RunLock

log = logging.getLogger(__name__)

# Fields that do not change the rows: a rerun may change them and still continue the file.
_NOT_IN_ROWS = ("out", "overwrite", "progress", "threads", "device", "reward_options")


@dataclass
class Report:
    """What a job wrote."""

    out: Path
    prompts: int  # input prompts (or rows) finished
    rows: int  # output rows
    skipped: dict[str, int] = field(default_factory=dict)  # prompts without a row, by reason
    already_done: bool = False  # the file was complete before this run

    def summary(self) -> str:
        text = f"{self.rows} row(s) for {self.prompts} prompt(s) in {self.out}"
        if self.already_done:
            text += " (already complete; --overwrite starts it again)"
        reasons = {"ties": "all their samples tie", "unscored": "no sample was scored"}
        parts = [f"{count} skipped ({reasons.get(why, why)})" for why, count in sorted(self.skipped.items()) if count]
        return text + ("; " + "; ".join(parts) if parts else "")


def row_settings(config: Any) -> dict[str, Any]:
    values = config.to_dict()
    for name in _NOT_IN_ROWS:
        values.pop(name, None)
    values["reward_on_error"] = config.reward_options.on_error
    return values


class Sampler:
    """Prompt items -> `Sample` s: the engine's completions, decoded, and their rewards."""

    def __init__(self, engine: Any, tokenizer: Any, rewards: Any, config: Any):
        from rlhf.core.protocols.rollout import SamplingParams

        self.engine, self.tokenizer, self.rewards, self.n = engine, tokenizer, rewards, config.n
        self.params = SamplingParams(max_new_tokens=config.max_new_tokens, temperature=config.temperature,
                                     top_p=config.top_p, top_k=config.top_k,
                                     repetition_penalty=config.repetition_penalty)
        self.seed = config.seed

    def __call__(self, items: list[Any], batch_index: int, first_index: int) -> tuple[list[Sample], int]:
        """The samples of ``items`` (batch ``batch_index`` of the data) and the tokens generated."""
        import torch

        torch.manual_seed(self.seed * 1_000_003 + batch_index)
        generations = self.engine.generate([item.prompt_ids for item in items], n=self.n, params=self.params)
        texts = [self.tokenizer.decode(g.token_ids, skip_special_tokens=True) for g in generations]
        tokens = sum(len(g.token_ids) for g in generations)
        rewards = None
        if self.rewards is not None:
            expand = [item for item in items for _ in range(self.n)]
            names = list(dict.fromkeys(k for item in items for k in item.columns))
            result = self.rewards.score([i.prompt for i in expand], texts, [i.label for i in expand],
                                        prompt_texts=[i.prompt_text for i in expand],
                                        completion_ids=[g.token_ids for g in generations],
                                        **{k: [i.columns.get(k) for i in expand] for k in names})
            rewards = result.total
        samples = []
        for j, item in enumerate(items):
            part = slice(j * self.n, (j + 1) * self.n)
            samples.append(Sample(prompt=item.prompt, completions=texts[part],
                                  rewards=None if rewards is None else list(rewards[part]), label=item.label,
                                  columns=dict(item.columns), index=first_index + j))
        return samples, tokens


def generate(config: GenerateConfig, *, plugins: Any = None) -> Report | None:
    """Run ``rlhf generate`` in this process (one rank under torchrun); returns what was written
    (None on ranks other than the main one)."""
    from rlhf.core.distributed import init_from_environment
    from rlhf.core.plugin_host.loading import build_plugin_manager
    from rlhf.runtime.run.data import PromptFormatter, load_prompts
    from rlhf.runtime.run.threads import set_threads

    mode = config.check()
    plugins = plugins or build_plugin_manager()
    set_threads(config.threads)  # --threads, else the machine's fixed default (rlhf.runtime.run.threads)
    (adapter_cls, adapter_config), (engine_cls, engine_config), _ = sampling_components(config, plugins)
    rewards = load_reward_set(config, plugins)
    if rewards is not None:
        rewards.check_labels_given(config.label_key)
    dist = init_from_environment()
    lock = RunLock.for_file(config.out).acquire() if dist.is_main else NoLock()  # one job per output file
    try:
        adapter = adapter_cls(adapter_config)
        tokenizer = adapter.load_tokenizer(config.tokenizer or config.model)
        data = data_settings(config)
        dataset = load_prompts(data)
        formatter = PromptFormatter(tokenizer, data)
        selection = Selection(mode=mode, reward_template=config.reward_template,
                              conditional_rows=config.conditional_rows, seed=config.seed,
                              has_label=config.label_key is not None)
        out = open_output(config.out, row_settings(config), config.overwrite, dist)
        model = None
        if not out.finished:
            model = adapter.load(config.model, role="reference")
            engine = engine_cls(model, tokenizer, engine_config)
            sample = Sampler(engine, tokenizer, rewards, config)
            run_batches(out, len(dataset), config.batch_size, dist, lambda begin, end, b: _batch_rows(
                [formatter(dataset[i]) for i in range(begin, end)], sample, selection, b, begin),
                progress=config.progress, what="prompts")
        if formatter.truncated_count and dist.is_main:
            log.warning("%d prompt(s) were longer than --max-prompt-length %d and lost their start",
                        formatter.truncated_count, config.max_prompt_length)
        return out.report()
    finally:
        dist.close()
        lock.release()


def _batch_rows(items: list[Any], sample: Sampler, selection: Selection, batch_index: int,
                first_index: int) -> tuple[list[dict], Counter, int]:
    samples, tokens = sample(items, batch_index, first_index)
    skipped: Counter = Counter()
    rows = [row for s in samples for row in make_rows(s, selection, skipped)]
    return rows, skipped, tokens


# --- the batch loop, shared with rlhf score ---------------------------------------------------


class Output:
    """The main rank's `ResumableJsonl` as every rank sees it: how far it got."""

    def __init__(self, jsonl: Any, done_items: int, finished: bool, path: Path):
        self.jsonl, self.done_items, self.finished, self.path = jsonl, done_items, finished, path
        self.already_done = finished

    def report(self) -> Report | None:
        """What was written (None on ranks other than the main one, which write nothing)."""
        if self.jsonl is None:
            return None
        return Report(out=self.path, prompts=self.jsonl.done_items, rows=self.jsonl.rows,
                      skipped=dict(self.jsonl.counters), already_done=self.already_done)


def open_output(path: str, settings: dict[str, Any], overwrite: bool, dist: Any) -> Output:
    """Open (or continue) the output on the main rank; every rank learns where it stands."""
    from rlhf.datagen.output import ResumableJsonl

    jsonl, error = None, None
    if dist.is_main:
        try:
            jsonl = ResumableJsonl(path, settings, overwrite=overwrite)
        except RlhfError as exc:
            error = exc
    state = dist.broadcast((str(error) if error else None, jsonl.done_items if jsonl else 0,
                            jsonl.finished if jsonl else False, isinstance(error, ConfigError)))
    if error is not None:
        raise error
    if state[0] is not None:
        raise (ConfigError if state[3] else RlhfError)(state[0])
    return Output(jsonl, state[1], state[2], Path(path))


def run_batches(out: Output, total: int, batch_size: int, dist: Any, make: Any, *, progress: bool,
                what: str) -> None:
    """Call ``make(begin, end, batch_index) -> (rows, skipped, tokens)`` for every batch not yet
    written; batch b goes to rank ``b % W``; the main rank writes them in order."""
    from rlhf.runtime.run.progress import Progress

    batches = -(-total // batch_size)
    first = out.done_items // batch_size
    fields = ((f"{what}/s", "items_per_s", ".2f"),) + ((("tok/s", "tokens_per_s", ".0f"),) if what == "prompts" else ())
    bar = Progress(batches, first, enabled=progress and dist.is_main, fields=fields)
    started, items_done, tokens_done = time.monotonic(), 0, 0
    try:
        for round_start in range(first, batches, dist.world_size):
            mine = round_start + dist.rank
            result, failure = None, None
            if mine < batches:
                begin, end = mine * batch_size, min(total, (mine + 1) * batch_size)
                try:
                    result = (end - begin, *make(begin, end, mine))
                except Exception as exc:  # every rank must leave together, not wait for this one forever
                    if not dist.active:
                        raise
                    failure = exc
            results = dist.all_gather(result if failure is None else f"rank {dist.rank}: {failure}")
            if failure is not None:
                raise failure
            errors = [part for part in results if isinstance(part, str)]
            if errors:
                raise RlhfError(f"another rank failed ({errors[0]})")
            if dist.is_main:
                for part in results:
                    if part is None:
                        continue
                    items, rows, skipped, tokens = part
                    out.jsonl.append(rows, items, skipped)
                    items_done, tokens_done = items_done + items, tokens_done + tokens
                elapsed = max(time.monotonic() - started, 1e-9)
                last = min(batches, round_start + dist.world_size) - 1
                bar.update(last, {"items_per_s": items_done / elapsed, "tokens_per_s": tokens_done / elapsed})
        if dist.is_main:
            out.jsonl.finish()
        out.finished = True
    finally:
        bar.close()
    dist.barrier()
