"""Prompt datasets: formats, templates, mixing, truncation, resumable order, precise errors."""

from __future__ import annotations

import json

import pytest

from rlhf.runtime.run.data import DataError, DataSettings, PromptFormatter, PromptLoader, check_json_shape, load_prompts

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_jsonl_rows_become_prompt_items_with_label_and_columns(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "What is 1+1?", "answer": "2", "source": "toy"}])
    settings = DataSettings(paths=[path], label_key="answer")
    item = PromptFormatter(tokenizer, settings)(load_prompts(settings)[0])
    assert item.prompt == item.prompt_text == "What is 1+1?"
    assert tokenizer.decode(item.prompt_ids) == "What is 1+1?"
    assert item.label == "2"
    assert item.columns == {"answer": "2", "source": "toy"}  # the label column stays under its own name
    assert item.origin == f"{path} row 1"


def test_missing_column_names_the_file(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": "x"}])
    with pytest.raises(DataError, match=r"d\.jsonl: no column 'prompt' \(columns: question\)"):
        load_prompts(DataSettings(paths=[path]))


def test_missing_value_names_the_file_and_row(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "ok"}, {"prompt": "also ok"}, {"prompt": None}])
    settings = DataSettings(paths=[path])
    dataset = load_prompts(settings)
    with pytest.raises(DataError, match=r"d\.jsonl row 3: empty or missing 'prompt'"):
        PromptFormatter(tokenizer, settings)(dataset[2])


def test_chat_template_for_strings_and_message_lists(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [
        {"prompt": "hi"},
        {"prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]},
    ])
    settings = DataSettings(paths=[path], apply_chat_template=True)
    formatter, dataset = PromptFormatter(tokenizer, settings), load_prompts(settings)
    assert formatter(dataset[0]).prompt_text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert formatter(dataset[1]).prompt_text.startswith("<|im_start|>system\nbe brief<|im_end|>\n")


def test_messages_without_chat_template_flag_are_an_error(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": [{"role": "user", "content": "hi"}]}])
    settings = DataSettings(paths=[path])
    with pytest.raises(DataError, match="add --apply-chat-template"):
        PromptFormatter(tokenizer, settings)(load_prompts(settings)[0])


def test_input_template_and_its_validation(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "2+2 {x}"}])
    settings = DataSettings(paths=[path], input_template="Q: {}\nA:")
    assert PromptFormatter(tokenizer, settings)(load_prompts(settings)[0]).prompt_text == "Q: 2+2 {x}\nA:"
    with pytest.raises(DataError, match="must contain {}"):
        PromptFormatter(tokenizer, DataSettings(paths=[path], input_template="no slot"))


def test_long_prompts_lose_their_start(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "one two three four five six seven"}])
    settings = DataSettings(paths=[path], max_prompt_length=3)
    formatter = PromptFormatter(tokenizer, settings)
    item = formatter(load_prompts(settings)[0])
    full = tokenizer("one two three four five six seven")["input_ids"]
    assert item.prompt_ids == full[-3:] and item.truncated and formatter.truncated_count == 1


def test_parquet_and_save_to_disk_and_mixing(tmp_path, tokenizer):
    import datasets

    datasets.Dataset.from_list([{"prompt": f"p{i}"} for i in range(4)]).to_parquet(str(tmp_path / "a.parquet"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list([{"prompt": f"q{i}"} for i in range(4)])}) \
        .save_to_disk(str(tmp_path / "saved"))
    both = load_prompts(DataSettings(paths=[str(tmp_path / "a.parquet"), str(tmp_path / "saved")]))
    assert [r["prompt"] for r in both] == ["p0", "p1", "p2", "p3", "q0", "q1", "q2", "q3"]
    mixed = load_prompts(DataSettings(paths=[str(tmp_path / "a.parquet"), str(tmp_path / "saved")],
                                      probs=[0.5, 0.5], seed=1))
    assert {r["prompt"] for r in mixed} == {f"p{i}" for i in range(4)} | {f"q{i}" for i in range(4)}
    with pytest.raises(DataError, match="no split 'test'"):
        load_prompts(DataSettings(paths=[str(tmp_path / "saved")], split="test"))


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_prompts(DataSettings(paths=[str(tmp_path / "nope.jsonl")]))


def test_loader_order_is_seeded_covers_every_prompt_and_resumes(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"prompt {i}"} for i in range(10)])
    settings = DataSettings(paths=[path])

    def loader():
        return PromptLoader(load_prompts(settings), PromptFormatter(tokenizer, settings), seed=3)

    first = loader()
    epoch = [p.prompt for p in first.next_batch(10)]
    assert sorted(epoch) == sorted(f"prompt {i}" for i in range(10)) and epoch != sorted(epoch)
    full = [p.prompt for p in loader().next_batch(25)]
    resumed = loader()
    head = [p.prompt for p in resumed.next_batch(13)]
    state = resumed.state_dict()
    again = loader()
    again.load_state_dict(state)
    assert head + [p.prompt for p in again.next_batch(12)] == full


def test_the_runs_data_options_reach_the_loader(tmp_path, tokenizer):
    from rlhf.runtime.config.train_config import TrainConfig
    from rlhf.runtime.rl.local import build_loader

    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"question": "What is 2 + 2?", "answer": "4", "level": 1}) + "\n")
    path.write_text(json.dumps({"question": "What is 2 + 2?", "answer": "4", "level": 1}) + "\n"
                    + json.dumps({"question": "What is 3 + 3?", "answer": "6", "level": 2}) + "\n")
    config = TrainConfig(model="m", data=[str(path)], input_key="question", label_key="answer",
                         input_template="Q: {}\nA:", max_prompt_length=64, seed=3, max_samples=1)
    loader = build_loader(config, tokenizer)
    assert len(loader) == 1
    (item,) = loader.next_batch(1)
    assert item.prompt_text == "Q: What is 2 + 2?\nA:" and item.label == "4" and item.columns["level"] == 1
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"prompt": [{"role": "user", "content": "hi"}]}) + "\n")
    (item,) = build_loader(TrainConfig(model="m", data=[str(chat)], apply_chat_template=True), tokenizer).next_batch(1)
    assert item.prompt_text == tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                                             add_generation_prompt=True)
    many = tmp_path / "many.jsonl"
    many.write_text("".join(json.dumps({"prompt": f"p{i}"}) + "\n" for i in range(20)))

    def order(seed):
        return [item.prompt for item in build_loader(TrainConfig(model="m", data=[str(many)], seed=seed),
                                                     tokenizer).next_batch(20)]

    assert order(3) == order(3) and order(3) != order(4)  # the run's --seed shuffles the prompts
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"prompt": "one two three four five six seven eight nine ten"}) + "\n")
    (item,) = build_loader(TrainConfig(model="m", data=[str(long)], max_prompt_length=4), tokenizer).next_batch(1)
    assert len(item.prompt_ids) == 4
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_list([{"prompt": "from train"}]),
                          "test": datasets.Dataset.from_list([{"prompt": "from test"}])}).save_to_disk(str(tmp_path / "d"))
    (item,) = build_loader(TrainConfig(model="m", data=[str(tmp_path / "d")], data_split="test"), tokenizer).next_batch(1)
    assert item.prompt == "from test"


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_a_row_nested_past_the_limit_is_named_by_line_before_pyarrow_reads_it(tmp_path, suffix):
    ok = '{"prompt": "a", "x": "[[[[ in a string do not count ' + "[" * 2000 + '"}'
    deep = '{"prompt": "b", "x": ' + nested(1000) + "}"  # the row's object is a level too: 1,001
    path = tmp_path / f"d{suffix}"
    path.write_text("\n".join([ok, '{"prompt": "c", "x": ' + nested(999) + "}"]) + "\n")
    if suffix == ".json":
        path.write_text("[\n" + ok + ",\n" + '{"prompt": "c", "x": ' + nested(998) + "}\n]\n")
    check_json_shape(path)  # a string's brackets, and 1,000 levels (the .json's list is one of them), pass
    path.write_text((f"[\n{ok},\n{deep}\n]\n" if suffix == ".json" else f"{ok}\n{deep}\n"))
    line = 3 if suffix == ".json" else 2
    with pytest.raises(DataError, match=rf"d{suffix} line {line}: a value nested more than 1,000 levels deep"):
        check_json_shape(path)
