"""Fixtures and helpers shared by the tests (loaded through ``pytest_plugins``): test files import
what they share from here, never from each other."""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import re
import subprocess
import sys
import textwrap
import threading
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from rlhf.cli.main import make_cli
from rlhf.core.plugin_host.loading import PluginSet, build_plugin_manager


@pytest.fixture
def plugins() -> PluginSet:
    """A fresh plugin set with the built-ins and no installed entry points."""
    return build_plugin_manager(load_entrypoints=False)


def run_cli(plugins: PluginSet, args: list[str], input: str | None = None) -> Result:
    return CliRunner().invoke(make_cli(plugins), args, input=input, catch_exceptions=False)


class FakeSite:
    """A folder on sys.path holding hand-written ``.dist-info`` folders and plugin modules,
    so entry-point discovery is tested without installing anything."""

    def __init__(self, root: Path):
        self.root = root
        self.modules: list[str] = []

    def add(self, dist: str, version: str, entry_points: dict[str, str], modules: dict[str, str]) -> None:
        info = self.root / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        lines = "\n".join(f"{name} = {target}" for name, target in entry_points.items())
        (info / "entry_points.txt").write_text(f"[rlhf]\n{lines}\n")
        for module, source in modules.items():
            (self.root / f"{module}.py").write_text(textwrap.dedent(source))
            self.modules.append(module)
        importlib.invalidate_caches()


@pytest.fixture
def fake_site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeSite]:
    site = FakeSite(tmp_path / "site")
    site.root.mkdir()
    monkeypatch.syspath_prepend(str(site.root))
    yield site
    for module in site.modules:
        sys.modules.pop(module, None)


@pytest.fixture
def make_plugin() -> Callable[..., types.ModuleType]:
    """Build a plugin module from hook functions: ``make_plugin("name", register_rewards=fn)``."""
    import rlhf

    def factory(name: str = "test_plugin", **hooks: Callable[..., Any]) -> types.ModuleType:
        module = types.ModuleType(name)
        for hook, fn in hooks.items():
            setattr(module, hook, fn if hasattr(fn, "rlhf_impl") else rlhf.hookimpl(fn))  # keep trylast=True etc.
        return module

    return factory


ROOT = Path(__file__).resolve().parents[1]


# A toy task for short training runs: 12 addition prompts with labels, and a reward that grows
# with the completion's length (so every run has signal, whatever the random model writes).
ADDITION_PROMPTS = [{"prompt": f"What is {a} + {b}?", "answer": str(a + b)} for a in range(4) for b in range(3)]
LENGTH_REWARD = "def reward_func(completions, **kwargs):\n    return [len(c) / 10 for c in completions]\n"


def write_task(root: Path) -> Path:
    """``root/data.jsonl`` (ADDITION_PROMPTS) and ``root/rewards.py`` (LENGTH_REWARD as ``reward_func``)."""
    (root / "data.jsonl").write_text("".join(json.dumps(row) + "\n" for row in ADDITION_PROMPTS))
    (root / "rewards.py").write_text(LENGTH_REWARD)
    return root


@pytest.fixture(scope="session")
def task(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The toy task's files, written once per session (tests must not write into it)."""
    return write_task(tmp_path_factory.mktemp("task"))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight Llama (hidden 64, 2 layers, vocab 320) and its tokenizer, built once per session."""
    from rlhf.core.plugin_host.references import import_object

    build = import_object(f"{ROOT / 'examples' / 'tiny_model.py'}:build_random_model")
    return build(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture
def bare_plugins() -> PluginSet:
    """A fresh plugin set with no built-ins and no entry points: for tests of the registry mechanics
    that register their own components (k1, grpo, ...) without clashing with rlhf's."""
    return build_plugin_manager(load_entrypoints=False, builtins=())


# --- files and runs ---------------------------------------------------------------------------


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def small_config(model_dir, task, out, **overrides):
    """A two-step ``rlhf train`` config on the toy task (2 prompts x 2 samples, 4 new tokens)."""
    from rlhf.runtime.config.train_config import TrainConfig

    values = dict(model=str(model_dir), data=[str(task / "data.jsonl")], label_key="answer",
                  reward=[str(task / "rewards.py")], prompts_per_step=2, n_samples=2, max_new_tokens=4,
                  micro_batch_size=2, steps=2, lr=1e-3, out=str(out), progress=False, seed=7)
    values.update(overrides)
    return TrainConfig.from_dict(values)


def final_weights(out: Path) -> dict[str, Any]:
    """The state dict of a run's ``final/`` causal LM."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(out / "final").state_dict()


def torchrun(nproc: int, *args: str, cwd: Path | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node nproc args``; one process runs without the launcher: a launcher of one
    sets WORLD_SIZE=1, on which rlhf takes the path of a process on its own (core/distributed.py), so the
    launcher's process would be the only difference."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RLHF_LOAD_PLUGINS": ""}
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)] if nproc > 1 else []
    command = [sys.executable, *launcher, *args]
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout)
    assert result.returncode == 0, result.stderr[-4000:]
    return result


def pip_install(source: Path, target: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--target", str(target), str(source)],
        check=True, capture_output=True, text=True,
    )


def readme_plugin_files() -> dict[str, str]:
    """The files of the README's "Write a plugin" example, keyed by their path comment."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Write a plugin", 1)[1].split("\n## ", 1)[0]
    files = {}
    for block in re.findall(r"```(?:toml|python)\n(.*?)```", section, re.S):
        first, _, body = block.partition("\n")
        match = re.match(r"#\s*(\S+)$", first)
        if match:
            files[match.group(1)] = body
    return files


# --- gradients and batches ----------------------------------------------------------------------


def apply_calls(monkeypatch, function) -> list:
    """A list that grows by one at every ``function.apply`` (an autograd Function), which still runs."""
    calls: list = []
    real = function.apply
    monkeypatch.setattr(function, "apply", lambda *a: calls.append(1) or real(*a))
    return calls


def assert_same_gradients(got, expected, atol=1e-6):
    """``{name: gradient}`` dicts equal, to ``atol`` times the largest expected entry (and 1e-4 relative)."""
    import torch

    assert got.keys() == expected.keys()
    scale = max(float(g.abs().max()) for g in expected.values())
    assert scale > 1e-4, "the expected gradient is zero: the test checks nothing"
    for name, grad in expected.items():
        assert torch.allclose(got[name], grad, atol=atol * max(scale, 1.0), rtol=1e-4), name


ROWS, MAX_NEW = 8, 8  # make_batch's rows, and the budget the step counts are normalised with


def assert_engine_logprobs_are_the_trainers(model, tokenizer, prompts: list[list[int]], generations: list[Any], *,
                                           temperature: float = 1.0) -> None:
    """Each generation's log-probs (the engine's, row r continuing ``prompts[r]``) equal the trainer's
    `token_logprobs` of the same tokens at the same temperature."""
    import torch

    from rlhf.core.batch import collate
    from rlhf.core.logprobs import token_logprobs
    from rlhf.core.types import Trajectory

    trajectories = [Trajectory(token_ids=prompt + g.token_ids, loss_mask=[0] * len(prompt) + [1] * len(g.token_ids),
                               prompt_length=len(prompt), prompt="", prompt_text="", completion_text="", group=row)
                    for row, (prompt, g) in enumerate(zip(prompts, generations))]
    rows = len(trajectories)
    batch = collate(trajectories, pad_token_id=tokenizer.pad_token_id, rewards=torch.zeros(rows),
                    sample_mask=torch.ones(rows))
    with torch.no_grad():
        trainer, _ = token_logprobs(model, batch.input_ids, batch.attention_mask, batch.action_mask,
                                    temperature=temperature)
    for row, generation in enumerate(generations):
        positions = batch.action_mask[row].nonzero().squeeze(-1)
        assert torch.allclose(trainer[row, positions], torch.tensor(generation.logprobs), atol=1e-4), row


def make_batch(seed: int = 1):
    """8 rows (4 prompts x 2 samples) of random tokens with different prompt and completion lengths."""
    import torch

    from rlhf.core.batch import collate
    from rlhf.core.types import Trajectory

    generator = torch.Generator().manual_seed(seed)
    trajectories = []
    for row in range(ROWS):
        prompt = torch.randint(5, 300, (3 + row % 3,), generator=generator).tolist()
        completion = torch.randint(5, 300, (2 + row % 5,), generator=generator).tolist()
        trajectories.append(Trajectory(token_ids=prompt + completion,
                                       loss_mask=[0] * len(prompt) + [1] * len(completion),
                                       prompt_length=len(prompt), prompt="", prompt_text="", completion_text="",
                                       group=row // 2))
    batch = collate(trajectories, pad_token_id=0, rewards=torch.zeros(ROWS), sample_mask=torch.ones(ROWS))
    batch.advantages = torch.zeros_like(batch.action_mask)  # (B, A)
    batch.returns = torch.zeros_like(batch.action_mask)  # (B, A)
    return batch


def grouped_batch(prompts: int = 4, samples: int = 3, seed: int = 5):
    """``prompts`` x ``samples`` rows, a prompt's samples sharing its 10-16 tokens, completions of
    2-8 tokens; random advantages on the completions."""
    import torch

    from rlhf.core.batch import collate
    from rlhf.core.types import Trajectory

    generator = torch.Generator().manual_seed(seed)
    trajectories = []
    for group in range(prompts):
        prompt = torch.randint(5, 300, (10 + 2 * group,), generator=generator).tolist()
        for sample in range(samples):
            completion = torch.randint(5, 300, (2 + (group + 2 * sample) % 7,), generator=generator).tolist()
            trajectories.append(Trajectory(token_ids=prompt + completion,
                                           loss_mask=[0] * len(prompt) + [1] * len(completion),
                                           prompt_length=len(prompt), prompt="", prompt_text="", completion_text="",
                                           group=group))
    batch = collate(trajectories, pad_token_id=0, rewards=torch.zeros(len(trajectories)),
                    sample_mask=torch.ones(len(trajectories)))
    batch.advantages = torch.randn(batch.action_mask.shape, generator=generator) * batch.action_mask  # (B, A)
    batch.returns = torch.zeros_like(batch.action_mask)  # (B, A)
    return batch


def shared_batch():
    """8 rows in 4 groups, padded on both sides; actions on every real token after the third."""
    import torch

    prompt, other = [11, 12, 13, 14], [21, 22]
    rows = [prompt + [30, 31, 32], prompt + [40, 41],          # a DPO pair
            prompt + [50, 51, 52, 53], prompt + [50, 51, 60],  # responses that begin alike
            other + [70], other + [70, 71, 72],                # a row that is a prefix of the other, with
            [80, 81, 82, 83],                                  # a group of one
            prompt + [50, 51, 52, 90]]                         # the third of rows 2 and 3's group
    width = 10
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for r, row in enumerate(rows):
        start = 1 if r % 2 else 0  # odd rows left-padded by one
        ids[r, start:start + len(row)] = torch.tensor(row)
        mask[r, start:start + len(row)] = 1
    actions = torch.zeros((len(rows), width - 1))
    for r in range(len(rows)):
        real = mask[r].nonzero().flatten()
        actions[r, int(real[2]):int(real[-1])] = 1  # predicts tokens 3.. of the row
    groups = [[0, 1], [2, 3, 7], [4, 5], [6]]
    return ids, mask, actions, groups


# --- the fit loop's data ------------------------------------------------------------------------


@pytest.fixture(scope="session")
def fit_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Eight rows of each objective's data: words of various lengths, so micro-batches pad (written once per
    session: tests must not write into it)."""
    root = tmp_path_factory.mktemp("fit-data")
    words = ["cat", "hello world", "the quick brown fox", "12 + 7 = 19", "dog", "say hello", "jumps over", "lazy"]
    n = len(words)
    write_jsonl(root / "sft.jsonl", [{"prompt": f"Q: {w}?", "response": f"{w} {w}"} for w in words])
    write_jsonl(root / "pairs.jsonl", [{"prompt": f"Q: {w}?", "chosen": w, "rejected": words[(i + 3) % n]}
                                       for i, w in enumerate(words)])
    write_jsonl(root / "kto.jsonl", [{"prompt": f"Q: {w}?", "completion": w if i % 3 else words[(i + 1) % n],
                                      "label": bool(i % 3)} for i, w in enumerate(words)])
    write_jsonl(root / "steps.jsonl", [{"input": f"{w} @ {words[(i + 1) % n]} @", "label": ["+", "-"] if i % 2
                                        else ["-", "+"]} for i, w in enumerate(words)])
    return root


@pytest.fixture(scope="session")
def fit_teacher(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Another random model with the same tokenizer, built once per session (tests must not write into it)."""
    from rlhf.core.plugin_host.references import import_object

    build = import_object(f"{ROOT / 'examples' / 'tiny_model.py'}:build_random_model")
    return build(tmp_path_factory.mktemp("teacher"), seed=7)


@pytest.fixture(scope="session")
def sft_teacher(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The pipeline's SFT model (examples/pipeline/run.sh's first step, shortened): examples/tiny-model
    after 13 SFT steps on bare answers ("68", no restatement), so it ends after the number where the
    base model rambles on. Built once per session (tests must not write into it)."""
    out = tmp_path_factory.mktemp("sft-teacher") / "sft"
    pipeline = ROOT / "examples" / "pipeline"
    command = [sys.executable, "-m", "rlhf", "sft", "--model", str(ROOT / "examples" / "tiny-model"),
               "--data", str(pipeline / "sft.jsonl"), "--max-samples", "200", "--batch-size", "32",
               "--micro-batch-size", "16", "--epochs", "2", "--lr", "1e-4", "--seed", "0", "--no-progress",
               "--out", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "RLHF_LOAD_PLUGINS": ""})
    assert result.returncode == 0, result.stderr[-3000:]
    return out / "final"


def command_args(command: str, model: Path, data: Path, teacher: Path) -> list[str]:
    """The arguments of each offline command on ``fit_data``'s files."""
    return {
        "sft": ["sft", "--data", str(data / "sft.jsonl")],
        "rm": ["rm", "--data", str(data / "pairs.jsonl"), "--normalize-reward"],
        "dpo": ["dpo", "--data", str(data / "pairs.jsonl"), "--beta", "0.5", "--nll-coef", "0.2"],
        "kto": ["kto", "--data", str(data / "kto.jsonl"), "--output-key", "completion"],
        "prm": ["prm", "--data", str(data / "steps.jsonl"), "--placeholder-token", "@", "--reward-tokens", "+", "-"],
        "distill": ["distill", "--data", str(data / "sft.jsonl"), "--teacher", str(teacher)],
        "fit": ["fit", "--objective", "dpo", "--data", str(data / "pairs.jsonl"), "--objective.ipo",
                "--objective.beta", "0.5"],
    }[command] + ["--model", str(model)]


def objective_scores(model_dir: Path, data: Path) -> list[tuple[float, float]]:
    """``(chosen, rejected)`` raw scores of every row of ``data``, as the ``rm`` objective computes them
    in training: its ``encode`` and ``collate``, the model loaded as ``rlhf rm`` loads a reward model,
    then its ``scores``."""
    import torch

    from rlhf.core.protocols.objective import FitModels
    from rlhf.runtime.config.fit_config import FitConfig
    from rlhf.runtime.fit.local import build_parts
    from rlhf.runtime.config.fit_plan import FitPlan

    config = FitConfig.from_dict({"model": str(model_dir), "data": [str(data)], "objective": "rm", "batch_size": 1,
                                  "out": str(model_dir.parent / "scored-by-objective")})
    parts, _ = build_parts(FitPlan.make(config, build_plugin_manager(load_entrypoints=False)))
    batch = parts.objective.collate(parts.train_examples, parts.pad_token_id)  # rows: chosen (P, T), then rejected
    parts.trained.model.eval()
    with torch.no_grad():
        chosen, rejected = parts.objective.scores(FitModels(model=parts.trained.model), batch)  # (P,), (P,)
    return list(zip(chosen.tolist(), rejected.tolist()))


def tiny_moe(kind: str, *, seed: int = 0, vocab: int = 320, hidden: int = 32, experts: int = 4) -> Any:
    """A random-weight mixture-of-experts causal LM, ``kind`` "mixtral" or "qwen2_moe": 2 layers,
    ``experts`` experts, top-2 routing (about 100K parameters at the defaults; vocab 320 is the
    tiny tokenizer's, `tiny_model_dir`)."""
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, num_experts_per_tok=2, max_position_embeddings=256,
                  router_aux_loss_coef=0.37, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if kind == "mixtral":
        return MixtralForCausalLM(MixtralConfig(intermediate_size=48, num_local_experts=experts, **common))
    return Qwen2MoeForCausalLM(Qwen2MoeConfig(intermediate_size=48, moe_intermediate_size=24,
                                              shared_expert_intermediate_size=32, num_experts=experts, **common))


@pytest.fixture(scope="session")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`tiny_moe`'s Mixtral saved as a model directory, once per session (its tokenizer: pass tiny_model_dir's;
    tests must not write into it)."""
    out = tmp_path_factory.mktemp("tiny-mixtral")
    tiny_moe("mixtral").save_pretrained(out)
    return out


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """This process with one torch thread, like an actor with one CPU (the same float sums)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def backend_micro_loss(backend, seed: int):
    """A next-token loss of the backend's train module on 2 random rows of 12 tokens (seeded)."""
    import torch

    ids = torch.randint(5, 300, (2, 12), generator=torch.Generator().manual_seed(seed))  # (2, T)
    logits = backend.train_module(input_ids=ids).logits[:, :-1].float()  # (2, T-1, V)
    return -torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).sum() / 100


def backend_full_weights(model, backend) -> dict[str, Any]:
    """Every parameter, whole (ZeRO-3 gathers them), as float32 copies."""
    with backend.full_weights():
        return {name: p.detach().float().clone() for name, p in model.named_parameters()}


# --- rollouts with environments ------------------------------------------------------------------

class EnvsOf:
    """An environment factory for one class, under one name (what `EnvFactory` offers a rollout)."""

    def __init__(self, env_cls, name: str = "tools", *, multi_turn: bool = True, gives_rewards: bool = True):
        self.env_cls, self.name = env_cls, name
        self.flags = {"multi_turn": multi_turn, "gives_rewards": gives_rewards}

    def __call__(self, name):
        from rlhf.core.protocols.environment import AsyncEnv

        return AsyncEnv(self.env_cls(), name=self.name)

    def capabilities(self, name):
        return dict(self.flags)


def prompt_item(tokenizer, text: str, label: Any, origin: str | None = None):
    """One prompt as the loader gives it; ``origin`` defaults to ``row <label>``."""
    from rlhf.runtime.run.data import PromptItem

    return PromptItem(prompt=text, prompt_text=text, prompt_ids=tokenizer(text)["input_ids"], label=label,
                      columns={}, origin=origin or f"row {label}")


class GatedTools:
    """The "slow" trajectory's first tool call returns only once the "fast" one has made its second,
    which needs the fast one's second turn generated while the slow call is out: with turns batched
    over the batch it would wait for the slow call (``opened`` records False after 30 s). Call
    `GatedTools.clear` first."""

    gate = threading.Event()
    opened: list[bool] = []

    @classmethod
    def clear(cls) -> None:
        cls.gate.clear()
        cls.opened.clear()

    def reset(self, prompt, label):
        self.label, self.turns = label, 0
        return None

    def step(self, action):
        from rlhf.core.types import StepResult

        self.turns += 1
        if self.label == "fast" and self.turns == 2:
            GatedTools.gate.set()
        if self.label == "slow" and self.turns == 1:
            GatedTools.opened.append(GatedTools.gate.wait(timeout=30))
        return StepResult(observation=" ok.", reward=float(self.turns), done=self.turns >= 3)


class RewardingEnv:
    """An environment whose one step rewards 1 and ends the episode (``gives_rewards`` by default)."""

    def reset(self, prompt, label):
        return None

    def step(self, action_text):
        from rlhf.core.types import StepResult

        return StepResult(reward=1.0, done=True)


def padded_batch():
    """4 rows: left-padded, right-padded, both, none; actions from the third real token on."""
    import torch

    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 250, (4, 10), generator=generator)
    mask = torch.ones(4, 10, dtype=torch.long)
    mask[0, :3] = 0
    mask[1, 7:] = 0
    mask[2, :1] = 0
    mask[2, 8:] = 0
    actions = torch.zeros(4, 9)
    for row in range(4):
        real = mask[row].nonzero().flatten()
        actions[row, int(real[2]):int(real[-1])] = 1
    return ids * mask, mask, actions


def post_raw(url: str, data: bytes, timeout: float = 10) -> tuple[int, dict[str, Any]]:
    """POST ``data`` as is to a reward server's /get_reward: (status, JSON body)."""
    import urllib.error
    import urllib.request

    request = urllib.request.Request(url + "/get_reward", data=data, method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


# A multi-turn environment that raises (env_error) on about one model turn in three, as a function
# of the turn's text only: a retry, sampled from its own seed, fails or not by what it samples.
FLAKY_TOOL = '''
from rlhf.core.types import StepResult

class FlakyTool:
    def reset(self, prompt, label):
        pass

    def step(self, action_text):
        if sum(map(ord, action_text)) % 3 == 0:
            raise ValueError("the tool crashed")
        return StepResult(reward=len(action_text) / 10, done=True)
'''
