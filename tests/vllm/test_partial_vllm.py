"""``--async --partial-rollouts`` on the ``vllm`` engine (the fake vLLM of tests/vllm/fakes.py), through
``rlhf train``: every live policy version is a policy copy with a vLLM engine of its own, which takes
the version's weights through its weight sync (verified), and each part of a turn is sampled by the
engine of that part's version, re-reading the trajectory so far.

The fake vLLM samples as a function of the weights it holds: each token it emits says which
published version's weights those are (``30 + 8 * version + ...``) and depends on the request's
seed. So a token stamped with version v in tokens.jsonl was sampled by an engine holding exactly
version v's weights; the stamps follow the logical clock (`VersionSchedule`); K = 0 is the plain
run; the same command twice is the same run, bit for bit, whatever the tools' timing."""

from __future__ import annotations

import pytest
import torch

from rlhf.core.plugin_host.loading import build_plugin_manager
from rlhf.runtime.rl.local import train
from rlhf.runtime.rl.offpolicy.schedule import VersionSchedule
from rlhf.runtime.rl.token_log import expand
from tests.helpers import final_weights, read_jsonl, small_config
from tests.vllm import fakes

pytestmark = pytest.mark.run

STEPS, K, CHUNK = 4, 2, 2

# Two turns; tool calls of random duration (numbers of their own, never the run's), a reward that
# varies with the text (so every step moves the weights and each version is told apart).
TOOLS = '''
import random, time
from rlhf.core.types import StepResult


class Tools:
    def reset(self, prompt, label):
        self.turns = 0

    def step(self, action):
        self.turns += 1
        time.sleep(random.Random().uniform(0.0, 0.03))
        return StepResult(observation=" ok", reward=float(sum(map(ord, action)) % 5), done=self.turns >= 2)
'''


class Versions:
    """The weights of every version the run published (``AsyncGeneration.publish`` recorded here)."""

    def __init__(self):
        self.states: dict[int, dict[str, torch.Tensor]] = {}

    def of(self, held: dict[str, torch.Tensor]) -> int:
        """The one published version whose weights a vLLM engine holds (its last sync's tensors)."""
        found = [v for v, state in list(self.states.items())  # the trainer's thread adds versions meanwhile
                 if held and all(torch.equal(state[name], tensor) for name, tensor in held.items())]
        assert len(found) == 1, f"the engine's weights are those of versions {found}"
        return found[0]


def weights_script(versions: Versions):
    """A completion of the whole budget (the turn goes on at the next version): token i is
    ``30 + 8 * version + (seed + i) % 8``, ``version`` being the one whose weights this engine holds."""

    def script(llm, prompt, sampling):
        version = versions.of(llm.worker.model.loaded)
        seed = sampling["seed"]
        assert seed is not None  # every request of a partial rollout has a seed of its own
        ids = [30 + 8 * version + (seed + i) % 8 for i in range(sampling["max_tokens"])]
        assert not set(ids) & set(sampling["stop_token_ids"])
        logprobs = [{t: fakes.Logprob(-0.5)} for t in ids] if sampling["logprobs"] is not None else None
        return fakes.Completion(token_ids=ids, finish_reason="length", logprobs=logprobs)

    return script


@pytest.fixture
def versions(fake_vllm, monkeypatch):
    from rlhf.runtime.rl.async_generation import AsyncGeneration

    recorded = Versions()
    publish = AsyncGeneration.publish

    def recording(self, version):
        # recorded before it is published: once published, the producer thread may sync an engine to
        # it and sample (the weights are the trainer's until its next step, which this thread runs)
        recorded.states[version] = {name: t.clone() for name, t in self.parts.snapshot().items()}
        publish(self, version)

    monkeypatch.setattr(AsyncGeneration, "publish", recording)
    monkeypatch.setattr(fakes.FakeLLM, "script", weights_script(recorded))  # called as a method: gets the LLM
    return recorded


def run(model, task, tmp_path, name, versions, **overrides):
    (tmp_path / f"{name}.py").write_text(TOOLS)
    versions.states.clear()
    fakes.FakeLLM.instances = []
    options = dict(engine="vllm", async_rollout=True, max_staleness=K, partial_rollouts=True,
                   partial_chunk_tokens=CHUNK, max_new_tokens=3, max_turns=2, reward=[],
                   env=f"{tmp_path / name}.py:Tools", steps=STEPS, lr=1e-2, log_tokens=4)
    out = tmp_path / name
    train(small_config(model, task, out, **{**options, **overrides}), plugins=build_plugin_manager())
    return out


def test_each_part_of_a_turn_is_sampled_by_the_engine_holding_its_version(tiny_model_dir, task, tmp_path,
                                                                          versions):
    out = run(tiny_model_dir, task, tmp_path, "a", versions)
    # the trainer's engine (eval) and one per live version: K + 1, made when the run starts
    assert len(fakes.FakeLLM.instances) == 1 + K + 1
    schedule = VersionSchedule(max_staleness=K, chunk_tokens=CHUNK, save_every=0, total_steps=STEPS)
    records = read_jsonl(out / "tokens.jsonl")
    assert len(records) == STEPS * 4
    switched = 0
    for record in records:
        stamped = expand(record["versions"])
        policy = [(token, version) for token, version, m in zip(record["ids"], stamped, record["mask"]) if m]
        assert policy and all(v == -1 for v, m in zip(stamped, record["mask"]) if not m)
        # the stamps are the clock's: policy token n of batch s has version(s, n)
        assert [v for _, v in policy] == [schedule.version(record["step"] - 1, n) for n in range(len(policy))]
        # and the engine that sampled each token held exactly that version's weights
        assert [(token - 30) // 8 for token, _ in policy] == [v for _, v in policy], record
        switched += len({v for _, v in policy}) > 1
    assert switched, "no trajectory moved to newer weights mid-generation"
    metrics = read_jsonl(out / "metrics.jsonl")
    assert [m["staleness/max"] for m in metrics] == [0, 1, 2, 2]
    # a trajectory waits for a version inside its batch's rollout: never longer than that rollout
    assert all(0.0 <= m["time/version_wait"] <= m["time/rollout"] for m in metrics)
    # every engine's weight syncs were verified (the default) and passed
    assert all(llm.worker.model.syncs for llm in fakes.FakeLLM.instances[1:])

    again = run(tiny_model_dir, task, tmp_path, "b", versions)
    assert read_jsonl(again / "samples.jsonl") == read_jsonl(out / "samples.jsonl")
    assert read_jsonl(again / "tokens.jsonl") == records
    first, second = final_weights(out), final_weights(again)
    assert all(torch.equal(first[k], second[k]) for k in first)


def test_at_staleness_zero_partial_rollouts_on_vllm_are_the_plain_async_run(tiny_model_dir, task, tmp_path,
                                                                           versions):
    partial = run(tiny_model_dir, task, tmp_path, "a", versions, max_staleness=0, steps=3)
    plain = run(tiny_model_dir, task, tmp_path, "b", versions, max_staleness=0, steps=3, partial_rollouts=False)
    rows = [[(r["step"], r["completion"], r["reward"]) for r in read_jsonl(out / "samples.jsonl")]
            for out in (partial, plain)]
    assert rows[0] == rows[1] and len(rows[0]) == 3 * 4
    first, second = final_weights(partial), final_weights(plain)
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert all(m["staleness/max"] == 0 for m in read_jsonl(partial / "metrics.jsonl"))
