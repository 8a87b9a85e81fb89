import json
import pickle
from types import SimpleNamespace

import pytest

from gearshift.rl.data import (
    DataError, PromptDataset, Row, as_prompt_dataset, read_rows, render_prompt, tokenize_prompts,
)
from gearshift.models.tiny import build_tokenizer

CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


def write(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_jsonl_rows_keep_every_column_and_know_their_line(tmp_path):
    path = write(tmp_path / "d.jsonl", [json.dumps({"prompt": "1+1=", "answer": "2"}), "",
                                        json.dumps({"prompt": CHAT, "answer": "4", "level": 3})])
    rows = read_rows(path)
    assert rows == [{"prompt": "1+1=", "answer": "2"}, {"prompt": CHAT, "answer": "4", "level": 3}]
    assert rows[1].origin == f"{path}:3"
    assert PromptDataset(rows).columns == ["answer", "prompt"]
    assert pickle.loads(pickle.dumps(rows[1])).origin == rows[1].origin


@pytest.mark.parametrize("line, message", [
    ('{"prompt": "a", ', r"d.jsonl:2: not valid JSON"),
    ('["a", "b"]', r"d.jsonl:2: each line must be a JSON object"),
    ('{"question": "a"}', r"d.jsonl:2: no 'prompt' column \(columns: question\); rename .* data.prompt_key"),
    ('{"prompt": 7}', r"d.jsonl:2: 'prompt' must be a string or a non-empty list of chat messages.*got int"),
    ('{"prompt": [{"role": "user"}]}', r"d.jsonl:2: chat message 0 of the prompt"),
    ('{"prompt": ""}', r"d.jsonl:2: the prompt is empty"),
])
def test_bad_rows_name_the_file_and_line(tmp_path, line, message):
    path = write(tmp_path / "d.jsonl", ['{"prompt": "ok"}', line])
    with pytest.raises(DataError, match=message):
        read_rows(path)


def test_other_file_problems(tmp_path):
    with pytest.raises(DataError, match="not found"):
        read_rows(tmp_path / "nope.jsonl")
    with pytest.raises(DataError, match="unknown data format '.csv'; use .jsonl or .parquet"):
        read_rows(write(tmp_path / "d.csv", ["prompt", "a"]))
    with pytest.raises(DataError, match="has no rows"):
        read_rows(write(tmp_path / "e.jsonl", [""]))
    rows = read_rows(write(tmp_path / "q.jsonl", ['{"question": "hi"}']), prompt_key="question")
    assert rows[0]["question"] == "hi"


def test_parquet_rows(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "3+4=", "answer": "7"}, {"prompt": "1+2=", "answer": "3"}]),
                   path)
    rows = read_rows(path)
    assert rows == [{"prompt": "3+4=", "answer": "7"}, {"prompt": "1+2=", "answer": "3"}]
    assert rows[1].origin == f"{path}: row 2"
    pq.write_table(pa.Table.from_pylist([{"text": "x"}]), path)
    with pytest.raises(DataError, match=r"d.parquet: row 1: no 'prompt' column \(columns: text\)"):
        read_rows(path)


def test_chat_prompts_use_the_chat_template_with_the_generation_prompt(tokenizer):
    text = render_prompt(CHAT, tokenizer)
    assert text == ("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"
                    "<|im_start|>assistant\n")
    ids = tokenize_prompts([{"prompt": CHAT}, {"prompt": "12+7="}], tokenizer)
    assert ids[0] == tokenizer.encode(text, add_special_tokens=False)
    assert ids[0][0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert len(ids[1]) == 5  # byte-level: one token per character
    tokenizer_without = SimpleNamespace(chat_template=None)
    with pytest.raises(DataError, match="row 0: the prompt is a list of chat messages but the tokenizer has no chat"):
        tokenize_prompts([{"prompt": CHAT}], tokenizer_without)


def test_long_prompts_raise_naming_the_row_or_are_truncated(tmp_path, tokenizer):
    path = write(tmp_path / "d.jsonl", ['{"prompt": "1+1="}', '{"prompt": "12+7="}'])
    data = PromptDataset.from_file(path)
    with pytest.raises(DataError, match=r"d.jsonl:2: the prompt has 5 tokens, more than max_prompt_len=4"):
        data.bind(tokenizer, max_prompt_len=4)
    left = tokenize_prompts(data.rows, tokenizer, max_prompt_len=4, truncation="left")
    right = tokenize_prompts(data.rows, tokenizer, max_prompt_len=4, truncation="right")
    assert left[1] == tokenizer.encode("2+7=") and right[1] == tokenizer.encode("12+7")
    assert left[0] == right[0] == tokenizer.encode("1+1=")


def test_batches_cover_each_epoch_once_in_a_seeded_order(tokenizer):
    rows = [{"prompt": f"p{i}", "answer": str(i)} for i in range(10)]
    data = PromptDataset(rows, seed=1)
    data.bind(tokenizer)
    first = [r["answer"] for b in range(5) for r in data.next_batch(2)]
    assert sorted(first) == [str(i) for i in range(10)] and first != sorted(first)
    assert data.state_dict()["epoch"] == 1 and data.state_dict()["index"] == 0
    second = [r["answer"] for b in range(5) for r in data.next_batch(2)]
    assert sorted(second) == sorted(first) and second != first  # a new shuffle each epoch
    again = PromptDataset(rows, seed=1)
    assert [r["answer"] for r in again.next_batch(10)] == first
    assert [r["answer"] for r in PromptDataset(rows, seed=2).next_batch(10)] != first
    batch = data.next_batch(3)
    assert batch[0]["prompt_ids"] == tokenizer.encode(batch[0]["prompt"])
    assert "prompt_ids" not in rows[0] and "prompt_ids" not in data.rows[0]  # the dataset is not modified


def test_resuming_continues_on_the_exact_next_batch_across_epochs():
    rows = [{"prompt": f"p{i}"} for i in range(7)]
    run = PromptDataset(rows, seed=5)
    for _ in range(4):  # 12 rows: into the second epoch
        run.next_batch(3)
    state = json.loads(json.dumps(run.state_dict()))  # as a checkpoint stores it
    expected = [run.next_batch(3) for _ in range(3)]
    resumed = PromptDataset(rows, seed=99)
    resumed.load_state_dict(state)
    assert [resumed.next_batch(3) for _ in range(3)] == expected
    with pytest.raises(DataError, match="dataset of 7 rows, this one has 6"):
        PromptDataset(rows[:6]).load_state_dict(state)


def test_batch_size_larger_than_the_dataset_is_an_error():
    with pytest.raises(DataError, match="batch of 8 prompts from a dataset of 3 rows"):
        PromptDataset([{"prompt": "a"}] * 3).next_batch(8)
    with pytest.raises(DataError, match="row 1: no 'prompt' column"):
        PromptDataset([{"prompt": "a"}, {"text": "b"}])


def test_from_config_reads_a_file_or_builds_the_task(tmp_path):
    path = write(tmp_path / "d.jsonl", ['{"q": "1+1=", "answer": "2"}'])
    data = PromptDataset.from_config(SimpleNamespace(path=str(path), task="add", prompt_key="q", seed=0))
    assert len(data) == 1 and data.prompt_key == "q"
    task = PromptDataset.from_config(SimpleNamespace(path=None, task="add", prompt_key="prompt", seed=3))
    assert len(task) == 4096 and task.rows[0]["prompt"].endswith("=")
    assert isinstance(task.next_batch(1)[0], Row)


def test_what_users_hand_over_becomes_a_prompt_dataset(tmp_path):
    rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+1=", "answer": "3"}]
    as_list = as_prompt_dataset(rows)
    assert [dict(r) for r in as_list.rows] == rows and as_list.rows[1].origin == "row 1"
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert [dict(r) for r in as_prompt_dataset(tmp_path / "d.jsonl").rows] == rows
    assert as_prompt_dataset(as_list) is as_list
    datasets = pytest.importorskip("datasets")
    from_hf = as_prompt_dataset(datasets.Dataset.from_list(rows))
    assert [dict(r) for r in from_hf.rows] == rows and from_hf.columns == ["answer", "prompt"]
    with pytest.raises(DataError, match="row 0: no 'prompt' column"):
        as_prompt_dataset(datasets.Dataset.from_list([{"question": "1+1="}]))
    with pytest.raises(DataError, match="row 1: each row must be a mapping"):
        as_prompt_dataset([{"prompt": "x"}, "y"])
    with pytest.raises(DataError, match="a datasets.Dataset or a list of row mappings"):
        as_prompt_dataset(42)
