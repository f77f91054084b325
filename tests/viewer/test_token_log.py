"""tokens.jsonl (rlhf/runtime/rl/token_log.py): what a training run records per token of its first
``--log-tokens N`` samples a step, that it lines up with samples.jsonl and the step's math, that
``--resume`` cuts it back like the other logs (no step twice), and that ``rlhf view`` serves it.
A plain GRPO run (no old log-probs, no engine log-probs for its loss) records both log-prob
columns all the same, and training is bit for bit what it is without tokens.jsonl."""

from __future__ import annotations

import json
import math
import statistics
import types

import pytest

from rlhf.core.plugin_host.loading import build_plugin_manager
from rlhf.runtime.rl.local import train
from rlhf.runtime.rl.token_log import expand, runs
from rlhf.viewer.runs import open_runs
from tests.helpers import read_jsonl, small_config

pytestmark = pytest.mark.run


def test_runs_and_expand_are_inverse():
    values = ["template", "template", "model", "tool", "tool", "model"]
    assert runs(values) == [["template", 2], ["model", 1], ["tool", 2], ["model", 1]]
    assert expand(runs(values)) == values and runs([]) == [] and expand([]) == []


@pytest.fixture(scope="module")
def run(tiny_model_dir, task, tmp_path_factory):
    """3 steps of 2 prompts x 2 samples, with KL to a reference and two passes (so every column is computed)."""
    out = tmp_path_factory.mktemp("tokens") / "run"
    train(small_config(tiny_model_dir, task, out, steps=3, save_every=1, log_tokens=3, kl_coef=0.1, ppo_epochs=2),
          plugins=build_plugin_manager())
    return out


def test_a_run_records_the_tokens_of_its_first_samples_each_step(run):
    records = read_jsonl(run / "tokens.jsonl")
    samples = read_jsonl(run / "samples.jsonl")
    assert [(r["step"], r["sample"]) for r in records] == [(s, i) for s in (1, 2, 3) for i in range(3)]
    manifest = json.loads((run / ".rlhf-run.json").read_text())
    assert "tokens.jsonl" in manifest["owned"] and "tokens.jsonl" in manifest["logs"]  # cut back on --resume
    for record in records:
        sample = [s for s in samples if s["step"] == record["step"]][record["sample"]]
        n = len(record["ids"])
        assert record["group"] == sample["group"] and sum(record["mask"]) == sample["completion_tokens"]
        for column in ("pieces", "mask", "logprobs", "advantages", "kl"):
            assert len(record[column]) == n, column
        assert expand(record["origins"]) == ["model" if m else "env" for m in record["mask"]]
        assert all(v is not None and v <= 0 for v, m in zip(record["logprobs"], record["mask"]) if m)
        assert "".join(record["pieces"]).startswith(sample["completion"][:3])
        assert len(record["rollout_logprobs"]) == n  # asked of the engine for tokens.jsonl


def test_the_advantages_are_the_step_s_grpo_advantages(run):
    """GRPO's default (the preset's): (r - mean of the group) / (std of the group + eps), on every policy token."""
    records = read_jsonl(run / "tokens.jsonl")
    samples = read_jsonl(run / "samples.jsonl")
    for record in records:
        step_rows = [s for s in samples if s["step"] == record["step"]]
        group = [s["reward"] for s in step_rows if s["group"] == record["group"]]
        reward = step_rows[record["sample"]]["reward"]
        std = statistics.stdev(group) if len(group) > 1 else 0.0
        expected = (reward - statistics.mean(group)) / (std + 1e-6)
        values = {round(a, 3) for a, m in zip(record["advantages"], record["mask"]) if m}
        assert values == {round(expected, 3)} or values == {0.0} and std == 0.0, (values, expected)


def test_resume_cuts_tokens_back_to_the_checkpoint_so_no_step_appears_twice(run, tiny_model_dir, task, tmp_path):
    import shutil

    out = tmp_path / "run"
    shutil.copytree(run, out)
    shutil.rmtree(out / "checkpoints" / "step_3")  # killed after step 3's rows were written, before its checkpoint
    shutil.rmtree(out / "final")
    train(small_config(tiny_model_dir, task, out, steps=4, save_every=1, log_tokens=3, kl_coef=0.1, ppo_epochs=2,
                       resume=True, resume_override=["steps"]), plugins=build_plugin_manager())
    steps = [(r["step"], r["sample"]) for r in read_jsonl(out / "tokens.jsonl")]
    assert steps == [(s, i) for s in (1, 2, 3, 4) for i in range(3)]


def test_the_viewer_serves_a_real_run_s_tokens(run):
    [opened] = open_runs([run])
    assert opened.steps() == [1, 2, 3]
    step = opened.step(2)
    assert len(step["samples"]) == 4 and sorted(step["tokens"]) == ["0", "1", "2"]
    assert step["tokens"]["1"]["ids"] == read_jsonl(run / "tokens.jsonl")[4]["ids"]


# --- a plain GRPO run: the columns tokens.jsonl computes or asks for itself -----------------------


class _Policy:
    """A policy role whose log-prob at action position t of row b is -(100 b + t) / 1000; it keeps the batches it got."""

    def __init__(self):
        self.batches = []

    def logprobs(self, batch):
        import torch

        self.batches.append(batch)
        rows, width = batch.action_mask.shape
        return -(100 * torch.arange(rows)[:, None] + torch.arange(width)[None, :]).float() / 1000  # (b, A)


def _trajectory(prompt, completion, mask, rollout):
    from rlhf.core.types import Trajectory

    return Trajectory(token_ids=prompt + completion, loss_mask=[0] * len(prompt) + mask, prompt_length=len(prompt),
                      prompt="p", prompt_text="p", completion_text="c", group=0,
                      rollout_logprobs=[0.0] * len(prompt) + rollout)


def test_without_old_log_probs_the_policy_s_are_computed_for_the_logged_rows_only_and_line_up():
    """Token j of a row (predicted at action position j - 1) gets the policy's value there; the
    policy sees the first ``limit`` rows only; the rollout column is each trajectory's own, per
    completion token; without a policy (Ray, torchrun) the column is left out."""
    from dataclasses import replace

    import torch

    from rlhf.core.batch import collate
    from rlhf.runtime.rl.token_log import policy_logprobs, token_record

    trajectories = [_trajectory([5, 6, 7], [8, 9], [1, 1], [-0.5, -0.25]),
                    _trajectory([5, 6], [10, 11, 12], [1, 0, 1], [-1.0, 0.0, -2.0]),
                    _trajectory([5], [13], [1], [-3.0])]
    batch = collate(trajectories, pad_token_id=0, rewards=torch.zeros(3), sample_mask=torch.ones(3))
    batch = replace(batch, rollout_logprobs=None)  # the update's: none asked for
    policy = _Policy()
    computed = policy_logprobs(policy, batch, 2)
    [seen] = policy.batches
    assert seen.size == 2 and seen.input_ids.tolist() == [[5, 6, 7, 8, 9], [5, 6, 10, 11, 12]]
    records = [token_record(t, batch, row, step=1, sample=row, decode=lambda ids: [str(i) for i in ids],
                            policy_logprobs=computed) for row, t in enumerate(trajectories[:2])]
    assert records[0]["logprobs"] == [-0.002, -0.003]  # tokens 3 and 4 of row 0
    assert records[1]["logprobs"] == [-0.101, -0.102, -0.103]  # tokens 2, 3, 4 of row 1
    assert records[0]["rollout_logprobs"] == [-0.5, -0.25] and records[1]["rollout_logprobs"] == [-1.0, 0.0, -2.0]
    bare = token_record(trajectories[2], batch, 2, step=1, sample=2, decode=lambda ids: [str(i) for i in ids])
    assert "logprobs" not in bare and bare["rollout_logprobs"] == [-3.0]
    old = replace(batch, old_logprobs=torch.full((3, 4), -0.75))
    assert policy_logprobs(policy, old, 2) is None and len(policy.batches) == 1  # the step's own are logged
    wide = replace(batch, advantages=torch.arange(12, dtype=torch.float32).reshape(3, 4))  # (B, A)
    short = token_record(trajectories[2], wide, 2, step=1, sample=2, decode=lambda ids: [str(i) for i in ids])
    assert short["advantages"] == [8.0]  # its one token, at action position 0: none of the row's padding after it


def test_a_full_disk_while_writing_tokens_is_one_line_and_the_partial_write_is_cut_off(tmp_path):
    import errno

    import torch

    from rlhf.core.batch import collate
    from rlhf.core.errors import NoSpaceError
    from rlhf.runtime.rl.token_log import TokenLog

    trajectories = [_trajectory([5, 6], [8, 9], [1, 1], [-0.5, -0.25])]
    batch = collate(trajectories, pad_token_id=0, rewards=torch.zeros(1), sample_mask=torch.ones(1))
    tokenizer = types.SimpleNamespace(batch_decode=lambda rows, **_: [str(r[0]) for r in rows])
    run = types.SimpleNamespace(claim=lambda name, log: tmp_path / name)
    log = TokenLog(1, tokenizer)
    log.write(run, 0, trajectories, batch)
    whole = (tmp_path / "tokens.jsonl").read_bytes()

    class Full:  # the file's handle on a device that fills up halfway through the next write
        def __init__(self, handle):
            self.handle = handle

        def tell(self):
            return self.handle.tell()

        def truncate(self, size):
            return self.handle.truncate(size)

        def write(self, data):
            self.handle.write(data[: len(data) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")

    log._handle = Full(log._handle)
    with pytest.raises(NoSpaceError, match="tokens.jsonl"):
        log.write(run, 1, trajectories, batch)
    assert (tmp_path / "tokens.jsonl").read_bytes() == whole  # step 2's half line cut off again


def _plain_run(tiny_model_dir, task, out, log_tokens):
    """Three steps of plain GRPO (one pass, KL in the loss: no old log-probs are computed; no mismatch
    correction: the loss reads no engine log-probs), and the trajectories each step scored."""
    import rlhf

    seen: dict[int, list[tuple[list[int], int, list[float] | None]]] = {}
    watcher = types.ModuleType("watcher")
    watcher.on_rewards = rlhf.hookimpl(lambda step, trajectories: seen.setdefault(step, [
        (list(t.token_ids), t.prompt_length, list(t.rollout_logprobs) if t.rollout_logprobs is not None else None)
        for t in trajectories]))
    plugins = build_plugin_manager()
    plugins.register(watcher)
    train(small_config(tiny_model_dir, task, out, steps=3, log_tokens=log_tokens, max_new_tokens=6),
          plugins=plugins)
    return seen


@pytest.fixture(scope="module")
def plain(tiny_model_dir, task, tmp_path_factory):
    out = tmp_path_factory.mktemp("plain") / "run"
    return out, _plain_run(tiny_model_dir, task, out, log_tokens=4)


# A record's floats keep 4 decimals: they are within half a unit of the 4th decimal of the value.
ROUNDING = 0.5e-4


def test_a_plain_grpo_run_records_the_policy_s_and_the_rollout_s_log_probs(plain):
    out, seen = plain
    records = read_jsonl(out / "tokens.jsonl")
    assert [(r["step"], r["sample"]) for r in records] == [(s, i) for s in (1, 2, 3) for i in range(4)]
    for record in records:
        n = len(record["ids"])
        assert len(record["logprobs"]) == n and len(record["rollout_logprobs"]) == n
        assert all(v is not None and v <= 0 for v, m in zip(record["logprobs"], record["mask"]) if m)
        assert "kl" not in record  # KL in the loss: the step computed no KL before the update (nor old log-probs)


def test_the_logged_policy_log_probs_are_the_starting_model_s_at_step_1(plain, tiny_model_dir):
    """Step 1 logs the log-probs before any update: a direct forward of the starting model on the
    same tokens (one row, no padding, temperature 1) gives them."""
    import torch
    from transformers import AutoModelForCausalLM

    out, seen = plain
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    records = [r for r in read_jsonl(out / "tokens.jsonl") if r["step"] == 1]
    for record, (token_ids, start, _) in zip(records, seen[0]):
        assert token_ids[start:] == record["ids"]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([token_ids])).logits[0].float()  # (T, V)
        direct = torch.log_softmax(logits[:-1], dim=-1).gather(1, torch.tensor(token_ids[1:])[:, None])[:, 0]  # (T-1,)
        for j, (logged, m) in enumerate(zip(record["logprobs"], record["mask"])):
            if m:  # token start + j, predicted at position start + j - 1
                assert abs(logged - float(direct[start + j - 1])) <= ROUNDING + 1e-5, (record["sample"], j)


def test_the_logged_rollout_log_probs_are_the_engine_s_and_agree_with_the_policy_s_at_step_1(plain):
    """The hf engine samples with the policy's own weights: at step 1 its log-probs are the
    policy's up to the numerics of a cached decode (within 1e-4 here)."""
    out, seen = plain
    records = read_jsonl(out / "tokens.jsonl")
    for record in records:
        token_ids, start, rollout = seen[record["step"] - 1][record["sample"]]
        assert rollout is not None and len(rollout) == len(token_ids)
        assert record["rollout_logprobs"] == [round(v, 4) for v in rollout[start:]]
        assert all(v == 0.0 for v, m in zip(record["rollout_logprobs"], record["mask"]) if not m)
        if record["step"] == 1:
            for policy, engine, m in zip(record["logprobs"], record["rollout_logprobs"], record["mask"]):
                if m:
                    assert abs(policy - engine) <= 1e-4 + 2 * ROUNDING, (policy, engine)


def test_logging_tokens_leaves_training_bit_for_bit_as_it_was(plain, tiny_model_dir, task, tmp_path):
    """The extra forward (eval mode, no gradients, no random draws) and the engine's log-probs
    (which the update does not see) change nothing: the same final weights and metrics."""
    import torch

    from tests.helpers import final_weights

    out, _ = plain
    without = tmp_path / "run"
    _plain_run(tiny_model_dir, task, without, log_tokens=0)
    assert not (without / "tokens.jsonl").exists()
    logged, bare = final_weights(out), final_weights(without)
    assert logged.keys() == bare.keys()
    assert all(torch.equal(logged[k], bare[k]) for k in logged)

    def metrics(run):  # all but the clock's (time/*, and throughput/*: tokens per second of them)
        return [{k: v for k, v in m.items() if not k.startswith(("time/", "throughput/"))}
                for m in read_jsonl(run / "metrics.jsonl")]

    assert not any(isinstance(v, float) and math.isnan(v) for m in metrics(out) for v in m.values())
    assert metrics(out) == metrics(without) and len(metrics(out)) == 3


def test_the_logged_log_probs_come_from_the_update_s_forwards_where_it_can_keep_them(tiny_model_dir, task, tmp_path,
                                                                                    monkeypatch):
    """An on-policy step trained in one optimizer step keeps the logged rows' log-probs from its own
    training forwards (no forward of their own); they are the ones that forward computes."""
    from rlhf.runtime.rl.workers import PolicyWorker

    calls = []
    own = PolicyWorker.logprobs
    monkeypatch.setattr(PolicyWorker, "logprobs", lambda self, batch: calls.append(batch.size) or own(self, batch))
    _plain_run(tiny_model_dir, task, tmp_path / "kept", log_tokens=4)
    assert calls == []  # no step ran a forward for tokens.jsonl
    monkeypatch.setattr(PolicyWorker, "keep_logprobs", lambda self, batch, rows: False)
    _plain_run(tiny_model_dir, task, tmp_path / "own", log_tokens=4)
    assert calls == [4, 4, 4]  # a forward of the 4 logged rows a step
    kept, computed = read_jsonl(tmp_path / "kept" / "tokens.jsonl"), read_jsonl(tmp_path / "own" / "tokens.jsonl")
    assert len(kept) == len(computed) == 12
    for a, b in zip(kept, computed):
        assert a["ids"] == b["ids"] and a["mask"] == b["mask"]
        assert all(abs(x - y) <= 2 * ROUNDING + 1e-5 for x, y, m in zip(a["logprobs"], b["logprobs"], a["mask"]) if m)


def test_an_update_that_cannot_keep_them_leaves_the_logged_rows_a_forward_of_their_own(tiny_model_dir, task):
    """Two epochs (the second's forwards come after an optimizer step), two minibatches, a logged
    row the update skips, dropout in training mode, old log-probs of its own, no loss token at all:
    `keep_logprobs` says no."""
    import torch
    from transformers import AutoModelForCausalLM

    from rlhf.core.batch import ExperienceBatch
    from rlhf.runtime.rl.workers import PolicyWorker, drops_out
    from rlhf.runtime.step.micro_batches import UpdateSettings

    class Loss:
        kl_coef, entropy_coef = 0.0, 0.0

        def __init__(self, skipped):
            self.skipped = skipped

        def trained_rows(self, batch):
            return torch.tensor([row not in self.skipped for row in range(batch.size)])

    def worker(skipped=(), epochs=1, train_batch_size=4, model=None):
        settings = UpdateSettings(ppo_epochs=epochs, train_batch_size=train_batch_size, micro_batch_size=2,
                                  max_new_tokens=4)
        policy = PolicyWorker.__new__(PolicyWorker)
        policy.settings, policy.training_loss, policy.router_aux = settings, Loss(skipped), None
        policy.model = model or AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        from rlhf.core.distributed import SINGLE

        policy.dist, policy.keep_rows, policy.kept = SINGLE, 0, {}
        return policy

    ids = torch.ones((4, 5), dtype=torch.long)
    batch = ExperienceBatch(input_ids=ids, attention_mask=torch.ones_like(ids), action_mask=torch.ones((4, 4)),
                            rewards=torch.zeros(4), sample_mask=torch.ones(4), group_index=torch.tensor([0, 0, 1, 1]))
    keeping = worker()
    assert keeping.keep_logprobs(batch, 2) and keeping.keep_rows == 2
    assert not worker(epochs=2).keep_logprobs(batch, 2)
    assert not worker(train_batch_size=2).keep_logprobs(batch, 2)
    assert not worker(skipped=(1,)).keep_logprobs(batch, 2)
    assert worker(skipped=(3,)).keep_logprobs(batch, 2)  # a skipped row that is not logged
    dropping = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attention_dropout=0.1)
    assert drops_out(dropping) and not worker(model=dropping).keep_logprobs(batch, 2)
    with_old = ExperienceBatch(**{**batch.__dict__, "old_logprobs": torch.zeros((4, 4))})
    assert not worker().keep_logprobs(with_old, 2)
    unscored = ExperienceBatch(**{**batch.__dict__, "sample_mask": torch.zeros(4)})  # no loss token: no forward
    assert not worker().keep_logprobs(unscored, 2)
    # a refusal forgets what an earlier update kept: nothing stale is logged, nothing is kept by the next fit
    earlier = worker()
    earlier.keep_rows, earlier.kept = 3, {0: torch.zeros(4)}
    assert not earlier.keep_logprobs(with_old, 2) and earlier.keep_rows == 0 and earlier.kept == {}
    # rows that are segments of trajectories (multi-turn): the minibatch counts trajectories, not rows
    segmented = ExperienceBatch(**{**batch.__dict__, "trajectory_index": torch.tensor([0, 0, 1, 1])})
    assert worker(train_batch_size=2).keep_logprobs(segmented, 2)
    assert not worker(train_batch_size=1).keep_logprobs(segmented, 2)


def test_special_tokens_are_written_as_their_text(tiny_model_dir):
    """tokens.jsonl shows an EOS (or any special token) the model sampled, not an empty string."""
    from transformers import AutoTokenizer

    from rlhf.runtime.rl.token_log import TokenLog

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert tokenizer.eos_token
    assert TokenLog(4, tokenizer).decode([tokenizer.eos_token_id]) == [tokenizer.eos_token]
