"""``rlhf generate``, ``rlhf score``, ``rlhf iterate`` and ``rlhf chat`` (docs/generate.md).

Flags come from the config dataclasses in `rlhf.datagen.config` (one per field) and, for the
rollout engine and the model adapter, from their components' settings (``--engine.<setting>``,
``--lora-rank``, ...), as in ``rlhf train``. Each command is built on first use (`LazyCommand`).
"""

from __future__ import annotations

from typing import Any

import click

from rlhf.cli.commands import (LazyCommand, config_file_option, config_values, model_prompt_format, preflight,
                               quiet_library_progress_bars, report)
from rlhf.cli.options import Flag, component_flags, config_flags

HELP = {
    "generate": "Sample n completions per prompt, score them, write JSONL (best-of-n, pairs, conditional SFT).",
    "score": "Score existing completions with reward sources (batch reward-model inference).",
    "iterate": "Iterative DPO: rounds of generate -> score -> pairs -> dpo.",
    "chat": "Talk to a model interactively (chat template, history, /reset, /exit).",
    "eval": "Evaluate a model on prompts with reward sources: the metrics of rlhf train's eval.",
}
_TITLES = {"model": "Model", "data": "Data", "sampling": "Sampling", "reward": "Rewards", "iterate": "Rounds",
           "dpo": "DPO", "runtime": "Runtime", "output": "Output"}


# Second names: ``--n`` is also ``--n-samples`` (as in rlhf train), which torchrun's own parser does not
# mistake for an abbreviation of its --nnodes / --nproc-per-node.
_ALSO = {"n": "--n-samples"}


def _flags(plugins: Any, config_cls: type) -> list[Flag]:
    import dataclasses

    flags = config_flags(config_cls, nested=config_cls.NESTED, titles=_TITLES, skip=("components",))
    flags = [dataclasses.replace(f, names=f.names + (_ALSO[f.dest],)) if f.dest in _ALSO else f for f in flags]
    return flags + component_flags(plugins, config_cls.setting_slots(), config_cls.short_flags(plugins))


def _build(plugins: Any, name: str, config_cls: type, run: Any, doc: str, before: Any) -> click.Command:
    flags = _flags(plugins, config_cls)

    def command(**kwargs: Any) -> Any:
        values = config_values(kwargs, config_cls)
        model_prompt_format(values, values.get("model") or values.get("tokenizer"))
        config = config_cls.from_dict(values, plugins)
        preflight(config, plugins, before and (lambda: before(config, plugins)))  # before torch loads
        quiet_library_progress_bars()
        return run(config, plugins)

    command.__doc__ = doc
    for flag in reversed(flags):
        command = flag.option()(command)
    command = config_file_option(flags, config_cls)(command)
    return click.command(name, short_help=HELP[name], context_settings={"max_content_width": 120})(command)


# What each job checks before it loads a model, in its order, without torch (`preflight` calls it before
# it says that a model path is wrong).

def _before_generate(config: Any, plugins: Any) -> None:
    """``rlhf generate``: the rewards and their labels, then its --out file not in use (main rank)."""
    import os

    from rlhf.cli.commands import check_reward_labels
    from rlhf.runtime.run.run_lock import RunLock

    check_reward_labels(config, plugins)
    if os.environ.get("RANK", "0") == "0":
        with RunLock.for_file(config.out):
            pass


def _before_eval(config: Any, plugins: Any) -> None:
    """``rlhf eval``: the rewards and their labels."""
    from rlhf.cli.commands import check_reward_labels

    check_reward_labels(config, plugins)


def _before_rounds(config: Any, plugins: Any) -> None:
    """``rlhf iterate``: its --out folder, then round 1's rewards and their labels."""
    from rlhf.cli.commands import check_reward_labels, check_run_out
    from rlhf.datagen.iterate import ITERATION

    check_run_out(config.out, ITERATION)
    check_reward_labels(config, plugins)


def _generate(config: Any, plugins: Any) -> Any:
    from rlhf.datagen.generate import generate

    done = generate(config, plugins=plugins)
    if done is not None:  # the main rank
        report(f"wrote {done.summary()}")
    return done


def _score(config: Any, plugins: Any) -> Any:
    from rlhf.datagen.score import score

    done = score(config, plugins=plugins)
    if done is not None:
        report(f"wrote {done.summary()}")
    return done


def _eval(config: Any, plugins: Any) -> Any:
    import json

    from rlhf.datagen.evaluate import evaluate, write_rows

    done = evaluate(config, plugins=plugins)
    if config.out:
        write_rows(done.rows, config.out)
    report(json.dumps(done.metrics) if config.json else done.table())
    if config.out and not config.json:
        report(f"wrote {len(done.rows)} samples to {config.out}")
    return done


def _iterate(config: Any, plugins: Any) -> Any:
    from rlhf.datagen.iterate import iterate

    out = iterate(config, plugins=plugins)
    report(f"run finished: {out}")
    return out


GENERATE_DOC = """Sample --n completions per prompt with a rollout engine, score them with --reward, write JSONL.

    \b
    rlhf generate --model runs/sft/final --data prompts.jsonl --n 8 --reward rewards.py:score --out gen.jsonl
    rlhf generate ... --best-of-n --out rs.jsonl      # {prompt, response, reward}: rlhf sft data
    rlhf generate ... --pairs --out pairs.jsonl       # {prompt, chosen, rejected, ...}: rlhf dpo data
    rlhf generate ... --conditional --out csft.jsonl  # score-conditioned prompts (conditional SFT)
    python -m torch.distributed.run --standalone --nproc-per-node 2 -m rlhf generate ...

    Rerunning with the same --out continues a killed run. Formats: docs/generate.md.
    """

SCORE_DOC = """Score the completions of a JSONL file (e.g. rlhf generate's) with reward sources.

    \b
    rlhf score --data gen.jsonl --reward runs/rm/final --out scored.jsonl
    rlhf score --data gen.jsonl --reward rewards.py:score --pairs --out pairs.jsonl

    Rows keep their columns and gain "rewards" (a list of completions) or "reward" (one string);
    --best-of-n, --pairs and --conditional write the rows rlhf generate writes. See docs/generate.md.
    """

ITERATE_DOC = """Iterative DPO: each round samples from the last round's model, scores the samples,
    pairs best against worst and trains DPO on the pairs (reference: the round's starting model).

    \b
    rlhf iterate --model runs/sft/final --data prompts.jsonl --reward runs/rm/final --rounds 3 --out runs/idpo

    <out>/round_K/ holds generations.jsonl, pairs.jsonl, the DPO run (dpo/) and a link to its model
    (model); <out>/metrics.jsonl one line per round. Rerunning continues after the last complete round.
    One process: not under torchrun.
    """


EVAL_DOC = """Evaluate a model: sample --n-samples completions per prompt, score them, report the metrics.

    \b
    rlhf eval --model runs/quickstart/final --data examples/data/eval.jsonl --label-key answer \\
        --reward examples/rewards.py:exact_match --n-samples 4 --temperature 0.7

    The metrics of rlhf train's eval (--eval-data), by the same names: eval/reward/mean,
    eval/reward/<source>, eval/pass@1, eval/pass@N, eval/response/length_mean,
    eval/response/truncated_rate. A table by default, one JSON object with --json; --out FILE also
    writes one row per sample. --temperature 0 is greedy (pass@N, N identical samples, is then not
    reported). One process.
    """


def build_chat_command() -> click.Command:
    @click.command("chat", short_help=HELP["chat"], context_settings={"max_content_width": 120})
    @click.argument("model")
    @click.option("--system", default=None, help="System message opening the conversation")
    @click.option("--apply-chat-template/--no-apply-chat-template", default=None,
                  help="Format turns with the tokenizer's chat template (default: as the model was trained, "
                       "else when the tokenizer has one)")
    @click.option("--input-template", default=None,
                  help="Template for each user turn, with {} for the text (instead of the chat template)")
    @click.option("--tokenizer", default=None, help="Tokenizer directory (default: the model's)")
    @click.option("--max-new-tokens", default=512, show_default=True, type=int, help="Tokens per answer at most")
    @click.option("--temperature", default=0.7, show_default=True, type=float, help="Sampling temperature (0: greedy)")
    @click.option("--top-p", default=1.0, show_default=True, type=float, help="Nucleus sampling threshold (1: off)")
    @click.option("--top-k", default=0, show_default=True, type=int, help="Sample among the k most likely (0: off)")
    @click.option("--repetition-penalty", default=1.0, show_default=True, type=float,
                  help="Penalty on tokens the conversation holds already (1: off)")
    @click.option("--seed", default=None, type=int, help="Random seed (default: unseeded)")
    @click.option("--dtype", default="auto", show_default=True,
                  type=click.Choice(["auto", "bf16", "fp16", "fp32", "bfloat16", "float16", "float32"]),
                  help="Weights dtype: auto (bf16 on GPU, fp32 on CPU)")
    @click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda or cuda:N")
    @click.option("--trust-remote-code", is_flag=True, help="Allow model code from the checkpoint")
    def chat(model: str, **options: Any) -> None:
        """Talk to MODEL (an HF directory, a LoRA adapter directory or a hub name).

        \b
        rlhf chat runs/dpo/final --system "You are terse."
        Type a message and press Enter; /reset clears the history, /exit (or Ctrl-D) quits.
        """
        from rlhf.core.hub import check_model_path
        from rlhf.datagen.chat import ChatSettings, run_chat
        from rlhf.runtime.config.options import check_sampling

        model_prompt_format(options, model)
        settings = ChatSettings(**options)  # its ranges, then the model's path: before transformers loads
        check_sampling(settings.top_k, settings.repetition_penalty)
        check_model_path(model, "MODEL")
        if settings.tokenizer:
            check_model_path(settings.tokenizer, "--tokenizer")
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        run_chat(model, settings)

    return chat


def build_datagen_command(plugins: Any, name: str) -> click.Command:
    from rlhf.datagen.config import EvalConfig, GenerateConfig, IterateConfig, ScoreConfig

    config_cls, run, doc, before = {"generate": (GenerateConfig, _generate, GENERATE_DOC, _before_generate),
                                    "eval": (EvalConfig, _eval, EVAL_DOC, _before_eval),
                                    "score": (ScoreConfig, _score, SCORE_DOC, None),
                                    "iterate": (IterateConfig, _iterate, ITERATE_DOC, _before_rounds)}[name]
    return _build(plugins, name, config_cls, run, doc, before)


def datagen_commands(plugins: Any) -> list[click.Command]:
    """The five commands, each built when used."""
    jobs = [LazyCommand(name, HELP[name], lambda name=name: build_datagen_command(plugins, name))
            for name in ("generate", "eval", "score", "iterate")]
    return jobs + [LazyCommand("chat", HELP["chat"], build_chat_command)]
