"""Mutation testing of the math and the training wiring: would the fast tests notice a bug?

    python tools/mutate.py                      # curated mutants + 120 drawn from the operators below
    python tools/mutate.py --sample 0           # only the curated ones (wiring bugs reviews found)
    python tools/mutate.py --per-area 15        # curated + 15 drawn from each area
    python tools/mutate.py --sample 400 --jobs 2 --seed 3 --json mutants.json
    python tools/mutate.py --files rlhf/algorithms/training_loss.py --sample 10 --tests tests/algorithms
    python tools/mutate.py --per-area 12 --areas "fast paths" "run lifecycle" --focused   # a quick sample
    python tools/mutate.py --since main~3 --sample 30 --focused   # only lines changed since that commit

Each mutant changes one spot of one file in a copy of the repository (never this checkout) and
runs the fast tests of the file's area there (`AREAS`, ``-x``: their `unit` and `run` tiers, not the
`LEARNING_TESTS`); a mutant is *killed* when they
fail (or time out), and *survives* when they pass. Survivors are printed with file, line and
change: each is a missing test or an equivalent mutant. The kill rate is killed / (killed +
survived), printed per area (RL math, RL wiring, fit loop, objectives, fast paths, run lifecycle,
data generation, ...) and in all. ``--focused`` runs each mutant against its area's own tests only
(`FOCUS`): minutes instead of an hour on a small machine, a lower bound on the kill rate whose
survivors are then confirmed against the full list.

Operators (applied to the `TARGETS` files, outside docstrings, asserts, f-strings, annotations
and ``raise`` statements): arithmetic and comparison operators swapped, unary minus and ``not``
dropped, ``and``/``or`` swapped, numeric and boolean constants changed, ``.detach()`` /
``.clamp()`` / ``.float()`` removed, one keyword argument of a call dropped, confusable names
swapped (``loss_mask``/``action_mask``, ...), ``[:-1]`` slices shifted, ``if`` conditions negated.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

RL_TESTS = ["tests/algorithms", "tests/runtime/test_batches.py", "tests/runtime/test_training_math.py",
            "tests/runtime/test_model_pieces.py",
            "tests/runtime/test_train.py", "tests/runtime/test_settings.py", "tests/runtime/test_data.py",
            "tests/runtime/test_multiturn.py",
            "tests/rewards/test_failures.py", "tests/rewards/test_conventions.py",
            "tests/runtime/test_rl_extensions.py", "tests/runtime/test_async.py",
            "tests/fastpaths/test_prefix_sharing.py", "tests/fastpaths/test_lean_decode.py",
            "tests/fastpaths/test_packed_head.py", "tests/runtime/test_inverse_cdf.py",
            "tests/fastpaths/test_blocked_head.py", "tests/runtime/test_decode_softmax.py",
            "tests/fastpaths/test_in_place_gradients.py",
            "tests/runtime/test_zero_advantage_rows.py", "tests/fastpaths/test_fast_paths.py",
            "tests/fastpaths/test_packing.py", "tests/fastpaths/test_segment_attention.py",
            "tests/fastpaths/test_cpu_linear.py", "tests/runtime/test_rl_combinations.py",
            "tests/runtime/test_run_lifecycle.py", "tests/runtime/test_sampling_options.py",
            "tests/runtime/test_model_card.py", "tests/datagen/test_labels.py",
            "tests/runtime/test_ordered_backward.py", "tests/runtime/test_threads.py",
            "tests/runtime/test_checkpoint_integrity.py", "tests/fastpaths/test_vocab_chunks.py",
            "tests/fastpaths/test_known_gradient.py",
            "tests/runtime/test_heap.py", "tests/core/test_outcomes.py",
            "tests/runtime/test_failure_policies.py", "tests/runtime/test_outcomes_runs.py",
            "tests/plugin_kit/test_conformance.py",
            "tests/runtime/test_teacher_runs.py", "tests/viewer/test_token_log.py"]
OFFLINE_TESTS = ["tests/objectives", "tests/rewards/test_reward_model.py", "tests/rewards/test_rm_train_and_score_agree.py",
                 "tests/runtime/test_data.py", "tests/fastpaths/test_packing.py", "tests/rewards/test_specs.py",
                 "tests/runtime/test_hf_exports.py", "tests/runtime/test_clear_errors.py"]
# issue tests-bite-4: the tests written for what the audit of data generation, the fast paths, the run
# lifecycle and the fit loop found unguarded
FIT_TESTS = ["tests/objectives/test_eval_loss_weights.py", "tests/rewards/test_reward_model_truncation.py",
             "tests/objectives/test_fit_reports.py"]
LIFECYCLE_TESTS = ["tests/runtime/test_checkpoint_discovery.py", "tests/runtime/test_resume_options.py",
                   "tests/runtime/test_interrupt_resume.py", "tests/runtime/test_thread_messages.py",
                   "tests/sandbox/test_hidden_run_data.py"]
FASTPATH_TESTS = ["tests/fastpaths/test_verdicts.py", "tests/fastpaths/test_shared_mask_by_hand.py",
                  "tests/fastpaths/test_ring_in_process.py"]
DATAGEN_TESTS = ["tests/datagen", "tests/runtime/test_run_lock.py"]

# Tests of the areas below that no mutant runs: they train for a minute or more to show that a task is learnt,
# where the value and end-to-end tests of the same areas see a wrong formula or wiring in seconds.
LEARNING_TESTS = ["tests/objectives/test_learning.py", "tests/objectives/test_pipeline.py",
                  "tests/quickstart/test_distillation_learning.py"]

# area: (files mutated, fast tests run on each of its mutants). Kill rates are reported per area.
AREAS = {
    "RL math": ([
        "rlhf/algorithms/advantages.py", "rlhf/algorithms/losses.py", "rlhf/algorithms/training_loss.py",
        "rlhf/algorithms/presets.py", "rlhf/algorithms/kl_control.py", "rlhf/algorithms/conformance.py",
        "rlhf/algorithms/distillation.py",
        "rlhf/core/masked.py", "rlhf/core/batch.py",
        "rlhf/plugins/algorithms/policy_losses.py", "rlhf/plugins/algorithms/gae.py",
        "rlhf/plugins/algorithms/groups.py", "rlhf/plugins/algorithms/grpo.py",
        "rlhf/plugins/algorithms/reinforce.py", "rlhf/plugins/algorithms/returns.py",
        "rlhf/plugins/algorithms/rloo.py", "rlhf/rewards/combine.py",
        "rlhf/plugins/filters/dynamic.py", "rlhf/plugins/shaping/overlong.py", "rlhf/plugins/shaping/truncation.py",
    ], RL_TESTS),
    "RL wiring": ([
        "rlhf/runtime/rl/workers.py", "rlhf/runtime/step/micro_batches.py", "rlhf/runtime/rl/experience.py",
        "rlhf/runtime/rl/trainer.py", "rlhf/runtime/rl/local.py", "rlhf/runtime/config/train_plan.py",
        "rlhf/runtime/config/plan.py", "rlhf/runtime/run/evaluation.py",
        "rlhf/runtime/rl/step_metrics.py", "rlhf/runtime/rl/async_generation.py", "rlhf/plugins/models/hf.py",
        "rlhf/runtime/rl/batches.py", "rlhf/runtime/rl/scoring.py", "rlhf/runtime/rl/ranks.py",
        "rlhf/runtime/rl/events.py", "rlhf/runtime/rl/guards.py", "rlhf/runtime/rl/failures.py",
        "rlhf/core/outcomes.py", "rlhf/runtime/rl/token_log.py",
    ], RL_TESTS),
    "fit loop": ([
        "rlhf/runtime/fit/loop.py", "rlhf/runtime/fit/data.py", "rlhf/runtime/fit/text.py", "rlhf/runtime/fit/local.py",
    ], OFFLINE_TESTS + FIT_TESTS),
    "objectives": ([
        "rlhf/objectives/batching.py", "rlhf/objectives/language.py", "rlhf/objectives/preference.py",
        "rlhf/objectives/process.py", "rlhf/plugins/objectives/sft.py", "rlhf/plugins/objectives/reward_model.py",
        "rlhf/plugins/objectives/dpo.py", "rlhf/plugins/objectives/kto.py", "rlhf/plugins/objectives/prm.py",
        "rlhf/plugins/objectives/distill.py", "rlhf/plugins/objectives/pairs.py", "rlhf/rewards/reward_model.py",
    ], OFFLINE_TESTS + FIT_TESTS),
    "run lifecycle": ([
        "rlhf/runtime/run/best_model.py", "rlhf/runtime/run/lifecycle.py", "rlhf/runtime/step/trained.py",
        "rlhf/runtime/run/run_dir.py", "rlhf/runtime/run/checkpoint.py", "rlhf/runtime/run/threads.py",
        "rlhf/runtime/run/heap.py",
    ], RL_TESTS + OFFLINE_TESTS + LIFECYCLE_TESTS),
    "fast paths": ([
        "rlhf/core/logprobs.py", "rlhf/fastpaths/prefix_sharing.py", "rlhf/fastpaths/segment_attention.py",
        "rlhf/fastpaths/cpu_linear.py", "rlhf/fastpaths/lean_decode.py", "rlhf/plugins/engines/hf.py",
        "rlhf/fastpaths/packing.py", "rlhf/fastpaths/verdicts.py", "rlhf/fastpaths/llama_like.py",
        "rlhf/core/ordered_gather.py", "rlhf/fastpaths/vocab_chunks.py", "rlhf/fastpaths/in_place_gradients.py",
        "rlhf/fastpaths/packed_head.py", "rlhf/plugins/engines/sampling.py", "rlhf/fastpaths/blocked_head.py",
    ], RL_TESTS + OFFLINE_TESTS + ["tests/fastpaths/test_transformers_contract.py"] + FASTPATH_TESTS),
    "parallelism and memory": ([
        "rlhf/runtime/step/router_aux.py", "rlhf/fastpaths/ring_attention.py", "rlhf/runtime/ray/weight_broadcast.py",
        "rlhf/core/offload.py", "rlhf/rewards/threads.py",
    ], ["tests/models/test_moe_aux_loss.py", "tests/fastpaths/test_ring_attention.py",
        "tests/runtime/test_weight_broadcast.py", "tests/runtime/test_offload.py", "tests/rewards/test_call_limit.py",
        "tests/runtime/test_async.py", "tests/fastpaths/test_ring_in_process.py"]),
    "rollouts": ([
        "rlhf/runtime/rl/rollout.py", "rlhf/plugins/engines/hf_continuous.py", "rlhf/runtime/rl/draw_order.py",
    ], ["tests/runtime/test_continuous_batching.py", "tests/runtime/test_multiturn.py", "tests/runtime/test_async.py",
        "tests/runtime/test_outcomes_runs.py", "tests/runtime/test_partial_rollouts.py",
        "tests/agents/test_agent_rollout.py", "tests/runtime/test_decode_softmax.py"]),
    "off-policy": ([
        "rlhf/runtime/rl/offpolicy/schedule.py", "rlhf/runtime/rl/offpolicy/partial.py",
        "rlhf/runtime/rl/offpolicy/served.py",
    ], ["tests/runtime/test_offpolicy_schedule.py", "tests/runtime/test_partial_rollouts.py",
        "tests/runtime/test_version_pool.py", "tests/runtime/test_async.py"]),
    "plugin mechanism": ([
        "rlhf/core/plugin_host/registry.py", "rlhf/core/plugin_host/settings.py", "rlhf/runtime/config/options.py", "rlhf/runtime/config/train_config.py",
    ], ["tests/core", "tests/runtime/test_plugin_flags.py", "tests/runtime/test_settings.py",
        "tests/plugin_kit/test_checks_broken.py", "tests/plugin_kit/test_checks_builtin.py"]),
    "datagen": ([
        "rlhf/datagen/generate.py", "rlhf/datagen/score.py", "rlhf/datagen/evaluate.py", "rlhf/datagen/iterate.py",
        "rlhf/datagen/rows.py", "rlhf/datagen/output.py", "rlhf/datagen/chat.py", "rlhf/datagen/components.py",
    ], DATAGEN_TESTS),
}
# --focused: each area's own tests (a sample in minutes on a small machine; a mutant that survives them
# may still die in the area's full list above, so survivors are to be confirmed with it)
FOCUS = {
    "fast paths": ["tests/fastpaths/test_verdicts.py", "tests/fastpaths/test_shared_mask_by_hand.py",
                   "tests/fastpaths/test_ring_in_process.py", "tests/fastpaths"],
    "parallelism and memory": ["tests/fastpaths/test_ring_in_process.py", "tests/fastpaths/test_ring_attention.py"],
    "run lifecycle": LIFECYCLE_TESTS + [
        "tests/runtime/test_run_lifecycle.py", "tests/runtime/test_checkpoint_integrity.py", "tests/runtime/test_run_lock.py",
        "tests/objectives/test_eval_and_best.py", "tests/runtime/test_threads.py", "tests/runtime/test_heap.py",
        "tests/runtime/test_hf_exports.py", "tests/objectives/test_fit.py"],
    "fit loop": FIT_TESTS + OFFLINE_TESTS,
    "objectives": FIT_TESTS + OFFLINE_TESTS,
    "datagen": DATAGEN_TESTS,
    "off-policy": ["tests/runtime/test_offpolicy_schedule.py", "tests/runtime/test_partial_rollouts.py",
                   "tests/runtime/test_version_pool.py"],
}
TARGETS = [file for files, _ in AREAS.values() for file in files]


def area_of(file: str) -> str:
    return next((name for name, (files, _) in AREAS.items() if file in files), "other")


def tests_of(file: str, focused: bool = False) -> list[str]:
    """The fast tests a mutant of ``file`` runs (its area's; every area's for a file in none); ``focused``:
    the area's own tests (`FOCUS`) where it has such a list."""
    area = area_of(file)
    if area == "other":
        return list(dict.fromkeys(t for _, tests in AREAS.values() for t in tests))
    if focused and area in FOCUS:
        return list(dict.fromkeys(FOCUS[area]))
    return AREAS[area][1]


# (file, text, replacement, what): the wiring bugs a design review found (issue 14), always run.
CURATED = [
    ("rlhf/fastpaths/verdicts.py", "agrees = math.isfinite(difference) and difference <= tolerance", "agrees = True",
     "a fast path that differs from the plain path is still taken"),
    ("rlhf/fastpaths/prefix_sharing.py", '        return "prefix_sharing/segment"\n    return "prefix_sharing/masked"',
     '        return "prefix_sharing/masked"\n    return "prefix_sharing/masked"',
     "one sharing verdict for the masked and the segment forward"),
    ("rlhf/plugins/engines/hf.py", "to_check, worst = min(LEAN_CHECK_STEPS, params.max_new_tokens - 1), 0.0",
     "to_check, worst = 1, 0.0", "the lean step checked on its first decode step only, not as the cache grows"),
    ("rlhf/fastpaths/lean_decode.py", "{'padded' if self.padded else 'unpadded'}", "padded",
     "one lean verdict for padded and unpadded prompts"),
    ("rlhf/fastpaths/lean_decode.py", 'head = "" if self.output is self.head else "/"',
     'head = "" if True else "/"', "an output layer packed or in blocks taken on the plain lean step's verdict, "
     "never checked itself"),
    ("rlhf/fastpaths/lean_decode.py", 'else "blocked_head")', 'else "packed_head")',
     "the blocked output layer taken on the packed one's verdict"),
    ("rlhf/fastpaths/packing.py", 'if not verdict(self.model, path):', "if False:",
     "packed log-probs used although they differ from the padded forward"),
    ("rlhf/fastpaths/packing.py",
     'return "packing/segments" if _per_sequence_layout(model, packed) is not None else "packing/masked"',
     'return "packing"', "one packing verdict for the per-sequence and the masked packed forwards"),
    ("rlhf/algorithms/training_loss.py", "total = total - entropy_coef * aggregate(",
     "total = total + entropy_coef * aggregate(", "entropy bonus with the wrong sign"),
    ("rlhf/algorithms/training_loss.py", "kl = clamped_kl(kl_estimator, logprobs, ref_logprobs,",
     "kl = clamped_kl(kl_estimator, logprobs.detach(), ref_logprobs,", "KL in the loss on detached log-probs"),
    ("rlhf/algorithms/training_loss.py", "advantages=batch.advantages, loss_mask=batch.loss_mask,",
     "advantages=batch.advantages, loss_mask=batch.action_mask,", "loss masked with action_mask, not loss_mask"),
    ("rlhf/runtime/rl/workers.py", "micro,\n                                                   temperature=self.training_loss.temperature,",
     "micro, temperature=1.0,", "temperature not passed to the training log-probs"),
    ("rlhf/algorithms/presets.py", "return optimizer_steps_per_rollout > 1 or self.kl_in_reward",
     "return self.kl_in_reward", "old log-probs not recomputed for several optimizer steps"),
    ("rlhf/runtime/rl/experience.py", "sample_mask=batch.sample_mask.bool(), source_rewards=",
     "source_rewards=", "sample_mask dropped before the advantages"),
    ("rlhf/runtime/rl/workers.py", "micro.batch.attention_mask.to(self.device))[:, :-1])",
     "micro.batch.attention_mask.to(self.device))[:, 1:])", "critic values read one position late"),
    ("rlhf/runtime/rl/workers.py", "values = model(batch.input_ids, batch.attention_mask)[:, :-1]",
     "values = model(batch.input_ids, batch.attention_mask)[:, 1:]", "critic trained one position late"),
    ("rlhf/plugins/models/hf.py", 'return self._from_pretrained("AutoModelForCausalLM", ref).eval().requires_grad_(False)',
     "return self._policy[1]", "the reference is the policy module"),
    ("rlhf/runtime/rl/workers.py", "temperature=self.temperature, device=self.device)[0]",
     "temperature=1.0, device=self.device)[0]", "reference log-probs at temperature 1"),
    ("rlhf/algorithms/training_loss.py", "kl = kl.clamp(min=-KL_CLAMP, max=KL_CLAMP)", "kl = kl",
     "KL not clamped"),
    ("rlhf/runtime/rl/workers.py", "norm = step_norm(minibatch, self.settings.max_new_tokens)",
     "norm = step_norm(minibatch.select(torch.arange(min(self.settings.micro_batch_size, minibatch.size))), "
     "self.settings.max_new_tokens)",
     "loss normalised per micro-batch instead of per step"),
    ("rlhf/runtime/rl/workers.py", "minibatch, kept = self._rows_that_train(minibatch, trained_rows, share and",
     "norm = step_norm(self._rows_that_train(minibatch, trained_rows, False, metrics)[0], "
     "self.settings.max_new_tokens)\n"
     "            minibatch, kept = self._rows_that_train(minibatch, trained_rows, share and",
     "the step's counts leave out the skipped zero-advantage rows"),
    ("rlhf/algorithms/training_loss.py", "if self.kl_coef > 0 or self.entropy_coef > 0 or not",
     "if not", "zero-advantage rows skipped although the KL or entropy term trains them"),
    ("rlhf/runtime/rl/workers.py", "if bool(keep.any()) else torch.zeros(1, dtype=torch.long)",
     "if bool(keep.any()) else torch.zeros(0, dtype=torch.long)",
     "a minibatch where no row trains leaves the gradients None (AdamW skips momentum and decay)"),
    ("rlhf/fastpaths/segment_attention.py", "dtype=torch.bool, device=device).tril() & layout.segment_valid[:, :, None, :]",
     "dtype=torch.bool, device=device).tril()", "a segment's queries see the padding slots of its own keys"),
    ("rlhf/fastpaths/segment_attention.py", "seen = (layout.prefix_valid[:, None, :] & causal)",
     "seen = (layout.prefix_valid[:, None, :] | causal)", "the prefix attends past a shorter group's prefix"),
    ("rlhf/runtime/rl/workers.py", "tokens = float(micro.batch.loss_mask.sum())",
     "tokens = float(micro.batch.action_mask.sum())", "policy metrics weighted by action, not loss, tokens"),
    ("rlhf/fastpaths/cpu_linear.py", "grad_x = onednn_product(grad_rows, weight.t())",
     "grad_x = onednn_product(grad_rows, weight)",
     "oneDNN linear: the input gradient through W, not Wᵀ"),
    ("rlhf/fastpaths/cpu_linear.py", "grad_weight = onednn_product(grad_rows.t(), rows.t())",
     "grad_weight = onednn_product(rows.t(), grad_rows.t())", "oneDNN linear: the weight gradient transposed"),
    ("rlhf/fastpaths/cpu_linear.py", "grad_bias = grad_rows.sum(dim=0)", "grad_bias = grad_rows.mean(dim=0)",
     "oneDNN linear: the bias gradient averaged over rows"),
    ("rlhf/algorithms/training_loss.py", "    total = aggregate(loss_aggregation or aggregation, per_token, loss_mask, norm)",
     "    total = aggregate(aggregation, per_token, loss_mask, norm)", "gspo's own aggregation ignored in training"),
    ("rlhf/algorithms/training_loss.py", "        if not self.loss_aggregation.capabilities.get(\"sums_rows\"):",
     "        if not self.aggregation.capabilities.get(\"sums_rows\"):",
     "zero-advantage rows judged by the run's aggregation, not the loss's own"),
    # the offline half (issue 31): objectives feeding the wrong tensor into correct math, masks, positions
    ("rlhf/plugins/objectives/dpo.py", "ref_sums, _ = sequence_logprobs(forward(models.reference), mask)",
     "ref_sums, _ = sequence_logprobs(forward(models.model), mask)", "dpo: the reference log-probs taken from the policy"),
    ("rlhf/plugins/objectives/dpo.py", "nll = -means[:pairs].mean()", "nll = -means[pairs:].mean()",
     "dpo: --nll-coef's term on the rejected responses"),
    ("rlhf/plugins/objectives/kto.py",
     "reference, _ = sequence_logprobs(learnt_logprobs(models.reference, *inputs), mask)  # (B,)\n        return",
     "reference, _ = sequence_logprobs(learnt_logprobs(models.model, *inputs), mask)  # (B,)\n        return",
     "kto: the reference point from the policy alone (always 0)"),
    ("rlhf/plugins/objectives/kto.py", "other = examples[(index + 1) % len(examples)]", "other = example",
     "kto: the reference point from each sample's own completion, not a mismatched one"),
    ("rlhf/plugins/objectives/kto.py", "undesirable_weight=config.undesirable_weight)",
     "undesirable_weight=config.desirable_weight)", "kto: the desirable weight on the undesirable samples"),
    ("rlhf/plugins/objectives/distill.py", "loss = (1 - coef) * sft + coef * kd", "loss = coef * sft + (1 - coef) * kd",
     "distill: the SFT and KD weights swapped"),
    ("rlhf/objectives/batching.py", "return [0] * prompt_len + [1] * (length - prompt_len)",
     "return [0] * (prompt_len - 1) + [1] * (length - prompt_len + 1)",
     "the loss mask one token early (the prompt's last token learnt)"),
    ("rlhf/objectives/batching.py", "return values.gather(1, last[:, None]).squeeze(1)",
     "return values.gather(1, (last - 1).clamp(min=0)[:, None]).squeeze(1)",
     "rm: trained at the token before the last (scored at the last)"),
    ("rlhf/plugins/objectives/reward_model.py", "margin = batch[\"margin\"] if self.config.margin_key else None",
     "margin = None", "rm: --margin-key ignored"),
    ("rlhf/plugins/objectives/sft.py",
     "start = len(text.ids(text.chat(messages[:index], generation_prompt=True))) if index else 0",
     "start = len(text.ids(text.chat(messages[:index], generation_prompt=False))) if index else 0",
     "--multiturn: the generation prompt learnt with each assistant turn"),
    ("rlhf/plugins/objectives/prm.py", "per_token[position] = label", "per_token[position - 1] = label",
     "prm: labels one position before the placeholders"),
    # eval, best model and data order (issue 31)
    ("rlhf/runtime/fit/loop.py", "examples = self.objective.step_examples(list(self.parts.eval_examples))",
     "examples = self.objective.step_examples(list(self.parts.train_examples))", "fit: eval on the training set"),
    ("rlhf/runtime/run/evaluation.py", "return (self.at_start and done == 0) or done == self.total or (",
     "return (self.at_start and done == 0) or (",
     "no final eval when the step count is not a multiple of --eval-every"),
    ("rlhf/runtime/fit/loop.py", "        self.best_model.record = state.get(\"best\")",
     "        self.best_model.record = None", "fit: --resume forgets the best eval"),
    ("rlhf/runtime/fit/data.py", "order = _epoch_order(self.num_examples, self.seed, epoch)",
     "order = _epoch_order(self.num_examples, self.seed, 0)", "fit: the same shuffle every epoch"),
    ("rlhf/runtime/run/best_model.py", "        if not math.isfinite(value):\n            return\n", "",
     "a NaN eval becomes the best"),
    ("rlhf/runtime/run/best_model.py", "if not (value < best if direction == \"min\" else value > best):",
     "if not (value <= best if direction == \"min\" else value >= best):", "a tie replaces the best"),
    ("rlhf/runtime/run/evaluation.py",
     "self.best_model.record, self.last = state.get(\"best\"), state.get(\"last_eval\") or {}",
     "self.best_model.record, self.last = None, state.get(\"last_eval\") or {}", "RL: --resume forgets the best eval"),
    # RL options in combination (issue 31)
    ("rlhf/runtime/rl/experience.py", "        if old is None and (self.recompute_old or teacher is not None):\n",
     "        if self.recompute_old or teacher is not None:\n",
     "async: old log-probs recomputed with the trained policy, not the behaviour's"),
    ("rlhf/runtime/rl/async_generation.py", "        if self.staleness > 0:\n            prepared.batch = replace(",
     "        if self.staleness > 1:\n            prepared.batch = replace(",
     "async: the producer's behaviour log-probs dropped at staleness 1"),
    ("rlhf/runtime/rl/trainer.py", "        self.kl.update(sequence_kl(batch, metrics), batch.size)\n", "",
     "adaptive KL: β never updated"),
    # on-policy distillation (--teacher, issue 51)
    ("rlhf/runtime/rl/trainer.py", "metadata=[row_metadata(t) for t in trajectories], teacher=w.teacher)",
     "metadata=[row_metadata(t) for t in trajectories], teacher=None)", "opd: the teacher never consulted"),
    ("rlhf/runtime/rl/experience.py", "teacher_advantages(old, tea, batch.loss_mask, coef=self.teacher_coef)",
     "teacher_advantages(old, tea, batch.loss_mask, coef=1.0)", "opd: --teacher-coef ignored"),
    ("rlhf/runtime/rl/experience.py", "teacher_advantages(old, tea, batch.loss_mask,",
     "teacher_advantages(tea, old, batch.loss_mask,", "opd: student and teacher log-probs swapped"),
    ("rlhf/algorithms/distillation.py", "return -coef * reverse_kl(", "return coef * reverse_kl(",
     "opd: the reverse KL rewarded, not penalised"),
    ("rlhf/runtime/rl/local.py", "    check_teacher_tokenizer(plan, adapter, tokenizer)\n", "",
     "opd: the teacher's tokenizer never compared"),
    ("rlhf/runtime/rl/local.py", "return _frozen_scorer(plan, adapter, plan.config.teacher, dist, policy)",
     "return _frozen_scorer(plan, adapter, plan.config.model, dist, policy)",
     "opd: the student's base loaded as the teacher"),
    ("rlhf/runtime/rl/trainer.py", "teacher_coef=self.config.teacher_coef if self.config.teacher_coef is not None",
     "teacher_coef=1.0 if self.config.teacher_coef is not None", "opd: --teacher-coef not passed to the experience"),
]

SWAP_OPS = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult, ast.Pow: ast.Mult,
            ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq, ast.NotEq: ast.Eq,
            ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.In: ast.NotIn, ast.NotIn: ast.In, ast.And: ast.Or, ast.Or: ast.And}
CONFUSABLE = {"loss_mask": "action_mask", "action_mask": "loss_mask", "old_logprobs": "rollout_logprobs",
              "ref_logprobs": "old_logprobs", "num_tokens": "num_sequences", "num_sequences": "num_tokens",
              "values": "returns", "returns": "values", "advantages": "returns"}
DROPPED_CALLS = ("detach", "clamp", "float", "clamp_min")


@dataclass
class Mutant:
    file: str
    line: int
    what: str
    source: str  # the whole mutated file
    status: str = "pending"  # killed, survived, timeout, invalid
    seconds: float = 0.0

    @property
    def area(self) -> str:
        return area_of(self.file)


# --- generating mutants ---------------------------------------------------------------------------


class _Spots(ast.NodeVisitor):
    """Nodes worth mutating, with the text that replaces each one."""

    def __init__(self) -> None:
        self.found: list[tuple[ast.AST, str, str]] = []  # (node, replacement source, description)

    def generic_visit(self, node: ast.AST) -> None:
        if isinstance(node, (ast.Assert, ast.Raise, ast.JoinedStr, ast.Import, ast.ImportFrom)):
            return
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body[1:] if ast.get_docstring(node) else node.body
            for child in body:
                self.visit(child)
            return
        if isinstance(node, ast.AnnAssign):
            if node.value is not None:
                self.visit(node.value)
            return
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            return  # a docstring
        self._mutations(node)
        super().generic_visit(node)

    def _add(self, node: ast.AST, new: ast.AST, what: str) -> None:
        self.found.append((node, f"({ast.unparse(new)})", what))

    def _mutations(self, node: ast.AST) -> None:
        import copy

        if isinstance(node, ast.BinOp) and type(node.op) in SWAP_OPS:
            new = copy.deepcopy(node)
            new.op = SWAP_OPS[type(node.op)]()
            self._add(node, new, f"{type(node.op).__name__} -> {type(new.op).__name__}")
        elif isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in SWAP_OPS:
            new = copy.deepcopy(node)
            new.ops = [SWAP_OPS[type(node.ops[0])]()]
            self._add(node, new, f"{type(node.ops[0]).__name__} -> {type(new.ops[0]).__name__}")
        elif isinstance(node, ast.BoolOp):
            new = copy.deepcopy(node)
            new.op = SWAP_OPS[type(node.op)]()
            self._add(node, new, f"{type(node.op).__name__} -> {type(new.op).__name__}")
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.Not)):
            self._add(node, node.operand, f"drop unary {type(node.op).__name__}")
        elif isinstance(node, ast.Constant) and type(node.value) in (int, float, bool):
            value = node.value
            new_value = (not value) if isinstance(value, bool) else (value + 1 if isinstance(value, int) else
                                                                      (value * 2 if value else 1.0))
            self._add(node, ast.Constant(new_value), f"constant {value!r} -> {new_value!r}")
        elif isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr in DROPPED_CALLS:
                self._add(node, func.value, f"drop .{func.attr}()")
            for index, keyword in enumerate(node.keywords):
                if keyword.arg is not None:
                    new = copy.deepcopy(node)
                    del new.keywords[index]
                    self._add(node, new, f"drop keyword {keyword.arg}=")
        elif isinstance(node, ast.Attribute) and node.attr in CONFUSABLE and isinstance(node.ctx, ast.Load):
            new = copy.deepcopy(node)
            new.attr = CONFUSABLE[node.attr]
            self._add(node, new, f".{node.attr} -> .{new.attr}")
        elif isinstance(node, ast.Slice):
            new = None
            if isinstance(node.upper, ast.UnaryOp) and ast.unparse(node.upper) == "-1" and node.lower is None:
                new = ast.Slice(lower=ast.Constant(1), upper=None)
            elif isinstance(node.lower, ast.Constant) and node.lower.value == 1 and node.upper is None:
                new = ast.Slice(lower=None, upper=ast.UnaryOp(ast.USub(), ast.Constant(1)))
            if new is not None:
                self.found.append((node, ast.unparse(new), f"slice {ast.unparse(node)} -> {ast.unparse(new)}"))
        elif isinstance(node, (ast.If, ast.IfExp, ast.While)) and not _is_type_checking(node.test):
            self.found.append((node.test, f"(not ({ast.unparse(node.test)}))", "negate the condition"))


def _is_type_checking(test: ast.AST) -> bool:
    return "TYPE_CHECKING" in ast.unparse(test)


def mutants_of(file: str) -> list[Mutant]:
    source = (ROOT / file).read_text()
    lines = source.splitlines(keepends=True)
    offsets = [0]
    for line in lines:
        offsets.append(offsets[-1] + len(line))
    spots = _Spots()
    spots.visit(ast.parse(source))
    out = []
    for node, replacement, what in spots.found:
        start = offsets[node.lineno - 1] + _char_offset(lines[node.lineno - 1], node.col_offset)
        end = offsets[node.end_lineno - 1] + _char_offset(lines[node.end_lineno - 1], node.end_col_offset)
        mutated = source[:start] + replacement + source[end:]
        try:
            ast.parse(mutated)
        except SyntaxError:
            continue
        out.append(Mutant(file, node.lineno, f"{what}: {_changed_line(source, mutated, node.lineno)}", mutated))
    return out


def _changed_line(source: str, mutated: str, line: int) -> str:
    """The mutated line as it reads now (what a survivor report needs to be understood)."""
    before = source.splitlines()[line - 1]
    after = mutated.splitlines()[line - 1] if len(mutated.splitlines()) >= line else ""
    return f"{before.strip()[:90]!r} -> {after.strip()[:90]!r}" if before != after else after.strip()[:90]


def _char_offset(line: str, byte_offset: int) -> int:
    """ast columns count UTF-8 bytes; the source string counts characters."""
    return len(line.encode()[:byte_offset].decode(errors="ignore"))


def curated_mutants() -> list[Mutant]:
    out = []
    for file, text, replacement, what in CURATED:
        source = (ROOT / file).read_text()
        if source.count(text) != 1:
            raise SystemExit(f"curated mutant {what!r}: {text!r} occurs {source.count(text)} times in {file}")
        line = source[: source.index(text)].count("\n") + 1
        out.append(Mutant(file, line, f"[curated] {what}", source.replace(text, replacement)))
    return out


# --- running them -------------------------------------------------------------------------------


def make_copy() -> Path:
    """A copy of the repository for one worker (the tests and what they read, not .git or .venv)."""
    copy = Path(tempfile.mkdtemp(prefix="rlhf-mutants-"))
    for name in ("rlhf", "tests", "examples", "pyproject.toml", "README.md", ".ci", "docs", "benchmarks"):
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, copy / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        elif source.exists():
            shutil.copy2(source, copy / name)
    return copy


def run_tests(copy: Path, timeout: float, tests: list[str], output: list[str] | None = None) -> str:
    """"survived" when ``tests`` pass in ``copy``, else "killed" (or "timeout"); ``output`` gets pytest's
    last lines."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-m", "not cluster",
               *(f"--ignore={test}" for test in LEARNING_TESTS), *tests]
    try:
        result = subprocess.run(command, cwd=copy, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout"
    if output is not None:
        output.append("\n".join((result.stdout + result.stderr).splitlines()[-40:]))
    return "survived" if result.returncode == 0 else "killed"


def run(mutants: list[Mutant], jobs: int, timeout: float, tests: list[str] | None = None,
        focused: bool = False) -> None:
    """Each mutant against its area's fast tests (``focused``: its area's own), or against ``tests``
    when given (a quicker, narrower sample)."""
    copies = [make_copy() for _ in range(jobs)]
    try:
        every_test = tests or list(dict.fromkeys(t for m in mutants for t in tests_of(m.file, focused)))
        output: list[str] = []
        if run_tests(copies[0], timeout * 5, every_test, output) != "survived":
            raise SystemExit(f"the fast tests fail on the unmutated code (in {copies[0]}); fix that first:\n"
                             + "".join(output))
        free = list(copies)

        def one(mutant: Mutant) -> Mutant:
            copy = free.pop()
            target = copy / mutant.file
            original = target.read_text()
            began = time.perf_counter()
            try:
                target.write_text(mutant.source)
                mutant.status = run_tests(copy, timeout, tests or tests_of(mutant.file, focused))
            finally:
                target.write_text(original)
                free.append(copy)
            mutant.seconds = time.perf_counter() - began
            print(f"{mutant.status:9s} {mutant.seconds:5.1f}s  {mutant.file}:{mutant.line}  {mutant.what}", flush=True)
            return mutant

        with ThreadPoolExecutor(jobs) as pool:
            list(pool.map(one, mutants))
    finally:
        for copy in copies:
            shutil.rmtree(copy, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sample", type=int, default=120, help="operator mutants drawn at random (0: none)")
    parser.add_argument("--per-area", type=int, default=None,
                        help="instead of --sample: this many operator mutants drawn from each area")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=2, help="mutants tested at once (one repository copy each)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per mutant before it counts as killed")
    parser.add_argument("--files", nargs="*", default=TARGETS, help="files to mutate (default: every area's)")
    parser.add_argument("--tests", nargs="*", default=None,
                        help="run these tests on every mutant instead of its area's (a quicker, narrower sample)")
    parser.add_argument("--json", type=Path, help="write every mutant's result here")
    parser.add_argument("--focused", action="store_true",
                        help="run each mutant against its area's own tests (FOCUS) instead of the full list: a quick "
                             "sample; confirm its survivors with the full list")
    parser.add_argument("--areas", nargs="*", default=None,
                        help="draw mutants from these areas' files only (names as printed, e.g. 'fast paths')")
    parser.add_argument("--since", metavar="REV", default=None,
                        help="draw mutants only on the lines changed since this git revision (a change's own lines)")
    args = parser.parse_args()

    if args.areas is not None:
        unknown = sorted(set(args.areas) - set(AREAS))
        if unknown:
            raise SystemExit(f"--areas: no such area {', '.join(unknown)}; the areas: {', '.join(AREAS)}")
        args.files = [f for f in args.files if area_of(f) in args.areas]
    missing = [file for file in args.files if not (ROOT / file).is_file()]
    if missing:
        raise SystemExit(f"--files: no such file {', '.join(missing)} (paths from the repository root)")
    drawn = [m for file in args.files for m in mutants_of(file)]
    if args.since is not None:
        changed = changed_lines(args.since, args.files)
        drawn = [m for m in drawn if m.line in changed.get(m.file, set())]
    random.Random(args.seed).shuffle(drawn)
    if args.per_area is not None:
        drawn = [m for area in AREAS for m in [d for d in drawn if d.area == area][:args.per_area]]
    else:
        drawn = drawn[:args.sample]
    curated = [m for m in curated_mutants() if m.file in args.files]
    mutants = curated + drawn
    print(f"running {len(mutants)} mutants ({len(curated)} curated, {len(drawn)} drawn from the operators) "
          f"in {len(args.files)} files", flush=True)
    run(mutants, args.jobs, args.timeout, args.tests, args.focused)
    print()
    for area in [*AREAS, "other"]:
        print_rate(area, [m for m in mutants if m.area == area])
    print_rate("all", mutants)
    survived = [m for m in mutants if m.status == "survived"]
    for mutant in survived:
        print(f"  survived: [{mutant.area}] {mutant.file}:{mutant.line}  {mutant.what}")
    if args.json:
        args.json.write_text(json.dumps([{k: v for k, v in asdict(m).items() if k != "source"} | {"area": m.area}
                                         for m in mutants], indent=2))
    sys.exit(1 if any(m.status == "survived" for m in curated) else 0)


def changed_lines(revision: str, files: list[str], root: Path = ROOT) -> dict[str, set[int]]:
    """{file: the line numbers (today's) that ``git diff revision`` adds or changes in it}."""
    result = subprocess.run(["git", "diff", "-U0", revision, "--", *files], cwd=root, capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"--since: git diff {revision} failed: {result.stderr.strip().splitlines()[-1]}")
    changed: dict[str, set[int]] = {}
    current = None
    for line in result.stdout.splitlines():
        if line.startswith("+++ "):
            current = line[6:] if line.startswith("+++ b/") else None
        elif line.startswith("@@") and current is not None:
            added = line.split("+", 1)[1].split(" ", 1)[0]  # "start,count" or "start"
            start, _, count = added.partition(",")
            changed.setdefault(current, set()).update(range(int(start), int(start) + int(count or 1)))
    return changed


def print_rate(label: str, mutants: list[Mutant]) -> None:
    if not mutants:
        return
    killed = sum(m.status in ("killed", "timeout") for m in mutants)
    counted = sum(m.status in ("killed", "timeout", "survived") for m in mutants)
    curated = [m for m in mutants if m.what.startswith("[curated]")]
    print(f"kill rate {label:10s} {killed}/{counted} = {killed / max(1, counted):.1%}  "
          f"(curated {sum(m.status != 'survived' for m in curated)}/{len(curated)})")


if __name__ == "__main__":
    main()
