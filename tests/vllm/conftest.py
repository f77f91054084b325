"""Fixtures of the vllm engine tests: the tiny policy and the stand-in ``vllm`` module."""

from __future__ import annotations

import pytest

from tests.vllm import fakes


@pytest.fixture
def policy(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir), AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture
def fake_vllm(monkeypatch):
    return fakes.install(monkeypatch)
