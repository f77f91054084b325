"""Contract of an offline objective (``register_objectives``), on a tiny random Llama.

Rows (the class's ``sample_rows``, else one short string per column) are encoded, collated and
passed to ``loss`` with the models the objective declares (reference, teacher, score head): the
loss is a finite scalar whose gradient reaches the trained model's weights and is finite;
metrics are finite numbers or ``(mean, weight)`` pairs; ``units`` is positive; and the loop's
normalisation holds: the micro-batch means weighted by their units add up to the whole batch's
(so a step's gradient does not depend on the micro-batch size). Optional class attribute
``sample_settings``: settings the check uses instead of the defaults (e.g. a placeholder token).
"""

from __future__ import annotations

import json
import math
from typing import Any

from rlhf.plugin_kit.checks.target import Target, guarded

TEXTS = ["What is 2 + 3?", "The answer is 5.", "Say hello to the world.", "hello world!"]


def check(target: Target) -> list[str]:
    import torch

    from rlhf.core.plugin_host.settings import resolve_flag
    from rlhf.core.protocols.objective import BadRow, FitModels, SkipExample
    from rlhf.core.plugin_host.contracts import declared
    from rlhf.core.plugin_host.settings import build_component_config
    from rlhf.plugin_kit.checks.target import CHECK_RUN_VALUES
    from rlhf.runtime.fit.text import TextFormatter

    ref = str(target.tiny_model())
    settings = dict(declared(target.obj, "sample_settings") or {})
    config = None
    if target.config_cls is not None:
        try:
            config = build_component_config(target.config_cls, settings=settings, run_values={
                **CHECK_RUN_VALUES, "model": ref, "tokenizer": ref}, who=target.label, flag="--objective")
        except Exception as exc:
            raise target.fail(f"its config class cannot be built for the check: {exc}") from exc
    objective = guarded(target, "creating the objective", lambda: target.obj(config))
    flags = target.capabilities
    head = flags.get("head", "lm")
    adapter = _adapter(target)
    tokenizer = adapter.load_tokenizer(ref)
    text = TextFormatter(tokenizer, max_len=64)
    columns = guarded(target, "columns()", objective.columns)
    rows = list(declared(target.obj, "sample_rows") or
                [{c: TEXTS[(i + j) % len(TEXTS)] for j, c in enumerate(columns)} for i in range(4)])
    examples = []
    for i, row in enumerate(rows):
        try:
            examples.append(objective.encode(row, text))
        except (SkipExample, BadRow) as exc:
            raise target.fail(f"encode rejected check row {i} {row} ({type(exc).__name__}: {exc}); give the class "
                              "sample_rows = [...] that it accepts") from exc
        except Exception as exc:
            raise target.fail(f"encode(row {i}) raised {type(exc).__name__}: {exc}") from exc
    if len(examples) < 2:
        raise target.fail("the check needs at least two rows (sample_rows)")
    examples = guarded(target, "step_examples()", lambda: objective.step_examples(examples))
    lines = [f"columns {columns}: {len(examples)} rows encoded"]

    torch.manual_seed(0)
    model = adapter.load(ref, role="reward" if head == "score" else "policy")
    model.eval()  # no dropout: the split check compares numbers
    models = FitModels(
        model=model,
        reference=adapter.load(ref, role="reference") if resolve_flag(flags.get("needs_reference"), config) else None,
        teacher=adapter.load(ref, role="reference") if resolve_flag(flags.get("needs_teacher"), config) else None)
    pad = tokenizer.pad_token_id

    def run(part: list[Any], what: str) -> tuple[Any, dict[str, Any], float]:
        batch = guarded(target, f"collate ({what})", lambda: objective.collate(part, pad))
        if not isinstance(batch, dict):
            raise target.fail(f"collate should return a dict of tensors, got {type(batch).__name__}")
        with torch.no_grad():
            stats = guarded(target, "step_statistics", lambda: objective.step_statistics(models, batch))
        units = float(guarded(target, "units", lambda: objective.units(batch)))
        if not units > 0:
            raise target.fail(f"units(batch) should be positive, got {units} ({what})")
        result = guarded(target, f"loss ({what})", lambda: objective.loss(models, batch, stats_all or stats or {}))
        if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], dict)):
            raise target.fail(f"loss should return (loss tensor, metrics dict), got {type(result).__name__}")
        loss, metrics = result
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise target.fail(f"the loss should be a scalar tensor, got "
                              f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__}")
        if not torch.isfinite(loss):
            raise target.fail(f"the loss is {loss.item()} ({what})")
        return loss, metrics, units

    stats_all = None
    with torch.no_grad():
        stats_all = objective.step_statistics(models, objective.collate(examples, pad))
    loss, metrics, units = run(examples, "all rows")
    for key, value in metrics.items():
        pair = value if isinstance(value, tuple) else (value, 1.0)
        numbers = [v.item() if hasattr(v, "item") else v for v in pair]
        if len(numbers) != 2 or not all(isinstance(v, (int, float)) and math.isfinite(v) for v in numbers):
            raise target.fail(f"metric {key!r} should be a finite float or a (mean, weight) pair, got {value!r}")
    lines.append(f"loss {loss.item():.4g} over {units:g} units, finite; {len(metrics)} finite metric(s)")
    if not loss.requires_grad:
        raise target.fail("the loss does not depend on the trained model (no gradient)")
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad and p.grad is not None]
    if not grads or not any((g != 0).any() for g in grads):
        raise target.fail("no gradient reaches the trained model's weights; compute the loss from models.model")
    if not all(torch.isfinite(g).all() for g in grads):
        raise target.fail("the gradient on the trained model's weights is NaN or inf")
    model.zero_grad()
    lines.append("gradient flows to the trained model, finite")

    half = len(examples) // 2
    parts = [run(examples[:half], "first half"), run(examples[half:], "second half")]
    combined = sum(p[0].detach() * p[2] for p in parts) / sum(p[2] for p in parts)
    if not torch.allclose(combined, loss.detach(), atol=1e-4, rtol=1e-3):
        raise target.fail(f"the micro-batch losses weighted by units(batch) give {combined.item():.6g}, the whole "
                          f"batch {loss.item():.6g}: loss must be the mean over units(batch), so the step gradient "
                          "does not depend on the micro-batch size")
    lines.append("two micro-batches weighted by their units give the whole batch's loss")
    extra = guarded(target, "output_config", lambda: objective.output_config(stats_all or {}))
    try:
        json.dumps(extra)
    except (TypeError, ValueError) as exc:
        raise target.fail(f"output_config should return JSON-serialisable entries: {exc}") from exc
    return lines


def _adapter(target: Target) -> Any:
    """The ``hf`` model adapter, as ``rlhf fit`` would build it by default."""
    from rlhf.plugin_kit.checks.target import CHECK_RUN_VALUES

    if target.plugins is None:
        raise target.fail("checking an objective needs the installed plugins (for the hf model adapter)")
    component = target.plugins.registry("model").component("hf")
    from rlhf.core.plugin_host.settings import build_component_config

    config = build_component_config(component.load_config_cls(), settings={}, run_values=CHECK_RUN_VALUES,
                                    who="the 'hf' model adapter", flag="--model-adapter")
    return component.load()(config)

