"""`fit(config)`: an offline training run in this process (what ``rlhf fit``, ``rlhf sft``, ``rlhf dpo``,
... call). Started by a launcher (``torchrun --nproc-per-node N -m rlhf sft ...``), each process
is one data-parallel rank running the same loop (rlhf/core/distributed.py).

The builders: the model adapter and tokenizer, the objective, the data (loaded, checked and
encoded once, before any model loads), the trained model (a causal LM, or a scalar-head reward
model for ``head="score"``) with its backend, the frozen reference (with LoRA: the trained
model with its adapter switched off) and teacher when the objective needs them.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from rlhf.core.distributed import SINGLE, DistContext, init_from_environment
from rlhf.core.plugin_host.loading import PluginSet, build_plugin_manager
from rlhf.runtime.run.data import load_rows
from rlhf.fastpaths.ring_attention import check_model as check_ring_model
from rlhf.runtime.run.export import export_model
from rlhf.runtime.config.fit_config import FitConfig
from rlhf.runtime.fit.data import encode_rows
from rlhf.runtime.fit.loop import FitLoop, FitParts
from rlhf.runtime.config.fit_plan import FitPlan
from rlhf.runtime.fit.text import TextFormatter
from rlhf.runtime.run.prompt_format import PromptFormat
from rlhf.runtime.run.lifecycle import seed_everything, start_run
from rlhf.runtime.step.router_aux import RouterAux
from rlhf.runtime.step.trained import TrainedModel

log = logging.getLogger(__name__)


def encode_data(plan: FitPlan, objective: Any, text: TextFormatter, paths: list[str], *, split: str,
                what: str, probs: list[float] | None = None) -> list[Any]:
    config = plan.config
    rows = load_rows(paths, split=split, columns=list(objective.columns()), probs=probs,
                     max_samples=config.max_samples, seed=config.seed,
                     hint=f"set the {config.objective} objective's column options (see `rlhf {config.objective} --help`)")
    return encode_rows(rows, objective, text, what=what)


def build_parts(plan: FitPlan, dist: DistContext = SINGLE) -> tuple[FitParts, FitPlan]:
    """Everything the loop drives, and the plan completed with the data's size."""
    config = plan.config
    seed_everything(config.seed)
    adapter = plan.choices["model_adapter"].load()(plan.component_config("model_adapter"))
    tokenizer = adapter.load_tokenizer(config.tokenizer or config.model)
    objective = plan.choices["objective"].load()(plan.objective_config)
    text = TextFormatter(tokenizer, apply_chat_template=config.apply_chat_template,
                         input_template=config.input_template, max_len=config.max_len)
    train_examples = encode_data(plan, objective, text, config.data, split=config.data_split, what="--data",
                                 probs=config.mixing_probs)
    truncated = text.truncated
    eval_examples = (encode_data(plan, objective, text, config.eval_data, split=config.eval_split,
                                 what="--eval-data") if config.eval_data else [])
    if text.truncated and dist.is_main:
        log.warning("%d sequence(s) were longer than --max-len %d and lost the end of their response "
                    "(%d in --data)", text.truncated, config.max_len, truncated)
    plan = plan.with_examples(len(train_examples))

    model = adapter.load(config.model, role="reward" if plan.head == "score" else "policy")
    if dist.ring is not None:
        check_ring_model(model, dist.ring.head_stride)
    backend = plan.choices["backend"].load()(model, plan.component_config("backend"))
    trained = TrainedModel(model, backend, dist)
    router_aux = RouterAux.attach(model, config.aux_loss_coef, config.model)
    reference = adapter.load(config.model, role="reference") if plan.needs_reference else None
    teacher = adapter.load(config.teacher, role="reference") if plan.needs_teacher else None
    parts = FitParts(objective=objective, trained=trained, reference=reference, teacher=teacher,
                 train_examples=train_examples, eval_examples=eval_examples, pad_token_id=tokenizer.pad_token_id,
                 export=lambda out_dir, extra: export_model(adapter, tokenizer, trained, out_dir, dist,
                                                       prompt_format=PromptFormat.of(config), config_entries=extra),
                 dist=dist, router_aux=router_aux)
    return parts, plan


def fit(config: FitConfig, *, plugins: PluginSet | None = None) -> Path:
    """Run offline training with the local runtime; returns the run directory."""
    plugins = plugins or build_plugin_manager()
    plan = FitPlan.make(config, plugins)
    dist = init_from_environment().with_rings(config.ring_attn_size, config.ring_head_stride)
    parts, lock = None, None
    try:
        lock = start_run(plan, plugins, world_size=dist.dp_size, is_main=dist.is_main)
        parts, plan = build_parts(plan, dist)
        return FitLoop(plan, plugins, parts).run()
    finally:
        del parts  # the models and their backends (which hold process groups) go before the group does
        dist.close()
        if lock is not None:
            lock.release()
