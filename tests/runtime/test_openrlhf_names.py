"""OpenRLHF's flag names as aliases of the training commands' options (issue 53, docs/openrlhf.md):
rewritten to the native option, told once, with suggestions from the aliases first."""

from __future__ import annotations

import click
import pytest

from rlhf.cli import openrlhf_names
from rlhf.cli.main import make_cli
from rlhf.cli.state import CliState
from tests.helpers import run_cli

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def _fresh_notes(monkeypatch):
    monkeypatch.setattr(openrlhf_names, "_told", set())


def parsed(plugins, command: str, args: list[str]) -> dict:
    cli = make_cli(plugins)
    real = cli.get_command(click.Context(cli), command).command
    return real.make_context(command, args, obj=CliState(plugins)).params


def test_openrlhf_names_set_the_native_options(plugins, capsys):
    params = parsed(plugins, "train", [
        "--pretrain", "m", "--prompt_data", "d.jsonl", "--n_samples_per_prompt", "4", "--micro_train_batch_size", "2",
        "--rollout_batch_size=16", "--actor_learning_rate", "5e-7", "--init_kl_coef", "0.01", "--generate_max_len",
        "32", "--colocate_all_models", "--use_kl_loss", "--max_new_tokens", "8", "--zero_stage", "3"])
    assert params["model"] == "m" and params["data"] == ("d.jsonl",)
    assert (params["n_samples"], params["micro_batch_size"], params["prompts_per_step"]) == (4, 2, 16)
    assert (params["lr"], params["kl_coef"], params["max_new_tokens"]) == (5e-7, 0.01, 8)
    assert params["colocate"] == ("all",) and params["kl_in"] == "loss"
    assert params["backend"].ref == "deepspeed" and params["backend__zero_stage"] == 3
    err = capsys.readouterr().err
    assert "note: --pretrain is --model in rlhf" in err and "note: --n_samples_per_prompt is --n-samples" in err
    assert "--max_new_tokens" in err and err.count("\n") == len(err.splitlines())


def test_the_dotted_names_of_openrlhf_0_10_map_by_their_trailing_words(plugins):
    params = parsed(plugins, "train", ["--rollout.n_samples_per_prompt", "4", "--algo.advantage.estimator", "gae",
                                       "--actor.pretrain", "m", "--train.micro_train_batch_size=2"])
    assert (params["n_samples"], params["advantage"].ref, params["model"], params["micro_batch_size"]) == (
        4, "gae", "m", 2)


def test_the_offline_commands_take_their_own_openrlhf_names(plugins):
    sft = parsed(plugins, "sft", ["--pretrain", "m", "--dataset", "d.jsonl", "--learning_rate", "5e-6",
                                  "--train_batch_size", "256", "--max_epochs", "2", "--save_steps", "-1",
                                  "--eval_steps", "-1", "--logging_steps", "1", "--input_key", "question"])
    assert (sft["model"], sft["data"], sft["lr"], sft["batch_size"], sft["epochs"]) == ("m", ("d.jsonl",), 5e-6, 256, 2)
    assert (sft["save_every"], sft["eval_every"], sft["objective__input_key"]) == (0, 0, "question")  # OpenRLHF's -1: rlhf's 0
    rm = parsed(plugins, "rm", ["--input_key", "context"])
    assert rm["objective__prompt_key"] == "context"  # rm and dpo: the prompt's own column
    prm = parsed(plugins, "prm", ["--pretrain", "m", "--reward_tokens", "+", "-", "--placeholder_token", "@"])
    assert (prm["objective__reward_tokens"], prm["objective__placeholder_token"]) == (("+", "-"), "@")  # a list flag


def test_each_alias_is_told_once_and_spellings_on_one_line(plugins):
    run_cli(plugins, ["sft", "--pretrain", "m", "--max_samples", "2", "--lr", "-1", "--dataset", "d.jsonl"])
    result = run_cli(plugins, ["sft", "--pretrain", "m", "--max_len", "8", "--lr", "-1", "--dataset", "d.jsonl"])
    assert "--pretrain is --model" not in result.output  # told by the first command line already
    assert "note: rlhf spells --max_len with '-': --max-len" in result.output


def test_a_native_name_wins_over_an_alias(plugins):
    # `--max_epochs` is OpenRLHF's epochs in sft, its PPO epochs in train: each command maps its own
    assert parsed(plugins, "train", ["--max_epochs", "2"])["ppo_epochs"] == 2
    assert parsed(plugins, "sft", ["--max_epochs", "2"])["epochs"] == 2


def test_suggestions_rank_the_aliases_first(plugins):
    for command, typed, first in (("train", "--pretrian", "--model"), ("train", "--learning_rate", "--lr"),
                                  ("train", "--n_samples_per_promt", "--n-samples"), ("sft", "--datset", "--data"),
                                  ("train", "--learning-rate", "--lr")):
        result = run_cli(plugins, [command, typed, "1"])
        assert result.exit_code == 2, result.output
        assert result.output.startswith(f"Error: No such option '{typed}'. Did you mean '{first}'"), result.output
        assert len(result.output.splitlines()) == 1 and "Usage:" not in result.output


def test_more_than_one_node_is_refused_with_the_flag_to_use(plugins):
    result = run_cli(plugins, ["train", "--actor_num_nodes", "2"])
    assert result.exit_code == 2 and "pass --policy-actors NODES x GPUS" in result.output, result.output
    assert parsed(plugins, "train", ["--actor_num_nodes", "1", "--actor_num_gpus_per_node", "4"])["policy_actors"] == 4


# The Ray example of OpenRLHF's README (PPO with vLLM on 8 GPUs), as typed there.
RAY_EXAMPLE = """--ref_num_nodes 1 --ref_num_gpus_per_node 2 --reward_num_nodes 1 --reward_num_gpus_per_node 2
--critic_num_nodes 1 --critic_num_gpus_per_node 2 --actor_num_nodes 1 --actor_num_gpus_per_node 2 --vllm_num_engines 4
--vllm_tensor_parallel_size 2 --colocate_all_models --vllm_gpu_memory_utilization 0.5
--pretrain OpenRLHF/Llama-3-8b-sft-mixture --reward_pretrain OpenRLHF/Llama-3-8b-rm-700k --save_path /tmp/r
--ckpt_path /tmp/c --save_hf_ckpt --micro_train_batch_size 8 --train_batch_size 128 --micro_rollout_batch_size 16
--rollout_batch_size 1024 --n_samples_per_prompt 1 --max_epochs 1 --prompt_max_len 1024 --max_samples 100000
--generate_max_len 1024 --zero_stage 3 --bf16 --actor_learning_rate 5e-7 --critic_learning_rate 9e-6
--init_kl_coef 0.01 --prompt_data OpenRLHF/prompt-collection-v0.1 --input_key context_messages --apply_chat_template
--normalize_reward --gradient_checkpointing --packing_samples --vllm_sync_backend nccl --enforce_eager
--vllm_enable_sleep --deepspeed_enable_sleep --use_wandb TOKEN""".split()
# what docs/openrlhf.md lists as "not supported" or with another meaning (no alias on purpose)
NO_ALIAS = {"--ckpt_path", "--save_hf_ckpt", "--reward_num_gpus_per_node", "--use_wandb"}


def test_openrlhfs_ray_example_parses_but_for_the_flags_the_page_lists_as_different(plugins):
    cli = make_cli(plugins)
    real = cli.get_command(click.Context(cli), "train").command
    args, unknown = list(RAY_EXAMPLE), set()
    while True:
        try:
            params = real.make_context("train", list(args), obj=CliState(plugins)).params
            break
        except click.NoSuchOption as exc:
            unknown.add(exc.option_name)
            at = args.index(exc.option_name)
            del args[at: at + (2 if at + 1 < len(args) and not args[at + 1].startswith("--") else 1)]
    assert unknown == NO_ALIAS
    assert (params["policy_actors"], params["ref_actors"], params["critic_actors"]) == (2, 2, 2)
    assert params["engine"].ref == "vllm" and params["rollout_workers"] == 4 and params["colocate"] == ("all",)
    assert params["weight_sync"] == "broadcast" and params["engine__enforce_eager"] is True
    assert (params["lr"], params["critic_lr"], params["max_prompt_length"]) == (5e-7, 9e-6, 1024)
