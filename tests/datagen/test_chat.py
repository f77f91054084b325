"""``rlhf chat`` as a person uses it: in a pseudo-terminal, two turns that keep the history, /reset,
/exit; and a LoRA adapter directory loads with its base model."""

from __future__ import annotations

import os
import sys

import pytest
import torch

pexpect = pytest.importorskip("pexpect")


def greedy_answer(model_dir, turns: list[tuple[str, str]], message: str, max_new_tokens: int) -> str:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    messages = [{"role": "system", "content": "Be brief."}]
    for user, assistant in turns:
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    text = tokenizer.apply_chat_template(messages + [{"role": "user", "content": message}], tokenize=False,
                                         add_generation_prompt=True)
    ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def answer(child) -> str:
    child.expect_exact("\r\n> ")
    return child.before.replace("\r\n", "\n").strip("\n")


@pytest.mark.run
def test_two_turns_through_a_pty_keep_the_history_and_reset_forgets_it(tiny_model_dir):
    env = {**os.environ, "RLHF_LOAD_PLUGINS": "", "OMP_NUM_THREADS": "1", "TERM": "dumb"}
    child = pexpect.spawn(sys.executable, ["-m", "rlhf", "chat", str(tiny_model_dir), "--temperature", "0",
                                           "--max-new-tokens", "8", "--system", "Be brief."],
                          env=env, encoding="utf-8", timeout=120, dimensions=(40, 300))
    try:
        child.expect_exact("/exit quits")
        child.expect_exact("> ")
        child.sendline("what is 2+3")
        first = answer(child).removeprefix("what is 2+3").strip("\n")
        child.sendline("and 4+4")
        second = answer(child).removeprefix("and 4+4").strip("\n")
        child.sendline("/reset")
        child.expect_exact("(conversation reset)")
        child.expect_exact("> ")
        child.sendline("and 4+4")
        fresh = answer(child).removeprefix("and 4+4").strip("\n")
        child.sendline("/exit")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0
    assert first.strip() and second.strip()
    assert second.strip() != fresh.strip()  # with and without the first turn, the model answers differently
    assert first.strip() == greedy_answer(tiny_model_dir, [], "what is 2+3", 8).strip()
    expected_second = greedy_answer(tiny_model_dir, [("what is 2+3", first)], "and 4+4", 8)
    assert second.strip() == expected_second.strip()  # the answer saw the first turn
    assert fresh.strip() == greedy_answer(tiny_model_dir, [], "and 4+4", 8).strip()


@pytest.mark.unit
def test_a_lora_adapter_directory_loads_on_its_base_model(tiny_model_dir, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhf.datagen.chat import ChatSettings, load_model

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    peft_model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    peft_model.save_pretrained(tmp_path / "adapter")
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(tmp_path / "adapter")
    model, tokenizer = load_model(str(tmp_path / "adapter"), ChatSettings(device="cpu"))
    ids = torch.tensor([tokenizer("1+1=")["input_ids"]])
    with torch.no_grad():
        expected = peft_model.eval()(ids).logits
        plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir)(ids).logits
        got = model(ids).logits
    assert torch.allclose(got, expected, atol=1e-5)
    assert not torch.allclose(got, plain, atol=1e-3)  # the adapter is applied


@pytest.mark.unit
def test_the_conversation_text_with_the_chat_template_or_an_input_template(tiny_model_dir):
    from transformers import AutoTokenizer

    from rlhf.datagen.chat import ChatSettings, Conversation

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    templated = Conversation(tokenizer, ChatSettings(system="S"))
    templated.turns = [("hi", "yo")]
    assert templated.text("2+2") == tokenizer.apply_chat_template(
        [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
         {"role": "user", "content": "2+2"}], tokenize=False, add_generation_prompt=True)
    plain = Conversation(tokenizer, ChatSettings(system="S", input_template="User: {}\nBot: "))
    plain.turns = [("hi", "yo\n")]
    assert plain.text("2+2") == "S\nUser: hi\nBot: yo\nUser: 2+2\nBot: "
    # the oldest turns go first when the conversation outgrows the budget
    plain.turns = [(f"question {i}", f"answer {i}\n") for i in range(50)]
    ids = plain.ids("last", budget=60)
    assert len(ids) <= 60 and tokenizer.decode(ids, skip_special_tokens=True).rstrip().endswith("Bot:")
    assert "question 0" not in tokenizer.decode(ids)


@pytest.mark.run
def test_a_model_trained_on_plain_prompts_is_chatted_with_in_plain_text(tiny_model_dir, tmp_path, plugins):
    """The tokenizer has a chat template, and the model's prompt_format.json says it was trained
    without it: chat uses plain text (it used to apply the template and garble), says why, and
    --apply-chat-template turns the template back on."""
    import shutil

    from transformers import AutoTokenizer

    from rlhf.core.errors import ConfigError
    from rlhf.datagen.chat import ChatSettings, Conversation
    from tests.helpers import run_cli

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert tokenizer.chat_template
    assert Conversation(tokenizer, ChatSettings(apply_chat_template=False)).text("2+2=") == "2+2="
    with pytest.raises(ConfigError, match="pass one"):
        Conversation(tokenizer, ChatSettings(apply_chat_template=True, input_template="Q: {}"))
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    (model / "prompt_format.json").write_text('{"apply_chat_template": false, "input_template": null}')
    result = run_cli(plugins, ["chat", str(model), "--temperature", "0", "--max-new-tokens", "2"], input="2+2=\n")
    assert result.exit_code == 0, result.output
    assert "(plain text, no chat template)" in result.output and "as " + str(model) + " was trained" in result.output
    result = run_cli(plugins, ["chat", str(model), "--apply-chat-template", "--max-new-tokens", "2"], input="2+2=\n")
    assert result.exit_code == 0 and "(its chat template)" in result.output, result.output


@pytest.mark.run
def test_an_answer_never_runs_past_the_context_and_a_message_that_fills_it_is_refused(tiny_model_dir, monkeypatch):
    """With --max-new-tokens above the context (512 new tokens, a small model's 64 positions), the
    prompt keeps its tokens and the answer gets what the context leaves; a message longer than the
    context gets a line, not a garbled answer."""
    import io

    import rlhf.datagen.chat as chat
    from rlhf.datagen.chat import ChatSettings, answer_tokens, history_budget, run_chat

    assert history_budget(64, 512) == 32 and history_budget(4096, 512) == 3584 and history_budget(1, 8) == 1
    assert answer_tokens(64, 20, 512) == 44 and answer_tokens(64, 20, 8) == 8 and answer_tokens(64, 70, 8) == 0
    model, tokenizer = chat.load_model(str(tiny_model_dir), ChatSettings())
    context = model.config.max_position_embeddings
    calls = []
    real_generate = model.generate

    def generate(input_ids, **kwargs):
        calls.append((input_ids.shape[1], kwargs["max_new_tokens"]))
        return real_generate(input_ids=input_ids, **kwargs)

    monkeypatch.setattr(model, "generate", generate)
    monkeypatch.setattr(chat, "load_model", lambda ref, settings: (model, tokenizer))
    long = " ".join(["word"] * (context * 2))
    out = io.StringIO()
    run_chat(str(tiny_model_dir), ChatSettings(max_new_tokens=context * 8, temperature=0.0, input_template="{}"),
             stdin=io.StringIO(f"hello\n{long}\n/exit\n"), stdout=out)
    assert len(calls) == 1  # the long message was refused
    prompt, new = calls[0]
    assert prompt + new == context and prompt == len(tokenizer("hello")["input_ids"])
    assert f"and the model's context is {context}: no room is left for an answer" in out.getvalue()
