"""OpenRLHF's own flag names as aliases of the training commands' options (docs/openrlhf.md).

``--pretrain``, ``--prompt_data``, ``--n_samples_per_prompt``, ``--micro_train_batch_size``, ...
are rewritten to the native option before click parses the command line, and the first use of
each prints, once, the native name (``--pretrain is --model here``). A name is an alias when the
table below names it, or when it is a native flag spelled with ``_`` (``--max_new_tokens``).
OpenRLHF 0.10+'s dotted names (``--rollout.n_samples_per_prompt``,
``--algo.advantage.estimator``) are looked up by their trailing words. A native name always wins:
an alias only applies to a word the command does not know. Unknown flags get suggestions from the
aliases first, then from the native names.
"""

from __future__ import annotations

import difflib

import click

# OpenRLHF name -> the native words it stands for (the value, if any, follows them). Only names
# whose meaning is the same; docs/openrlhf.md gives the rest and the differences.
EVERY_COMMAND = {
    "pretrain": ("--model",), "bf16": ("--dtype", "bf16"),
    "flash_attn": ("--attn-implementation", "flash_attention_2"), "zero_stage": ("--backend", "deepspeed", "--zero-stage"),
    "adam_offload": ("--offload-optimizer",), "l2": ("--weight-decay",), "lr_warmup_ratio": ("--warmup-ratio",),
    "max_norm": ("--max-grad-norm",), "micro_train_batch_size": ("--micro-batch-size",),
    "packing_samples": ("--packing",), "tokenizer_chat_template": ("--chat-template",),
    "value_prefix_head": ("--value-head-prefix",), "eval_dataset": ("--eval-data",), "eval_steps": ("--eval-every",),
    "best_metric_key": ("--save-best",), "save_path": ("--out",), "save_steps": ("--save-every",),
    "max_ckpt_num": ("--keep-checkpoints",), "load_checkpoint": ("--resume",),
}
RAY = {"vllm_sync_backend": ("--weight-sync",), "vllm_enable_sleep": ("--engine.enable-sleep-mode",)}
OFFLINE = {
    "dataset": ("--data",), "dataset_probs": ("--data-probs",), "learning_rate": ("--lr",),
    "train_batch_size": ("--batch-size",), "max_epochs": ("--epochs",), "max_epoch": ("--epochs",),
}
PAIRS = {"input_key": ("--prompt-key",)}  # rm, dpo: the prompt's own column
TRAIN = {
    "prompt_data": ("--data",), "prompt_data_probs": ("--data-probs",), "prompt_split": ("--data-split",),
    "prompt_max_len": ("--max-prompt-length",), "generate_max_len": ("--max-new-tokens",),
    "n_samples_per_prompt": ("--n-samples",), "rollout_batch_size": ("--prompts-per-step",),
    "micro_rollout_batch_size": ("--generation-batch-size",), "max_epochs": ("--ppo-epochs",),
    "eval_n_samples_per_prompt": ("--eval-n-samples",), "actor_learning_rate": ("--lr",),
    "critic_learning_rate": ("--critic-lr",), "critic_pretrain": ("--critic-model",),
    "save_value_network": ("--save-critic",), "freezing_actor_steps": ("--freeze-actor-steps",),
    "advantage_estimator": ("--advantage",), "no_advantage_std_norm": ("--no-std-norm",),
    "init_kl_coef": ("--kl-coef",), "use_kl_loss": ("--kl-in", "loss"), "policy_loss_type": ("--policy-loss",),
    "entropy_loss_coef": ("--entropy-coef",), "reward_clip_range": ("--reward-clip",),
    "dynamic_filtering": ("--filter-groups",), "dynamic_filtering_reward_range": ("--filter-range",),
    "overlong_buffer_len": ("--overlong-buffer",), "stop_properly_penalty_coef": ("--truncated-reward",),
    "async_train": ("--async",), "async_queue_size": ("--max-staleness",), "reward_pretrain": ("--reward",),
    "remote_rm_url": ("--reward",), "normalize_reward": ("--reward-rm-normalize",), "agent_func_path": ("--env",),
    "colocate_actor_ref": ("--colocate", "policy_ref"), "colocate_critic_reward": ("--colocate", "critic_reward"),
    "colocate_all_models": ("--colocate", "all"), "vllm_num_engines": ("--engine", "vllm", "--rollout-workers"),
    "vllm_tensor_parallel_size": ("--engine.tensor-parallel-size",),
    "vllm_gpu_memory_utilization": ("--engine.gpu-memory-utilization",), "enforce_eager": ("--engine.enforce-eager",),
    "ref_reward_offload": ("--offload-ref-reward",), "deepspeed_enable_sleep": ("--offload-train-state",),
    "actor_num_gpus_per_node": ("--policy-actors",), "ref_num_gpus_per_node": ("--ref-actors",),
    "critic_num_gpus_per_node": ("--critic-actors",),
}


# OpenRLHF values that mean something else in rlhf: -1 ("never" / "at each epoch's end") is rlhf's 0
VALUES = {"save_steps": {"-1": "0"}, "eval_steps": {"-1": "0"}, "vllm_sync_backend": {"nccl": "broadcast"}}
# OpenRLHF flags that take a value and ask nothing of rlhf: dropped, with a note saying why
IGNORED = {"logging_steps": "rlhf logs every step (metrics.jsonl and the loggers)"}
# OpenRLHF's node counts: rlhf counts actors (--policy-actors = nodes x GPUs per node), so one node is
# what the GPUs-per-node alias already says; more is refused with the flag to use
NODES = {"actor_num_nodes": "--policy-actors", "ref_num_nodes": "--ref-actors", "critic_num_nodes": "--critic-actors",
         "reward_num_nodes": "--reward-gpus"}


ALGORITHM = {"--advantage_estimator": ("--advantage",)}  # what chooses the algorithm, by OpenRLHF's name


def table(command: str) -> dict[str, tuple[str, ...]]:
    """The named aliases of ``rlhf COMMAND``."""
    if command == "train":
        return {**EVERY_COMMAND, **TRAIN, **RAY}
    return {**EVERY_COMMAND, **OFFLINE, **(PAIRS if command in ("rm", "dpo") else {})}


_told: set[str] = set()  # the aliases whose native name was printed (once per process)


class OpenRLHFNames(click.Command):
    """A command that also answers to OpenRLHF's flag names."""

    def aliases(self, ctx: click.Context) -> dict[str, tuple[str, ...]]:
        """``--openrlhf_name`` -> native words, for the names this command can take."""
        native = {opt for param in self.get_params(ctx) for opt in (*param.opts, *param.secondary_opts)}
        found = {f"--{name}": words for name, words in table(self.name or "").items()
                 if all(w in native for w in words if w.startswith("--")) and f"--{name}" not in native}
        for opt in native:  # a native flag spelled with '_'
            under = opt.replace("-", "_").replace("__", "--", 1)
            if under != opt and under not in native:
                found.setdefault(under, (opt,))
        return found

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        aliases = self.aliases(ctx)
        native = {opt for param in self.get_params(ctx) for opt in (*param.opts, *param.secondary_opts)}
        out: list[str] = []
        spelled: list[str] = []  # aliases that differ only by '_' for '-': told on one line
        used = False
        rest = list(args)
        while rest:
            arg = rest.pop(0)
            if arg == "--":
                out += [arg, *rest]
                break
            name, eq, value = arg.partition("=")
            if not name.startswith("--") or len(name) == 2 or name in native:
                out.append(arg)
                continue
            if name[2:] in IGNORED:
                if not eq and rest and not rest[0].startswith("--"):
                    rest.pop(0)
                _tell(name, f"note: {name} is not needed: {IGNORED[name[2:]]}")
                continue
            if name[2:] in NODES and self.name == "train":
                value = value if eq else (rest.pop(0) if rest else "")
                if value != "1":
                    raise click.BadParameter(f"rlhf counts actors, not nodes: pass {NODES[name[2:]]} NODES x GPUS "
                                             "(one GPU each)", ctx, param_hint=f"'{name}'")
                _tell(name, f"note: {name} 1 is not needed: one node is what {NODES[name[2:]]} says")
                continue
            words = _lookup(name, aliases)
            if words is None:
                raise unknown_option(name, suggestions(name, aliases, native), ctx)
            values = VALUES.get(name[2:], {})
            if values and not eq and rest and rest[0] in values:
                eq, value = "=", rest.pop(0)
            if value in values:
                _tell(f"{name} {value}", f"note: {name} {value} is {' '.join(words)} {values[value]} in rlhf")
                value = values[value]
            elif words == (_dashed(name),):
                spelled.append(name)
            else:
                _tell(name, f"note: {name} is {' '.join(words)} in rlhf")
            used = True
            out.extend(words)
            if eq:
                out.append(value)
        chosen = any(a.partition("=")[0] in ("--algo", "--advantage") or _lookup(a.partition("=")[0], ALGORITHM)
                     for a in args)
        if used and self.name == "train" and not chosen:
            _tell("algorithm", "note: OpenRLHF's default algorithm is PPO (gae, with a critic; a k1 KL in the reward), "
                               "rlhf's is --algo grpo: add --advantage_estimator gae, or --algo ppo for its KL too")
        spelled = [name for name in spelled if name not in _told]
        if spelled:
            _told.update(spelled)
            click.echo(f"note: rlhf spells {', '.join(spelled)} with '-': "
                       f"{', '.join(_dashed(name) for name in spelled)}", err=True)
        return super().parse_args(ctx, out)


def _dashed(name: str) -> str:
    return "--" + name[2:].replace("_", "-")


def _tell(key: str, text: str) -> None:
    if key not in _told:
        _told.add(key)
        click.echo(text, err=True)


def unknown_option(name: str, close: list[str], ctx: click.Context) -> click.NoSuchOption:
    """click's error for an unknown flag, with our suggestions (click would filter them again by spelling)."""
    message = f"No such option {name!r}." + (f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else "")
    return click.NoSuchOption(name, message=message, ctx=ctx)


def _lookup(name: str, aliases: dict[str, tuple[str, ...]]) -> tuple[str, ...] | None:
    if name in aliases:
        return aliases[name]
    parts = name[2:].split(".")
    for start in range(1, len(parts)):  # OpenRLHF 0.10+: --algo.advantage.estimator, --rollout.n_samples_per_prompt
        words = aliases.get("--" + "_".join(parts[start:]))
        if words is not None:
            return words
    return None


def suggestions(name: str, aliases: dict[str, tuple[str, ...]], native: set[str]) -> list[str]:
    """Close names, the aliases' native words first (what an OpenRLHF user most likely meant)."""
    spelled = "--" + name[2:].replace("-", "_")
    by_alias = [" ".join(aliases[a]) for a in difflib.get_close_matches(spelled, list(aliases), n=2, cutoff=0.75)]
    by_native = difflib.get_close_matches("--" + name[2:].replace("_", "-"), sorted(native), n=2, cutoff=0.75)
    return list(dict.fromkeys(by_alias + by_native))[:3]
