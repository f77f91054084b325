"""The Python API (issue 53): ``from rlhf import train, sft, ...`` runs the CLI's own commands with
keyword options, returns the run's result, and reports the CLI's errors as exceptions."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import rlhf
from rlhf.core.errors import ConfigError

pytestmark = pytest.mark.run

ROOT = Path(__file__).resolve().parents[2]
MODEL = str(ROOT / "examples" / "tiny-model")
PROMPTS = str(ROOT / "examples" / "data" / "train.jsonl")
PIPELINE = ROOT / "examples" / "pipeline"
REWARD = str(ROOT / "examples" / "rewards.py") + ":exact_match"
SMALL_RL = dict(label_key="answer", reward=REWARD, n_samples=2, prompts_per_step=2, max_new_tokens=4, progress=False)


def test_train_returns_the_runs_metrics_and_model_and_takes_a_config_file_and_component_settings(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"steps": 5, "lr": 1e-5, "components": {"policy_loss": {"clip_high": 0.3}}}))
    result = rlhf.train(algo="grpo", model=MODEL, data=PROMPTS, config=config, steps=2, out=tmp_path / "run",
                        components={"policy_loss": {"clip_low": 0.1}}, **SMALL_RL)
    assert result.out == tmp_path / "run" and result.final == tmp_path / "run" / "final"
    assert (result.final / "config.json").is_file()
    assert result.step == 2  # the keyword beats the file, as a flag does
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert result.metrics["reward/mean"] == [r for r in rows if r.get("step") == 2 and "reward/mean" in r][-1][
        "reward/mean"]
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert saved["lr"] == 1e-5  # from the file
    assert (saved["components"]["policy_loss"]["clip_high"], saved["components"]["policy_loss"]["clip_low"]) == (0.3, 0.1)


def test_the_api_and_the_cli_write_the_same_config(tmp_path, plugins):
    from tests.helpers import run_cli

    rlhf.train(algo="grpo", model=MODEL, data=PROMPTS, steps=1, out=tmp_path / "api", **SMALL_RL)
    result = run_cli(plugins, ["train", "--algo", "grpo", "--model", MODEL, "--data", PROMPTS, "--label-key", "answer",
                               "--reward", REWARD, "--n-samples", "2", "--prompts-per-step", "2", "--max-new-tokens",
                               "4", "--steps", "1", "--no-progress", "--out", str(tmp_path / "cli")])
    assert result.exit_code == 0, result.output
    api, cli = (yaml.safe_load((tmp_path / name / "config.yaml").read_text()) for name in ("api", "cli"))
    api.pop("out"), cli.pop("out")
    assert api == cli


def test_sft_and_dpo_return_results_and_generate_and_evaluate_their_reports(tmp_path):
    sft = rlhf.sft(model=MODEL, data=PIPELINE / "sft.jsonl", max_samples=8, batch_size=4, micro_batch_size=4, steps=2,
                   out=tmp_path / "sft", progress=False)
    assert sft.final is not None and sft.step == 2 and sft.metrics["step"] == 2, sft
    dpo = rlhf.dpo(model=sft.final, data=PIPELINE / "pairs.jsonl", max_samples=8, batch_size=4, micro_batch_size=4,
                   steps=1, beta=0.2, out=tmp_path / "dpo", progress=False)
    assert dpo.final is not None and dpo.step == 1
    assert yaml.safe_load((tmp_path / "dpo" / "config.yaml").read_text())["components"]["objective"]["beta"] == 0.2
    gen = rlhf.generate(model=MODEL, data=PROMPTS, max_samples=2, n=2, max_new_tokens=4, reward=REWARD,
                        label_key="answer", out=tmp_path / "gen.jsonl")
    assert gen.rows == 2 and len((tmp_path / "gen.jsonl").read_text().splitlines()) == 2
    report = rlhf.evaluate(model=MODEL, data=PROMPTS, max_samples=2, n_samples=2, max_new_tokens=4, reward=REWARD,
                           label_key="answer", temperature=0)
    assert "eval/reward/mean" in report.metrics and len(report.rows) == 4


def test_openrlhfs_names_are_taken_as_the_cli_takes_them_and_noted_once(tmp_path, capsys, monkeypatch):
    """issue 53: the API accepts OpenRLHF's names (renamed flags, value translations, flag-like names,
    dotted 0.10 names, ignored ones) with the CLI's one-time note, and writes the config the native
    names write."""
    from rlhf.cli import openrlhf_names

    monkeypatch.setattr(openrlhf_names, "_told", set())
    rlhf.train(algo="grpo", pretrain=MODEL, prompt_data=PROMPTS, label_key="answer", reward=REWARD,
               **{"rollout.n_samples_per_prompt": 2}, rollout_batch_size=2, generate_max_len=4,
               micro_train_batch_size=2, actor_learning_rate=2e-6, save_steps=-1, no_advantage_std_norm=True,
               logging_steps=1, steps=1, progress=False, out=tmp_path / "alias")
    rlhf.train(algo="grpo", model=MODEL, data=PROMPTS, label_key="answer", reward=REWARD, n_samples=2,
               prompts_per_step=2, max_new_tokens=4, micro_batch_size=2, lr=2e-6, save_every=0, std_norm=False,
               steps=1, progress=False, out=tmp_path / "native")
    rlhf.sft(pretrain=MODEL, dataset=PIPELINE / "sft.jsonl", max_samples=8, train_batch_size=4,
             micro_train_batch_size=4, learning_rate=1e-5, steps=1, progress=False, out=tmp_path / "sft-alias")
    rlhf.sft(model=MODEL, data=PIPELINE / "sft.jsonl", max_samples=8, batch_size=4, micro_batch_size=4, lr=1e-5,
             steps=1, progress=False, out=tmp_path / "sft-native")
    for alias, native in (("alias", "native"), ("sft-alias", "sft-native")):
        got, want = (yaml.safe_load((tmp_path / name / "config.yaml").read_text()) for name in (alias, native))
        assert got.pop("out") != want.pop("out") and got == want, alias
    err = capsys.readouterr().err
    for note in ("note: --pretrain is --model in rlhf", "note: --rollout.n_samples_per_prompt is --n-samples in rlhf",
                 "note: --save_steps -1 is --save-every 0 in rlhf", "note: --no_advantage_std_norm is --no-std-norm",
                 "note: --actor_learning_rate is --lr in rlhf", "note: --learning_rate is --lr in rlhf",
                 "note: --logging_steps is not needed"):
        assert err.count(note) == 1, (note, err)  # once per process, though sft takes --pretrain too
    assert "default algorithm is PPO" not in err  # algo= chose it
    with pytest.raises(ConfigError, match=r"train\(\): pretrain= is OpenRLHF's name of model=, and both are given"):
        rlhf.train(model=MODEL, pretrain="/elsewhere", data=PROMPTS, **SMALL_RL)
    with pytest.raises(ConfigError, match=r"unknown option 'n_samples_per_promt'"):
        rlhf.train(model=MODEL, data=PROMPTS, n_samples_per_promt=2)


def test_the_clis_errors_are_exceptions(tmp_path):
    with pytest.raises(ConfigError, match=r"--lr must be positive; got -1"):
        rlhf.train(algo="grpo", model=MODEL, data=PROMPTS, lr=-1, out=tmp_path / "x", **SMALL_RL)
    with pytest.raises(ConfigError, match=r"train\(\) got an unknown option 'n_sample'; did you mean 'n_samples'"):
        rlhf.train(model=MODEL, data=PROMPTS, n_sample=2)
    with pytest.raises(ConfigError, match=r"Invalid value for 'algo'"):
        rlhf.train(algo="no-such-algo", model=MODEL, data=PROMPTS, **SMALL_RL)
    with pytest.raises(ConfigError, match="model is required"):
        rlhf.sft(data=PROMPTS)
    assert not (tmp_path / "x").exists()


def test_importing_the_api_names_imports_nothing_heavy():
    code = ("import json, sys\nfrom rlhf import train, sft, rm, dpo, kto, prm, distill, generate, evaluate\n"
            "print(json.dumps([m for m in ('torch', 'transformers', 'datasets') if m in sys.modules]))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(result.stdout) == []


def test_ctrl_c_stops_a_call_cleanly_and_resume_continues_it(tmp_path):
    """A notebook's interrupt is a SIGINT to the kernel's main thread: the run ends its step, saves it
    and raises RunInterrupted (a KeyboardInterrupt); the same call with resume=True finishes the run."""
    from rlhf.core.errors import RunInterrupted

    (tmp_path / "interrupting.py").write_text(
        "import os, signal\nfrom pathlib import Path\nFLAG = Path(__file__).with_name('sent')\n"
        "def reward_func(completions, **kw):\n"
        "    if not FLAG.exists():\n        FLAG.write_text('1')\n        os.kill(os.getpid(), signal.SIGINT)\n"
        "    return [0.0 for _ in completions]\n")
    options = dict(SMALL_RL, algo="grpo", model=MODEL, data=PROMPTS, steps=3, out=tmp_path / "run",
                   reward=str(tmp_path / "interrupting.py"), save_every=1)
    with pytest.raises(RunInterrupted, match="interrupted .* after step 1/3"):
        rlhf.train(**options)
    assert (tmp_path / "run" / "checkpoints" / "step_1").is_dir()
    result = rlhf.train(**options, resume=True)
    assert result.step == 3 and result.final is not None
