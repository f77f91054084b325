"""The tracebacks and misleading messages a new user met (issue 53), through the real CLI: one line
that names what is wrong, exit 2 for anything about the command line or the configuration (``--out``
conflicts included), and no traceback. No model is trained or generated from."""

from __future__ import annotations

import pytest

from tests.helpers import run_cli
from tests.runtime.test_clear_errors import assert_one_line, sft, train

pytestmark = pytest.mark.unit


def cpu_only() -> bool:
    import torch

    return not torch.cuda.is_available()


@pytest.mark.parametrize("command", ["train", "sft", "eval", "chat"])
@pytest.mark.parametrize("device, message", [
    ("cuda", "--device cuda: this torch is a CPU-only build; use --device cpu (or auto)"),
    ("gpu", "--device gpu: not a device; use auto, cpu, cuda or cuda:N"),
])
def test_a_device_this_torch_cannot_use_is_one_line(command, device, message, tiny_model_dir, task, tmp_path,
                                                    plugins):
    import torch

    if device == "cuda" and not cpu_only():
        pytest.skip("a GPU is visible")
    if device == "cuda" and torch.version.cuda is not None:
        message = "--device cuda: no GPU is visible; use --device cpu (or auto)"
    data, out = task / "data.jsonl", tmp_path / "run"
    if command == "train":
        result = train(plugins, tiny_model_dir, data, out, "--device", device)
    elif command == "sft":
        result = sft(plugins, tiny_model_dir, data, out, "--input-key", "prompt", "--output-key", "answer",
                     "--device", device)
    elif command == "eval":
        result = run_cli(plugins, ["eval", "--model", str(tiny_model_dir), "--data", str(data), "--label-key",
                                   "answer", "--reward", "examples/rewards.py:exact_match", "--device", device])
    else:
        result = run_cli(plugins, ["chat", str(tiny_model_dir), "--device", device], input="hi\n")
    assert_one_line(result, 2, message)


@pytest.mark.parametrize("command", [train, sft])
def test_data_probs_that_do_not_add_up_to_one_are_refused_before_anything_loads(command, task, tmp_path, plugins):
    data = task / "data.jsonl"
    result = command(plugins, tmp_path / "not-loaded", data, tmp_path / "run", "--data", str(data),
                     "--data-probs", "0.5,0.3")
    assert_one_line(result, 2, "--data-probs must be numbers >= 0 that add up to 1; got 0.5,0.3 (sum 0.8)")
    result = command(plugins, tmp_path / "not-loaded", data, tmp_path / "run", "--data-probs", "0.5,0.5")
    assert_one_line(result, 2, "--data-probs has 2 values for 1 --data; give one per --data")


def test_data_probs_within_rounding_of_one_are_rescaled():
    from rlhf.runtime.config.options import DataOptions

    probs = DataOptions(data=["a", "b", "c"], data_probs="0.1,0.2,0.7").mixing_probs
    assert sum(probs) == 1.0 and probs == pytest.approx([0.1, 0.2, 0.7])


def test_generate_out_a_directory_with_overwrite_is_one_line(tiny_model_dir, task, tmp_path, plugins):
    (tmp_path / "dir").mkdir()
    result = run_cli(plugins, ["generate", "--model", str(tiny_model_dir), "--data", str(task / "data.jsonl"),
                               "--out", str(tmp_path / "dir"), "--overwrite", "--no-progress"])
    assert_one_line(result, 2, f"--out {tmp_path / 'dir'} is a directory; this command writes a .jsonl file")
    assert (tmp_path / "dir").is_dir()


@pytest.mark.parametrize("flag", ["--n-samples", "--prompts-per-step", "--micro-batch-size"])
def test_each_zero_batch_option_is_named(flag, task, tmp_path, plugins):
    result = train(plugins, tmp_path / "not-loaded", task / "data.jsonl", tmp_path / "run", flag, "0")
    assert_one_line(result, 2, f"{flag} must be at least 1; got 0")


@pytest.mark.parametrize("command", [train, sft])
def test_an_out_that_is_a_file_says_so(command, task, tmp_path, plugins):
    (tmp_path / "a-file").write_text("x")
    result = command(plugins, tmp_path / "not-loaded", task / "data.jsonl", tmp_path / "a-file")
    assert_one_line(result, 2, f"--out {tmp_path / 'a-file'} is a file; a run writes into a folder")


@pytest.mark.parametrize("args, message", [
    (["--max-new-tokens", "0"], "--max-new-tokens must be at least 1; got 0"),
    (["--temperature", "-1"], "--temperature must be at least 0 (0: greedy); got -1.0"),
    (["--top-p", "0"], "--top-p must be in (0, 1] (1: off); got 0.0"),
])
def test_chat_refuses_out_of_range_sampling_as_generate_does(args, message, tmp_path, plugins):
    result = run_cli(plugins, ["chat", str(tmp_path / "not-loaded"), *args], input="hi\n")
    assert_one_line(result, 2, message)


@pytest.mark.parametrize("flag", ["--save-every", "--save-hf-every", "--eval-every"])
@pytest.mark.parametrize("command", [train, sft])
def test_minus_one_is_never_and_below_it_is_refused_the_same_in_every_command(flag, command, task, tmp_path, plugins):
    result = command(plugins, tmp_path / "not-loaded", task / "data.jsonl", tmp_path / "run", flag, "-2")
    assert_one_line(result, 2, f"{flag} must be a number of steps")
    assert "-1" in result.output


@pytest.mark.parametrize("command", [train, sft])
def test_lora_rank_below_zero_is_refused_not_a_full_fine_tune(command, tiny_model_dir, task, tmp_path, plugins):
    result = command(plugins, tiny_model_dir, task / "data.jsonl", tmp_path / "run", "--lora-rank", "-4")
    assert_one_line(result, 2, "the 'hf' model: --lora-rank must be at least 0; got -4")
    assert not (tmp_path / "run" / "final").exists()


def test_plain_chat_turns_end_with_eos_as_each_training_sequence_did(tiny_model_dir):
    from transformers import AutoTokenizer

    from rlhf.datagen.chat import ChatSettings, Conversation

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    plain = Conversation(tokenizer, ChatSettings(apply_chat_template=False))
    plain.turns = [("23+45=", "68")]
    assert plain.text("12+30=") == f"23+45=68{tokenizer.eos_token}12+30="
    ids = plain.ids("12+30=", budget=100)
    assert ids == (tokenizer("23+45=")["input_ids"] + tokenizer("68", add_special_tokens=False)["input_ids"]
                   + [tokenizer.eos_token_id] + tokenizer("12+30=", add_special_tokens=False)["input_ids"])
    # a tokenizer that begins every sequence with BOS: the next turn begins with it too
    tokenizer.add_bos_token = True
    if tokenizer("a")["input_ids"][:1] == [tokenizer.bos_token_id]:
        assert plain.text("x") == f"23+45=68{tokenizer.eos_token}{tokenizer.bos_token}x"
    # an input template marks turns itself: unchanged
    templated = Conversation(tokenizer, ChatSettings(input_template="Q: {}\nA: "))
    templated.turns = [("hi", "yo\n")]
    assert templated.text("2+2") == "Q: hi\nA: yo\nQ: 2+2\nA: "


def test_a_step_counts_as_abstained_only_when_no_source_scored_any_sample():
    from rlhf.runtime.rl.guards import abstained

    assert abstained({"reward/failures/a": 0.0, "reward/skipped": 8.0, "reward/failures": 0.0}) == ["a"]
    assert abstained({"reward/failures/a": 0.0, "reward/failures/b": 0.0, "reward/b": 0.5}) == []  # b scored
    # two sampling rounds (dynamic filtering), half the samples of each unscored: the counts add up to a
    # whole batch, but samples were scored
    assert abstained({"reward/failures/a": 0.0, "reward/skipped": 8.0, "reward/a": 1.0}) == []
    assert abstained({"reward/mean": 1.0}) == []  # the environment gives every reward: no source to blame
