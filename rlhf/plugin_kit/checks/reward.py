"""Contract of a reward function (``register_rewards``).

Called the way a run calls it (by signature, batched or per sample, sync or async) on a batch of
synthetic samples: it returns one score per sample, each a finite number or None; it survives
pickling (Ray ships reward functions to workers by reference, so they must be importable by
module path); a second call gives the same scores (no hidden state between batches is assumed
by the runtime, but randomness is reported).
"""

from __future__ import annotations

import asyncio
import inspect
import pickle
from typing import Any

from rlhf.plugin_kit.checks.target import Target, finite_number

PROMPTS = ["What is 2 + 3?", "Say hello.", "Name a colour.", "What is 6 times 7?"]
COMPLETIONS = ["The answer is 5.", "hello world", "", "\\boxed{42}"]
LABELS = ["5", "hello", "red", "42"]


def check(target: Target) -> list[str]:
    from rlhf.rewards.calling import batch_inputs, plan_call, sample_inputs
    from rlhf.rewards.returns import BadReturn, batched_return, sample_return
    from rlhf.rewards.source import RewardBatch

    fn = target.obj
    flags = target.capabilities
    try:
        plan = plan_call(fn, target.label, batched=flags.get("batched"), is_async=flags.get("is_async"))
    except Exception as exc:
        raise target.fail(str(exc)) from exc
    batch = RewardBatch.from_lists(PROMPTS, COMPLETIONS, LABELS, completion_ids=[[1, 2]] * len(PROMPTS),
                                   data_source=["check"] * len(PROMPTS))
    n = len(batch)

    def call(inputs: dict[str, Any]) -> Any:
        kwargs = inputs if plan.var_keyword else {k: v for k, v in inputs.items() if k in plan.names}
        missing = [p.name for p in plan.params if p.name not in kwargs and p.default is inspect.Parameter.empty]
        if missing:
            raise target.fail(f"declares parameter(s) {', '.join(missing)} that a run does not pass; a reward "
                              "receives prompts, completions, labels, queries, completion_ids and dataset columns")
        try:
            result = fn(**kwargs)
            if inspect.isawaitable(result):
                result = asyncio.run(_await(result))
        except Exception as exc:
            raise target.fail(f"raised {type(exc).__name__}: {exc}") from exc
        return result

    def scores() -> list[Any]:
        try:
            if plan.batched:
                values, _, _ = batched_return(call(batch_inputs(batch, plan)), n)
                return values
            return [sample_return(call(sample_inputs(batch, i)))[0] for i in range(n)]
        except BadReturn as exc:
            raise target.fail(f"returned the wrong thing: {exc}") from exc

    values = scores()
    if len(values) != n:
        raise target.fail(f"returned {len(values)} score(s) for {n} samples; return one per sample")
    for i, value in enumerate(values):
        number = value.item() if hasattr(value, "item") else value
        if number is not None and not finite_number(number):
            raise target.fail(f"score {i} is {value!r}; scores must be finite numbers or None")
    style = ("batched" if plan.batched else "per sample") + (", async" if plan.is_async else ", sync")
    lines = [f"called {style} on {n} samples: {n} scores, each a finite number or None ({values})"]
    again = scores()
    if [_plain(v) for v in again] != [_plain(v) for v in values]:
        lines.append(f"note: a second call gave different scores ({again}); runs are reproducible only "
                     "if the reward is deterministic")
    try:
        restored = pickle.loads(pickle.dumps(fn))
    except Exception as exc:
        raise target.fail(f"cannot be pickled ({type(exc).__name__}: {exc}); Ray workers need it: define it at "
                          "module level (no lambda or closure) in an importable module") from exc
    if not callable(restored):
        raise target.fail("does not survive pickling as a callable")
    lines.append("pickles (Ray can ship it to workers)")
    return lines


async def _await(value: Any) -> Any:
    return await value


def _plain(value: Any) -> Any:
    return value.item() if hasattr(value, "item") else value
