"""``rlhf plugins new KIND NAME``: write a pip-installable plugin package that works out of the box.

The package (``rlhf-<name>``, import name ``rlhf_<name>``) holds ``pyproject.toml`` with the
``rlhf`` entry point, a light ``plugin.py`` that registers the component by ``"module:attr"``
reference, the component itself (a documented skeleton of the kind's contract that passes
``rlhf plugins check``), a test and a README. Templates live in ``templates/`` (package data);
``__UPPER__`` markers are replaced, nothing else is interpreted.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from rlhf.core.errors import ConfigError
from rlhf.core.plugin_host.kinds import KINDS

TEMPLATES = Path(__file__).parent / "templates"
TRAIN = "rlhf train --algo grpo --model ./examples/tiny-model --data examples/data/train.jsonl --input-key prompt " \
        "--label-key answer --n-samples 4 --prompts-per-step 2 --max-new-tokens 8 --steps 1"
REWARD = "--reward examples/rewards.py:exact_match"


@dataclass(frozen=True)
class KindTemplate:
    impl: str  # module of the component inside the package
    attr: str  # "{cls}" becomes the CamelCase name
    description: str
    use: str  # a trained run with the component ({name} and {out} are filled in)
    register_extra: str = ""  # more register(...) arguments; "{module}" and "{cls}" are filled in


SPECS: dict[str, KindTemplate] = {
    "advantage_estimator": KindTemplate(
        "estimator", "estimate", "an advantage estimator (reward minus the group mean)",
        f"{TRAIN} {REWARD} --advantage {{name}} --out {{out}}", ", needs_groups=True"),
    "policy_loss": KindTemplate(
        "loss", "policy_loss", "a policy loss (PPO's clipped surrogate)",
        f"{TRAIN} {REWARD} --policy-loss {{name}} --out {{out}}",
        ', config_cls="{module}.loss:{cls}Config"'),
    "kl_estimator": KindTemplate(
        "kl", "kl", "a KL estimator (k2: half the squared log-ratio)",
        f"{TRAIN} {REWARD} --kl-estimator {{name}} --kl-in loss --out {{out}}"),
    "loss_aggregation": KindTemplate(
        "aggregation", "aggregate", "a loss aggregation (mean over the step's action tokens)",
        f"{TRAIN} {REWARD} --loss-agg {{name}} --out {{out}}"),
    "algorithm": KindTemplate(
        "preset", "PRESET", "an algorithm preset (RLOO with the KL in the loss)",
        f"{TRAIN.replace('--algo grpo', '--algo {name}')} {REWARD} --out {{out}}"),
    "reward": KindTemplate(
        "reward", "reward", "a reward (1 when the completion contains the label)",
        f"{TRAIN} --reward {{name}} --out {{out}}"),
    "env": KindTemplate(
        "env", "{cls}Env", "an environment (two tries, a hint after a wrong answer)",
        f"{TRAIN} {REWARD} --env {{name}} --max-turns 2 --out {{out}}",
        ', config_cls="{module}.env:{cls}Config", multi_turn=True, gives_rewards=True'),
    "model": KindTemplate(
        "adapter", "{cls}Adapter", "a model adapter (a transformers causal LM and a frozen reference)",
        f"{TRAIN} {REWARD} --model-adapter {{name}} --out {{out}}",
        ', config_cls="{module}.adapter:{cls}Config", roles=("policy", "reference")'),
    "rollout_engine": KindTemplate(
        "engine", "{cls}Engine", "a rollout engine (token-by-token sampling)",
        f"{TRAIN} {REWARD} --engine {{name}} --out {{out}}"),
    "train_backend": KindTemplate(
        "backend", "{cls}Backend", "a training backend (SGD with momentum)",
        f"{TRAIN} {REWARD} --backend {{name}} --out {{out}}",
        ', config_cls="{module}.backend:{cls}Config"'),
    "objective": KindTemplate(
        "objective", "{cls}Objective", "an offline objective (response-token NLL)",
        "rlhf fit --objective {name} --model ./examples/tiny-model --data examples/pipeline/sft.jsonl "
        "--max-len 32 --batch-size 4 --steps 1 --out {out}",
        ', config_cls="{module}.objective:{cls}Config"'),
    "sample_filter": KindTemplate(
        "sample_filter", "keep_group", "a sample filter (keep prompt groups whose scores vary)",
        f"{TRAIN} {REWARD} --sample-filter {{name}} --out {{out}}"),
    "agent": KindTemplate(
        "agent", "solve", "an agent (answers, checks its answer, is scored against the label)",
        "rlhf train --algo grpo --model ./examples/tiny-model --data examples/data/train.jsonl --input-key prompt "
        "--label-key answer --n-samples 2 --prompts-per-step 2 --max-new-tokens 8 --steps 1 --agent {name} "
        "--out {out}"),
    "tool_parser": KindTemplate(
        "parser", "parse", "a tool-call parser ([TOOL_CALLS] followed by a JSON list)",
        "rlhf train --algo grpo --model ./examples/tiny-model --data examples/data/train.jsonl --input-key prompt "
        "--label-key answer --n-samples 2 --prompts-per-step 2 --max-new-tokens 8 --steps 1 "
        "--agent examples/agents/ask.py:solve --tool-parser {name} --out {out}"),
    "reward_shaping": KindTemplate(
        "shaping", "shape", "a reward shaping (a small penalty per generated token)",
        f"{TRAIN} {REWARD} --reward-shaping {{name}} --out {{out}}",
        ', config_cls="{module}.shaping:{cls}Config"'),
}


@dataclass(frozen=True)
class Names:
    kind: str
    name: str  # the component name: my_reward

    @property
    def package(self) -> str:
        return "rlhf-" + self.name.replace("_", "-")

    @property
    def module(self) -> str:
        return "rlhf_" + self.name

    @property
    def cls(self) -> str:
        return "".join(part.capitalize() for part in self.name.split("_"))


def kind_of(text: str) -> str:
    kind = text.strip().lower().replace("-", "_")
    if kind not in SPECS:
        raise ConfigError(f"no template for kind {text!r}; kinds: {', '.join(SPECS)}")
    return kind


def check_name(name: str) -> str:
    key = name.strip().lower().replace("-", "_")
    if not re.fullmatch(r"[a-z][a-z0-9_]*", key):
        raise ConfigError(f"plugin name {name!r} must be a Python identifier: letters, digits and '_' (or '-'), "
                          "starting with a letter")
    return key


def use_command(kind: str, name: str, out: str) -> str:
    """The trained run the README and docs show for a component of ``kind``."""
    return SPECS[kind].use.format(name=name, out=out)


def new_package(kind: str, name: str, directory: str | os.PathLike) -> Path:
    """Write the package for component ``name`` of ``kind`` under ``directory``; return its folder.

    Written in a temporary folder next to the target and renamed into place, so a failure leaves
    nothing half-written; an existing folder is never overwritten.
    """
    names = Names(kind_of(kind), check_name(name))
    spec = SPECS[names.kind]
    root = Path(directory) / names.package
    if root.exists():
        raise ConfigError(f"{root} already exists; pick another NAME or --dir")
    attr = spec.attr.format(cls=names.cls)
    marks = {
        "__PACKAGE__": names.package, "__MODULE__": names.module, "__NAME__": names.name, "__KIND__": names.kind,
        "__TITLE__": names.kind.replace("_", " "), "__CLASS__": names.cls, "__IMPL__": spec.impl, "__ATTR__": attr,
        "__HOOK__": KINDS[names.kind].hook, "__DESCRIPTION__": spec.description[0].upper() + spec.description[1:],
        "__REGISTER_EXTRA__": spec.register_extra.format(module=names.module, cls=names.cls),
        "__USE__": use_command(names.kind, names.name, f"runs/{names.name}"),
    }
    files = {
        "pyproject.toml": "pyproject.toml.tmpl",
        "README.md": "README.md.tmpl",
        f"{names.module}/__init__.py": "__init__.py.tmpl",
        f"{names.module}/plugin.py": "plugin.py.tmpl",
        f"{names.module}/{spec.impl}.py": f"kinds/{names.kind}.py.tmpl",
        f"tests/test_{names.name}.py": "test_plugin.py.tmpl",
    }
    root.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{names.package}-", dir=root.parent))
    try:
        for relative, template in files.items():
            text = (TEMPLATES / template).read_text()
            for mark, value in marks.items():
                text = text.replace(mark, value)
            (staging / relative).parent.mkdir(parents=True, exist_ok=True)
            (staging / relative).write_text(text)
        staging.rename(root)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return root
