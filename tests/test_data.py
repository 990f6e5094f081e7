import json
import re

import pytest

from experiments.quickstart import make_data
from experiments.quickstart.make_data import EVAL_PHRASES, TRAIN_PHRASES
from molt.data import DataStream, load_jsonl

GOOD = {"messages": [{"role": "user", "content": "Count up from 4:"}], "answer": "4567"}


@pytest.mark.parametrize("bad, why", [
    ("{not json", "invalid JSON"),
    ("[1, 2]", "JSON object"),
    ('{"answer": "1"}', "messages"),
    ('{"messages": []}', "messages"),
    ('{"messages": [{"role": "user"}]}', "content"),
    ('{"messages": "hi"}', "messages"),
])
def test_malformed_line_names_file_and_line(tmp_path, bad, why):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(GOOD) + "\n\n" + json.dumps(GOOD) + "\n" + bad + "\n")
    with pytest.raises(ValueError, match=why) as e:
        load_jsonl(path)
    assert f"{path}:4:" in str(e.value)  # 1-based, blank line counted


def test_load_jsonl_reads_rows_and_rejects_empty(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(GOOD) + "\n" + json.dumps(dict(GOOD, answer="5678")) + "\n")
    assert [r["answer"] for r in load_jsonl(path)] == ["4567", "5678"]
    path.write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        load_jsonl(path)


def rows(n):
    return [{"messages": [{"role": "user", "content": str(i)}], "i": i} for i in range(n)]


def draw(stream, k):
    return [(p, r["i"]) for p, r in (stream.next() for _ in range(k))]


def test_stream_epochs_are_shuffled_permutations_and_deterministic():
    a = draw(DataStream(rows(10), seed=3), 30)
    assert a == draw(DataStream(rows(10), seed=3), 30)
    assert [p for p, _ in a] == list(range(30))
    epochs = [[i for _, i in a[k:k + 10]] for k in (0, 10, 20)]
    assert all(sorted(e) == list(range(10)) for e in epochs)
    assert epochs[0] != epochs[1] and epochs[0] != list(range(10))
    assert a != draw(DataStream(rows(10), seed=4), 30)


def test_stream_resumes_where_it_stopped():
    full = draw(DataStream(rows(7), seed=1), 25)
    s = DataStream(rows(7), seed=1)
    s.skip_to(12)  # a fresh stream (new process) told only the position
    assert draw(s, 13) == full[12:]
    s.skip_to(3)  # going back also works: draws are a function of (seed, position)
    assert draw(s, 2) == full[3:5] and s.position == 5


def test_quickstart_data_is_valid_deterministic_and_held_out(tmp_path):
    root = make_data.Path(make_data.__file__).parent / "data"
    make_data.main(tmp_path)
    for name in ("train.jsonl", "eval.jsonl"):
        assert (tmp_path / name).read_text() == (root / name).read_text(), f"regenerate {name} with make_data"
    train, evals = load_jsonl(root / "train.jsonl"), load_jsonl(root / "eval.jsonl")
    assert len(train) == 400 and len(evals) == 40
    prompts = lambda data: {r["messages"][0]["content"] for r in data}
    assert not prompts(train) & prompts(evals)
    assert set(TRAIN_PHRASES).isdisjoint(EVAL_PHRASES)
    for r in train + evals:
        d = int(re.search(r"\d", r["messages"][0]["content"]).group())
        assert r["answer"] == "".join(str((d + i) % 10) for i in range(4))
