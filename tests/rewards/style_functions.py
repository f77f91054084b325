"""Reward functions written the way each framework's users write them, used unchanged by the tests."""

from __future__ import annotations

import asyncio
import re

import torch

# --- OpenRLHF: examples/python/reward_func.py style ---------------------------------------------

def reward_func(queries, prompts, labels, **kwargs):
    """OpenRLHF: the response is the query minus its prompt; returns a tensor."""
    rewards = []
    for query, prompt, label in zip(queries, prompts, labels):
        response = query[len(prompt):]
        rewards.append(1.0 if response.strip() == str(label) else 0.0)
    return torch.tensor(rewards)


def reward_func_dict(queries, prompts, labels):
    """OpenRLHF >= 0.8: a dict with rewards, scores and extra_logs."""
    rewards = torch.tensor([float(len(q) - len(p)) for q, p in zip(queries, prompts)])
    return {"rewards": rewards, "scores": (rewards > 3).float(),
            "extra_logs": {"response_length": rewards.clone(), "dummy": torch.tensor([7.0])}}


# --- TRL: trl/rewards/accuracy_rewards.py style ---------------------------------------------------

def accuracy_reward(completions, solution, **kwargs):
    """TRL conversational: completions are message lists, the label column comes by its own name."""
    contents = [completion[0]["content"] for completion in completions]
    rewards = []
    for content, sol in zip(contents, solution):
        if sol is None:
            rewards.append(None)  # TRL: no score for this sample
            continue
        match = re.search(r"<answer>(.*?)</answer>", content)
        rewards.append(1.0 if match and match.group(1).strip() == sol else 0.0)
    return rewards


def length_reward(completions, **kwargs):
    """TRL plain text: completions are strings; prompts and columns arrive in kwargs."""
    assert "prompts" in kwargs and "difficulty" in kwargs, sorted(kwargs)
    return [float(len(c)) * d for c, d in zip(completions, kwargs["difficulty"])]


async def async_judge(prompts, completions, **kwargs):
    """TRL async: one awaitable call for the batch."""
    await asyncio.sleep(0.01)
    return [1.0 if "yes" in c else 0.0 for c in completions]


# --- verl: verl/utils/reward_score/gsm8k.py style -------------------------------------------------

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl: per sample, positional parameter names, float result."""
    numbers = re.findall(r"-?\d+", solution_str)
    if not numbers:
        return 0.0
    bonus = 0.5 if data_source == "openai/gsm8k" else 0.0
    return (1.0 if numbers[-1] == str(ground_truth) else 0.0) + bonus


def compute_score_dict(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """verl: a dict with 'score' and extra values to log."""
    return {"score": float(solution_str.strip() == ground_truth), "acc": 1.0, "split_is_train":
            float((extra_info or {}).get("split") == "train")}
