"""User errors through the real CLI: one line that says what is wrong and what to do, no traceback,
and (where the check needs no model) before any model loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import run_cli


def train(plugins, model, data, out, *extra):
    return run_cli(plugins, ["train", "--model", str(model), "--data", str(data), "--label-key", "answer",
                             "--reward", "examples/rewards.py:exact_match", "--n-samples", "2", "--prompts-per-step",
                             "2", "--max-new-tokens", "2", "--steps", "1", "--out", str(out), "--no-progress", *extra])


def sft(plugins, model, data, out, *extra):
    return run_cli(plugins, ["sft", "--model", str(model), "--data", str(data), "--out", str(out), "--no-progress",
                             "--batch-size", "2", "--micro-batch-size", "2", *extra])


def assert_one_line(result, code: int, text: str) -> None:
    assert result.exit_code == code, result.output
    assert text in result.output, result.output
    assert "Traceback" not in result.output


@pytest.mark.unit
@pytest.mark.parametrize("command", [train, sft])
def test_a_model_path_that_does_not_exist(command, task, tmp_path, plugins):
    result = command(plugins, tmp_path / "no-such-model", task / "data.jsonl", tmp_path / "run")
    assert_one_line(result, 2, f"{tmp_path / 'no-such-model'}: no such model directory")


@pytest.mark.unit
def test_chat_with_a_model_path_that_does_not_exist(tmp_path, plugins):
    result = run_cli(plugins, ["chat", str(tmp_path / "no-such-model")])
    assert_one_line(result, 2, f"{tmp_path / 'no-such-model'}: no such model directory")


@pytest.mark.unit
def test_a_model_directory_without_config(task, tmp_path, plugins):
    (tmp_path / "empty").mkdir()
    result = train(plugins, tmp_path / "empty", task / "data.jsonl", tmp_path / "run")
    assert_one_line(result, 2, "it is not a Hugging Face model or tokenizer directory")


@pytest.mark.unit
@pytest.mark.parametrize("command", [train, sft])
def test_a_malformed_json_line_is_named_and_shown(command, tiny_model_dir, tmp_path, plugins, caplog):
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "1 + 1?", "answer": "2", "response": "2"}\n{"prompt": "2 + 2?", answer: "4"}\n')
    result = command(plugins, tiny_model_dir, data, tmp_path / "run")
    assert_one_line(result, 2, f'{data} line 2: not valid JSON (Expecting property name enclosed in double quotes '
                               'at column 22): {"prompt": "2 + 2?", answer: "4"}')
    assert "Failed to load JSON" not in caplog.text  # datasets' own line, with a row number of its own
    assert not (tmp_path / "run").exists()  # a run that never started leaves no --out behind


@pytest.mark.unit
@pytest.mark.parametrize("command", [train, sft])
@pytest.mark.parametrize("content", ["", "\n  \n"])
def test_an_empty_data_file_is_named_and_leaves_no_out_behind(command, content, tiny_model_dir, tmp_path, plugins):
    data = tmp_path / "data.jsonl"
    data.write_text(content)
    result = command(plugins, tiny_model_dir, data, tmp_path / "runs" / "run")
    assert_one_line(result, 2, f"{data}: the file is empty")
    assert not (tmp_path / "runs").exists()


@pytest.mark.unit
def test_non_utf8_data_names_the_line(tiny_model_dir, tmp_path, plugins):
    data = tmp_path / "data.jsonl"
    data.write_bytes(b'{"prompt": "ok", "answer": "1"}\n{"prompt": "caf\xe9", "answer": "1"}\n')
    result = train(plugins, tiny_model_dir, data, tmp_path / "run")
    assert_one_line(result, 2, f"{data} line 2: not UTF-8 text (byte 0xe9 at column 16)")


@pytest.mark.unit
def test_a_prompt_that_is_neither_text_nor_messages(tiny_model_dir, tmp_path, plugins):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": 7, "answer": "1"}) + "\n" for _ in range(2)))
    result = train(plugins, tiny_model_dir, data, tmp_path / "run")
    assert_one_line(result, 2, "'prompt' must be a string (or a list of {role, content} messages, with "
                               "--apply-chat-template); got int 7")
    assert "holds chat messages" not in result.output


@pytest.mark.unit
def test_a_response_that_is_not_text_in_sft(tiny_model_dir, tmp_path, plugins):
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps({"prompt": "q", "response": 3}) + "\n" for _ in range(2)))
    result = sft(plugins, tiny_model_dir, data, tmp_path / "run")
    assert result.exit_code == 2 and "a response must be a string" in result.output, result.output


@pytest.mark.unit
@pytest.mark.parametrize("row, what", [
    ({"prompt": [{"role": "user", "content": "q"}], "response": "a"}, "the prompt"),
    ({"prompt": "q", "response": [{"role": "assistant", "content": "a"}]}, "a response"),
])
def test_chat_messages_in_sft_without_the_chat_template_flag(tiny_model_dir, tmp_path, plugins, row, what):
    data = tmp_path / "sft.jsonl"
    data.write_text(json.dumps({"prompt": "q", "response": "a"}) + "\n" + json.dumps(row) + "\n")
    result = sft(plugins, tiny_model_dir, data, tmp_path / "run")
    assert_one_line(result, 2, f"{data} row 2: {what} holds chat messages, not a string; add --apply-chat-template")


@pytest.mark.unit
@pytest.mark.parametrize("flag, value, message", [
    ("--lr", "-1", "--lr must be positive; got -1.0"),
    ("--steps", "0", "--steps must be at least 1; got 0"),
    ("--max-new-tokens", "0", "--max-new-tokens must be at least 1; got 0"),
    ("--temperature", "0", "--temperature must be positive (training samples from the policy and scores its tokens "
                           "at that temperature); got 0.0. For greedy eval use --eval-temperature 0"),
    ("--temperature", "-0.5", "--temperature must be positive"),
    ("--top-p", "0", "--top-p must be in (0, 1] (1: off); got 0.0"),
    ("--top-p", "1.5", "--top-p must be in (0, 1] (1: off); got 1.5"),
    ("--eval-temperature", "-1", "--eval-temperature must be at least 0 (0: greedy); got -1.0"),
])
def test_out_of_range_train_options(flag, value, message, task, tmp_path, plugins):
    # a model that does not exist: the check must come first, before anything loads
    result = train(plugins, tmp_path / "not-loaded", task / "data.jsonl", tmp_path / "run", flag, value)
    assert_one_line(result, 2, message)


@pytest.mark.unit
@pytest.mark.parametrize("command", [train, sft, "generate"])
def test_a_chat_template_and_an_input_template_together_are_refused(command, task, tmp_path, plugins):
    both = ("--apply-chat-template", "--input-template", "Q: {} A:")
    if command == "generate":
        result = run_cli(plugins, ["generate", "--model", str(tmp_path / "not-loaded"), "--data", str(task / "data.jsonl"),
                                   "--out", str(tmp_path / "out.jsonl"), *both])
    else:
        result = command(plugins, tmp_path / "not-loaded", task / "data.jsonl", tmp_path / "run", *both)
    assert_one_line(result, 2, "--apply-chat-template and --input-template both format the prompt; give one")


@pytest.mark.unit
def test_out_of_range_fit_options(task, tmp_path, plugins):
    result = sft(plugins, tmp_path / "not-loaded", task / "data.jsonl", tmp_path / "run", "--lr", "0")
    assert_one_line(result, 2, "--lr must be positive; got 0.0")


@pytest.mark.unit
@pytest.mark.parametrize("command", [train, sft])
def test_an_unwritable_out_fails_before_models_load(command, task, tmp_path, plugins):
    (tmp_path / "a-file").write_text("")
    out = tmp_path / "a-file" / "run"
    result = command(plugins, tmp_path / "not-loaded", task / "data.jsonl", out)
    assert_one_line(result, 2, f"--out {out}: cannot write there (Not a directory)")


@pytest.mark.unit
def test_model_directory_errors_need_no_transformers_traceback(tmp_path):
    from rlhf.core.errors import ConfigError
    from rlhf.core.modeling import check_model_ref

    check_model_ref("org/name")  # a hub name is left to the hub
    with pytest.raises(ConfigError, match="is a file"):
        (tmp_path / "weights.bin").write_text("")
        check_model_ref(str(tmp_path / "weights.bin"))
    tokenizer_only = Path(tmp_path / "tok")
    tokenizer_only.mkdir()
    (tokenizer_only / "tokenizer.json").write_text("{}")
    check_model_ref(str(tokenizer_only), weights=False)


@pytest.mark.unit
def test_a_hub_name_with_the_hub_out_of_reach_fails_at_once(task, tmp_path, plugins, monkeypatch):
    """It used to take the hub client's retries (about 50 s) to say it could not connect."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "https://hub.invalid")  # .invalid never resolves (RFC 2606)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    result = train(plugins, "org/name", task / "data.jsonl", tmp_path / "run")
    assert_one_line(result, 2, "org/name: the hub (https://hub.invalid) cannot be reached to download it and it is "
                               "not in the local cache: pass a local model directory")
    snapshot = tmp_path / "cache" / "models--org--name" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (tmp_path / "cache" / "models--org--name" / "refs").mkdir()
    (tmp_path / "cache" / "models--org--name" / "refs" / "main").write_text("0" * 40)
    result = train(plugins, "org/name", task / "data.jsonl", tmp_path / "run")
    assert_one_line(result, 2, "a copy is in the local cache: run with HF_HUB_OFFLINE=1 to use it")


@pytest.mark.unit
def test_a_usage_error_is_one_line_and_an_unknown_flag_points_at_the_subcommands_help(task, tmp_path, plugins):
    # issue 53: `Error: ...` plus at most one hint line, without click's Usage:/Try banner
    result = train(plugins, tmp_path / "not-loaded", task / "data.jsonl", tmp_path / "run", "--lr", "-1")
    assert result.exit_code == 2 and result.output == "Error: --lr must be positive; got -1.0\n", result.output
    result = train(plugins, tmp_path / "not-loaded", task / "data.jsonl", tmp_path / "run", "--no-such-flag", "1")
    assert result.exit_code == 2, result.output
    assert result.output.splitlines() == ["Error: No such option '--no-such-flag'.",
                                          "(`cli train --help` lists the options)"], result.output
    result = run_cli(plugins, [])  # no command at all: the help, as before
    assert result.exit_code == 2 and result.output.startswith("Usage: cli [OPTIONS] COMMAND"), result.output
    result = run_cli(plugins, ["train", "--help"])  # --help still shows the usage
    assert result.exit_code == 0 and result.output.startswith("Usage: cli train [OPTIONS]"), result.output


@pytest.mark.unit
def test_the_command_list_cuts_no_line_short(plugins):
    result = run_cli(plugins, ["--help"])
    assert result.exit_code == 0
    commands = result.output.split("Commands:")[1]
    assert "..." not in commands, commands
    assert commands.count("(") == commands.count(")"), commands


@pytest.mark.run
def test_missing_labels_are_counted_and_refused_unless_allowed(tiny_model_dir, tmp_path, plugins, caplog):
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "1 + 1?", "answer": "2"}\n{"prompt": "2 + 2?"}\n{"prompt": "3 + 3?", "answer": "6"}\n'
                    '{"prompt": "4 + 4?"}\n')
    refused = train(plugins, tiny_model_dir, data, tmp_path / "run")
    assert_one_line(refused, 2, f"--label-key answer: 2 of 4 rows have no label (the first: {data} row 2); fix the "
                                "data, or pass --allow-missing-labels")
    allowed = train(plugins, tiny_model_dir, data, tmp_path / "run", "--allow-missing-labels")
    assert allowed.exit_code == 0, allowed.output
    assert "2 of 4 rows have no label" in caplog.text


@pytest.mark.run
def test_module_rewards_import_from_the_current_directory(tiny_model_dir, task, tmp_path):
    """The `rlhf` script (not `python -m`) does not put the current directory on sys.path by itself."""
    import os
    import shutil
    import subprocess
    import sys

    (tmp_path / "my_rewards.py").write_text("def reward_func(completions, **kwargs):\n"
                                            "    return [1.0] * len(completions)\n")
    script = shutil.which("rlhf", path=str(Path(sys.executable).parent))
    assert script is not None
    result = subprocess.run([script, "train", "--model", str(tiny_model_dir), "--data", str(task / "data.jsonl"),
                             "--reward", "my_rewards:reward_func", "--n-samples", "2", "--prompts-per-step", "2",
                             "--max-new-tokens", "2", "--steps", "1", "--out", "run", "--no-progress"],
                            capture_output=True, text=True, cwd=tmp_path, env={**os.environ, "RLHF_LOAD_PLUGINS": ""})
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])["reward/mean"] == 1.0


@pytest.mark.unit
def test_a_timeout_that_cannot_apply_to_a_sync_reward_is_said(caplog):
    from rlhf.rewards import load_rewards

    load_rewards(["examples/rewards.py:exact_match"], timeout_s=5)
    assert "--reward-timeout-s 5 does not apply to the sync reward function(s) exact_match" in caplog.text
    caplog.clear()
    load_rewards(["examples/rewards.py:exact_match"], timeout_s=5, sync_in_thread=True)  # applies: nothing to say
    load_rewards(["examples/rewards.py:exact_match"])  # the default, not asked for
    assert "does not apply" not in caplog.text


@pytest.mark.unit
@pytest.mark.parametrize("reward, message", [
    ("examples/rewards.py:nosuch", "'examples/rewards.py' ("),
    ("no_such_file.py", "file 'no_such_file.py' does not exist"),
    ("exact_matc", "Did you mean 'exact_match'"),
])
def test_a_reward_that_cannot_be_loaded_is_a_usage_error(reward, message, task, tmp_path, plugins):
    """Exit 2: what was asked cannot work (exit 1 is for failures while running)."""
    result = run_cli(plugins, ["train", "--model", str(tmp_path / "no-model"), "--data", str(task / "data.jsonl"),
                               "--label-key", "answer", "--reward", reward, "--out", str(tmp_path / "run")])
    assert_one_line(result, 2, message)
