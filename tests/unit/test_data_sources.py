"""rl.data.sources: each real schema from tests/data, dedup counts, the spec format and bad input."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rl.data import arith, sources
from rl.data.problems import MAX_LISTED, ROWS_NOTE, DataError
from rl.data.prompts import dapo_prompt
from rl.data.sources import load_prompts, load_source, parse_spec

DATA = Path(__file__).resolve().parent.parent / "data"
DAPO = DATA / "dapo_math_17k.parquet"
AIME_VERL = DATA / "bytedtsinghua_aime_2024.parquet"
AIME_H4 = DATA / "h4_aime_2024.parquet"
AIME_MAXWELL = DATA / "maxwell_aime_2024.jsonl"
AIME_ANSWERS = ["204", "25", "809"]


def _answers(ds: datasets.Dataset) -> list[str]:
    return [rm["ground_truth"] for rm in ds["reward_model"]]


def test_dapo_math_17k_dedups_by_prompt_keeping_the_first():
    src = load_source(str(DAPO))
    raw = pq.read_table(DAPO).to_pylist()
    assert (src.schema, src.num_raw_rows, src.num_duplicates, len(src.dataset)) == ("verl", 12, 7, 5)
    # The first occurrences are rows 0, 1, 3, 6 and 8 (see make_fixtures.DAPO_ORDER).
    assert [r["index"] for r in src.dataset["extra_info"]] == [
        raw[i]["extra_info"]["index"] for i in (0, 1, 3, 6, 8)
    ]
    assert _answers(src.dataset) == ["84", "66", "0", "1", "600"]
    assert set(src.dataset["data_source"]) == {"math_dapo"}
    assert src.dataset[0]["prompt"] == raw[0]["prompt"]
    assert len({p[0]["content"] for p in src.dataset["prompt"]}) == 5


def test_bytedtsinghua_aime_repeats_collapse_to_the_problems():
    src = load_source(str(AIME_VERL))
    assert (src.num_raw_rows, src.num_duplicates, len(src.dataset)) == (12, 9, 3)
    assert _answers(src.dataset) == AIME_ANSWERS
    assert src.dataset[0]["reward_model"]["style"] == "rule-lighteval/MATH_v2"


def test_h4_aime_schema_gets_the_dapo_instruction():
    src = load_source(str(AIME_H4))
    problems = pq.read_table(AIME_H4)["problem"].to_pylist()
    ds = src.dataset
    assert (src.schema, src.num_duplicates, len(ds)) == ("raw", 0, 3)
    assert ds[0]["prompt"] == [{"content": dapo_prompt(problems[0]), "role": "user"}]
    assert ds[0]["prompt"][0]["content"].endswith('on its own line after "Answer:".')
    assert _answers(ds) == AIME_ANSWERS
    assert [e["id"] for e in ds["extra_info"]] == ["60", "61", "62"]
    assert set(ds["data_source"]) == {"h4_aime_2024"}  # the file's stem
    assert set(ds["ability"]) == {"math"}


def test_maxwell_jia_jsonl_converts_integer_answers():
    ds = load_prompts(str(AIME_MAXWELL))
    assert ds.features["reward_model"]["ground_truth"].dtype == "string"
    assert _answers(ds) == AIME_ANSWERS
    assert [e["id"] for e in ds["extra_info"]] == ["2024-I-1", "2024-I-2", "2024-I-3"]
    # Same problems as the H4 copy, so the same prompts.
    assert ds["prompt"] == load_prompts(str(AIME_H4))["prompt"]


def test_raw_and_verl_prompts_share_one_arrow_type():
    # Raw sources are written in DAPO's field order so that they concatenate with it.
    dapo, h4 = load_prompts(str(DAPO)), load_prompts(str(AIME_H4))
    assert dapo.features["prompt"] == h4.features["prompt"]
    assert list(h4.features["reward_model"]) == ["ground_truth", "style"]


def test_options_in_the_spec_and_as_keywords():
    assert len(load_prompts(f"{DAPO}?dedup=false")) == 12
    assert _answers(load_prompts(f"{DAPO}?limit=2")) == ["84", "66"]
    ds = load_prompts(f"{AIME_VERL}?data_source=aime-2024")
    assert set(ds["data_source"]) == {"aime-2024"}
    assert set(load_prompts(str(AIME_MAXWELL), data_source="aime24")["data_source"]) == {"aime24"}
    assert len(load_prompts(str(DAPO), dedup=False, limit=7)) == 7


def test_directory_concatenates_shards_and_dedups_across_them(tmp_path):
    table = pq.read_table(DAPO)
    pq.write_table(table.slice(0, 5), tmp_path / "train-00000-of-00002.parquet")
    pq.write_table(table.slice(5), tmp_path / "train-00001-of-00002.parquet")
    (tmp_path / ".cache").mkdir()
    shutil.copy(AIME_VERL, tmp_path / ".cache" / "stale.parquet")  # hidden: not data
    src = load_source(str(tmp_path))
    assert (src.num_raw_rows, src.num_duplicates) == (12, 7)
    assert _answers(src.dataset) == ["84", "66", "0", "1", "600"]


def test_directory_with_mixed_schemas_names_the_files(tmp_path):
    shutil.copy(DAPO, tmp_path / "a.parquet")
    shutil.copy(AIME_H4, tmp_path / "b.parquet")
    with pytest.raises(ValueError, match=r"different columns: .*a\.parquet has .*b\.parquet has"):
        load_prompts(str(tmp_path))


def test_hub_ids_go_through_datasets_load_dataset(monkeypatch):
    calls = []

    def fake_load_dataset(path, name=None, split=None):
        calls.append((path, name, split))
        return datasets.Dataset(pa.Table.from_pylist(pq.read_table(AIME_H4).to_pylist()))

    monkeypatch.setattr(sources.datasets, "load_dataset", fake_load_dataset)
    src = load_source("HuggingFaceH4/aime_2024")
    assert calls == [("HuggingFaceH4/aime_2024", None, "train")]
    assert src.origin == "HuggingFaceH4/aime_2024 (split train)"
    assert set(src.dataset["data_source"]) == {"HuggingFaceH4/aime_2024"}
    assert _answers(src.dataset) == AIME_ANSWERS
    load_source(f"hf:{DAPO}?split=test&config=default")  # hf: forces the hub even for a local path
    assert calls[-1] == (str(DAPO), "default", "test")


def test_synthetic_source_is_make_rows_with_the_knobs():
    ds = load_prompts("synthetic:arith?n=8&seed=3&max_operand=99&ops=+-*&num_terms=3&split=test")
    expected = arith.make_rows(8, 3, arith.ArithSpec(num_terms=3, max_operand=99, ops="+-*"), "test")
    assert ds.to_list() == expected
    assert (
        load_prompts("synthetic:arith?n=8&seed=3&max_operand=99&ops=+-*&num_terms=3&split=test").to_list()
        == expected
    )
    assert (
        ds.to_list()
        != load_prompts("synthetic:arith?n=8&seed=4&max_operand=99&ops=+-*&num_terms=3").to_list()
    )
    default = load_source("synthetic:arith")
    assert (len(default.dataset), default.num_duplicates) == (256, 0)  # n rows: no dedup unless asked
    deduped = load_source("synthetic:arith", dedup=True)
    distinct = len({r["extra_info"]["expression"] for r in arith.make_rows(256, 0)})
    assert len(deduped.dataset) == distinct and deduped.num_duplicates == 256 - distinct


def test_parse_spec():
    assert parse_spec("data/x.parquet") == ("data/x.parquet", {})
    assert parse_spec("synthetic:arith?n=4&ops=+-") == ("synthetic:arith", {"n": "4", "ops": "+-"})
    with pytest.raises(ValueError, match="option 'n' is not of the form key=value"):
        parse_spec("synthetic:arith?n")
    with pytest.raises(ValueError, match="option 'n' is given twice"):
        parse_spec("synthetic:arith?n=1&n=2")
    with pytest.raises(ValueError, match="non-empty string"):
        parse_spec("  ")


@pytest.mark.parametrize(
    "spec, message",
    [
        (
            "synthetic:arith?size=4",
            r"unknown option 'size'.*\['data_source', 'dedup', 'limit', 'max_operand'",
        ),
        ("synthetic:arith?n=four", r"option n='four' must be an integer"),
        ("synthetic:arith?dedup=maybe", r"option dedup='maybe' must be true or false"),
        ("synthetic:arith?num_terms=1", r"ArithSpec.num_terms must be >= 2"),
        ("synthetic:geometry", r"unknown synthetic task 'geometry'"),
        (f"{DAPO}?split=test", r"unknown option 'split'"),
        (f"{DAPO}?limit=0", r"limit must be positive"),
        ("no/such/file.parquet", r"no such file or directory, and 'no/such/file.parquet' is not a hub id"),
    ],
)
def test_bad_specs(spec, message):
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        load_prompts(spec)


# Bad input files --------------------------------------------------------------------------------------


def _write_parquet(path: Path, rows: list[dict] | pa.Table) -> str:
    pq.write_table(rows if isinstance(rows, pa.Table) else pa.Table.from_pylist(rows), path)
    return str(path)


def _verl(content: str = "What is 1 + 1?", answer=None) -> dict:
    return {
        "data_source": "x",
        "prompt": [{"content": content, "role": "user"}],
        "reward_model": {"ground_truth": answer},
    }


def test_missing_answer_column_names_file_and_column(tmp_path):
    path = _write_parquet(
        tmp_path / "noanswer.parquet", [{"data_source": "x", "prompt": [{"content": "q", "role": "user"}]}]
    )
    with pytest.raises(ValueError, match=r"noanswer\.parquet: no answer column 'reward_model'"):
        load_prompts(path)
    path = _write_parquet(
        tmp_path / "h4like.parquet", [{"id": 1, "problem": "What is 1 + 1?", "solution": "2"}]
    )
    with pytest.raises(
        ValueError, match=r"h4like\.parquet: no answer column 'answer'.*'id', 'problem', 'solution'"
    ):
        load_prompts(path)


def test_missing_prompt_column_names_file_and_column(tmp_path):
    path = _write_parquet(tmp_path / "noprompt.parquet", [{"reward_model": {"ground_truth": "2"}}])
    with pytest.raises(ValueError, match=r"noprompt\.parquet: no prompt column 'prompt'"):
        load_prompts(path)
    path = _write_parquet(tmp_path / "question.parquet", [{"question": "What is 1 + 1?", "answer": "2"}])
    with pytest.raises(ValueError, match=r"question\.parquet: no prompt column 'problem'"):
        load_prompts(path)
    # Named columns map any raw schema.
    ds = load_prompts(f"{path}?problem_key=question")
    assert ds[0]["prompt"][0]["content"] == dapo_prompt("What is 1 + 1?") and _answers(ds) == ["2"]


def test_ground_truth_without_field_and_prompt_as_text(tmp_path):
    path = _write_parquet(
        tmp_path / "rm.parquet",
        [{"prompt": [{"content": "q", "role": "user"}], "reward_model": {"answer": "2"}}],
    )
    with pytest.raises(
        ValueError, match=r"rm\.parquet: column 'reward_model' must be a struct with a 'ground_truth'"
    ):
        load_prompts(path)
    path = _write_parquet(
        tmp_path / "text.parquet", [{"prompt": "What is 1 + 1?", "reward_model": {"ground_truth": "2"}}]
    )
    with pytest.raises(ValueError, match=r"text\.parquet: column 'prompt' must hold chat messages"):
        load_prompts(path)


def test_empty_dataset_is_an_error(tmp_path):
    empty = pa.Table.from_pylist([_verl(answer="2")]).slice(0, 0)
    path = _write_parquet(tmp_path / "empty.parquet", empty)
    with pytest.raises(ValueError, match=r"empty\.parquet: the dataset is empty"):
        load_prompts(path)
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(
        ValueError, match=r"empty\.jsonl: the file is empty \(expected one JSON object per line\)"
    ):
        load_prompts(str(tmp_path / "empty.jsonl"))
    (tmp_path / "zero.parquet").write_bytes(b"")
    with pytest.raises(ValueError, match=r"zero\.parquet: cannot read it as parquet \(empty file\)$"):
        load_prompts(str(tmp_path / "zero.parquet"))


def test_integral_float_answers_are_converted(tmp_path):
    path = _write_parquet(
        tmp_path / "f.parquet", [{"Problem": "p1", "Answer": 25.0}, {"Problem": "p2", "Answer": 809.0}]
    )
    assert _answers(load_prompts(path)) == ["25", "809"]


@pytest.mark.parametrize(
    "answers, message",
    [
        (
            [2.0, 0.5],
            r"row 2: column 'Answer': the non-integer number 0.5; store answers as strings",
        ),
        ([[1, 2], [3]], r"column 'Answer': holds list<.*int64>; expected strings"),
        ([True, False], r"column 'Answer': holds bool"),
        (["7", None], r"row 2: column 'Answer': empty \(null\); expected the answer"),
        (["7", "  "], r"row 2: column 'Answer': an empty string; expected the answer"),
    ],
)
def test_bad_answers_are_rejected_with_the_row(tmp_path, answers, message):
    rows = [{"Problem": f"p{i}", "Answer": a} for i, a in enumerate(answers)]
    path = _write_parquet(tmp_path / "bad.parquet", rows)
    with pytest.raises(DataError) as e:
        load_prompts(path)
    header, line = str(e.value).splitlines()
    assert header == f"{path}: 1 problem ({ROWS_NOTE}):"
    assert re.fullmatch(re.escape(path) + ": " + message + ".*", line)


def test_verl_ground_truth_integers_are_converted_and_nulls_rejected(tmp_path):
    ds = load_prompts(_write_parquet(tmp_path / "int.parquet", [_verl("a", 7), _verl("b", 12)]))
    assert _answers(ds) == ["7", "12"]
    assert ds[0]["reward_model"] == {"ground_truth": "7", "style": "rule"}
    with pytest.raises(
        ValueError,
        match=r"null\.parquet: row 2: column 'reward_model.ground_truth': empty \(null\); expected the answer",
    ):
        load_prompts(_write_parquet(tmp_path / "null.parquet", [_verl("a", "7"), _verl("b", None)]))


def test_jsonl_with_mixed_answer_types_names_the_file_and_row(tmp_path):
    path = tmp_path / "mixed.jsonl"
    path.write_text(
        "\n".join(json.dumps({"Problem": f"p{i}", "Answer": a}) for i, a in enumerate([204, "025"]))
    )
    with pytest.raises(DataError) as e:
        load_prompts(str(path))
    header, line = str(e.value).splitlines()
    assert header.startswith(f"{path}: 1 problem (") and "cannot read it as jsonl" in header
    assert line == (
        f"{path}: row 2: column 'Answer': a string, but row 1 holds a number; a column holds one type "
        "(store answers as strings)"
    )


def test_unsupported_file_type(tmp_path):
    path = tmp_path / "aime.csv"
    path.write_text("problem,answer\nq,1\n")
    with pytest.raises(ValueError, match=r"aime\.csv: unsupported file type '\.csv'"):
        load_prompts(str(path))


# Bad rows: the file's own row numbers, every problem --------------------------------------------------


def test_a_bad_row_is_named_by_its_row_in_the_file_before_duplicates_are_dropped(tmp_path):
    # Rows 2 and 4 repeat rows 1 and 3, so dedup keeps rows 1, 3, 5, 6, 7: the bad answer is the file's
    # row 7, the fifth row kept.
    problems = ["p0", "p0", "p1", "p1", "p2", "p3", "p4"]
    answers = [1.0, 1.0, 2.0, 2.0, 3.0, 4.0, 0.5]
    path = _write_parquet(
        tmp_path / "dups.parquet", [{"Problem": p, "Answer": a} for p, a in zip(problems, answers)]
    )
    for spec in (path, f"{path}?dedup=false"):
        with pytest.raises(DataError) as e:
            load_prompts(spec)
        assert e.value.lines == [
            f"{path}: row 7: column 'Answer': the non-integer number 0.5; store answers as strings so "
            "that their exact form is kept"
        ]

    # JSON lines: row N is the N-th record; the line is added where blank lines make it another.
    jsonl = tmp_path / "dups.jsonl"
    records = [json.dumps({"Problem": p, "Answer": "  " if i == 6 else "1"}) for i, p in enumerate(problems)]
    jsonl.write_text("\n".join(records[:3] + [""] + records[3:]) + "\n")
    with pytest.raises(DataError) as e:
        load_prompts(str(jsonl))
    assert e.value.lines == [
        f"{jsonl}: row 7 (line 8): column 'Answer': an empty string; expected the answer"
    ]


def test_answers_of_dropped_duplicates_are_not_checked(tmp_path):
    # Only the kept rows' answers are used, so only theirs are checked (a duplicate's is never read).
    rows = [
        {"Problem": "p0", "Answer": "1"},
        {"Problem": "p0", "Answer": None},
        {"Problem": "p1", "Answer": "2"},
    ]
    path = _write_parquet(tmp_path / "dupnull.parquet", rows)
    assert _answers(load_prompts(path)) == ["1", "2"]
    with pytest.raises(DataError, match=r"row 2: column 'Answer': empty \(null\)"):
        load_prompts(f"{path}?dedup=false")


def test_every_bad_row_is_counted_and_the_first_are_listed(tmp_path):
    rows, expected = [], []  # expected: (file row, column, what) in row order
    for n in range(1, 41):
        problem, answer = f"What is {n} + 1?", str(n + 1)
        if n % 4 == 0:
            problem = None
            expected.append((n, "Problem", "empty (null); expected the problem text"))
        if n % 3 == 0:
            answer = None
            expected.append((n, "Answer", "empty (null); expected the answer"))
        elif n % 5 == 0:
            answer = " "
            expected.append((n, "Answer", "an empty string; expected the answer"))
        rows.append({"Problem": problem, "Answer": answer})
    # Null problems are all one prompt to dedup: check every row's answer here.
    path = _write_parquet(tmp_path / "many.parquet", rows)
    assert len(expected) > MAX_LISTED
    with pytest.raises(DataError) as e:
        load_prompts(f"{path}?dedup=false")
    lines = str(e.value).splitlines()
    assert e.value.total == len(expected)
    assert lines[0] == f"{path}: {len(expected)} problems ({ROWS_NOTE}):"
    assert lines[1:-1] == [f"{path}: row {n}: column {c!r}: {what}" for n, c, what in expected[:MAX_LISTED]]
    assert lines[-1] == f"{path}: and {len(expected) - MAX_LISTED} more (the first {MAX_LISTED} are listed)"


def test_a_directory_names_the_file_and_its_own_row(tmp_path):
    good = [{"Problem": f"a{i}", "Answer": str(i)} for i in range(3)]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in good))
    bad = [
        {"Problem": "b0", "Answer": "0"},
        {"Problem": "b1", "Answer": "1"},
        {"Problem": "b2", "Answer": None},
    ]
    (tmp_path / "b.jsonl").write_text("".join(json.dumps(r) + "\n" for r in bad))
    with pytest.raises(DataError) as e:
        load_prompts(str(tmp_path))
    assert str(e.value).splitlines()[0].startswith(f"{tmp_path}: 1 problem (")
    assert e.value.lines == [
        f"{tmp_path / 'b.jsonl'}: row 3: column 'Answer': empty (null); expected the answer"
    ]


def test_verl_rows_with_null_prompts_messages_and_sources_are_all_listed(tmp_path):
    msg = [{"content": "q", "role": "user"}]
    rows = [
        {"data_source": "x", "prompt": msg, "reward_model": {"ground_truth": "1"}},
        {"data_source": None, "prompt": None, "reward_model": {"ground_truth": "1"}},
        {
            "data_source": "x",
            "prompt": [{"content": None, "role": "user"}],
            "reward_model": {"ground_truth": "2"},
        },
        {
            "data_source": "x",
            "prompt": [{"content": "r", "role": "user"}],
            "reward_model": {"ground_truth": ""},
        },
    ]
    path = _write_parquet(tmp_path / "verl.parquet", rows)
    with pytest.raises(DataError) as e:
        load_prompts(path)
    assert e.value.lines == [
        f"{path}: row 2: column 'prompt': empty (null); expected chat messages (a list of {{role, content}})",
        f"{path}: row 2: column 'data_source': empty (null); expected a string (or data_source= in the spec)",
        f"{path}: row 3: column 'prompt': a message that is null or has no role or content; expected "
        "{role, content}",
        f"{path}: row 4: column 'reward_model.ground_truth': an empty string; expected the answer",
    ]
    # data_source= in the spec replaces the column, so its nulls no longer matter.
    with pytest.raises(DataError) as e:
        load_prompts(f"{path}?data_source=y")
    assert [line.split(": ")[2] for line in e.value.lines] == [
        "column 'prompt'",
        "column 'prompt'",
        "column 'reward_model.ground_truth'",
    ]


def test_jsonl_that_pyarrow_cannot_read_lists_every_bad_record(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text(
        "\n".join(
            [
                json.dumps({"Problem": "p0", "Answer": "1"}),
                '{"Problem": "p1", "Answer": ',  # cut short
                "",
                json.dumps(["p2", "3"]),
                json.dumps({"Problem": "p3", "Answer": 4}),
                json.dumps({"Problem": {"text": "p4"}, "Answer": "5"}),
            ]
        )
        + "\n"
    )
    with pytest.raises(DataError) as e:
        load_prompts(str(path))
    header = str(e.value).splitlines()[0]
    assert header.startswith(f"{path}: 4 problems (") and "JSON files must hold one object per line" in header
    assert e.value.lines == [
        f"{path}: row 2: not valid JSON (Expecting value at character 29); expected one JSON object per line",
        f"{path}: row 3 (line 4): a list; expected one JSON object per line",
        f"{path}: row 4 (line 5): column 'Answer': a number, but row 1 holds a string; a column holds one type "
        "(store answers as strings)",
        f"{path}: row 5 (line 6): column 'Problem': an object, but row 1 holds a string; a column holds one type "
        "(store answers as strings)",
    ]


def _verl_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _row(i: int, **extra) -> dict:
    return {
        "prompt": [{"role": "user", "content": f"q{i}"}],
        "reward_model": {"ground_truth": str(i)},
        **extra,
    }


def test_prompt_key_names_the_message_column_and_a_missing_one_names_the_file(tmp_path):
    rows = [{"messages": r.pop("prompt"), **r} for r in (_row(1), _row(2))]
    path = _verl_jsonl(tmp_path / "chat.jsonl", rows)
    src = load_source(str(path), prompt_key="messages")
    assert src.schema == "verl" and [p[0]["content"] for p in src.dataset["prompt"]] == ["q1", "q2"]
    with pytest.raises(ValueError, match=rf"{path}: no column 'conversation' \(data.prompt_key"):
        load_source(str(path), prompt_key="conversation")
    empty = _verl_jsonl(tmp_path / "empty.jsonl", [rows[0], {**rows[1], "messages": []}])
    with pytest.raises(DataError) as e:  # a problem names the file's own column
        load_source(str(empty), prompt_key="messages")
    assert e.value.lines == [
        f"{empty}: row 2: column 'messages': no messages; expected chat messages (a list of {{role, content}})"
    ]
    both = _verl_jsonl(tmp_path / "both.jsonl", [{**_row(1), "messages": []}])
    with pytest.raises(ValueError, match="data.prompt_key='messages', but the dataset also has a 'prompt'"):
        load_source(str(both), prompt_key="messages")


def test_empty_prompts_lists_as_extra_info_and_bad_tools_name_their_rows(tmp_path):
    rows = [
        _row(1),
        _row(2),
        {**_row(3), "prompt": []},
        _row(4, tools='[{"type": "function"'),  # text that is not JSON
        _row(5, tools='[{"type": "function", "function": {"name": "f"}}]'),
    ]
    path = _verl_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(DataError) as e:
        load_prompts(str(path))
    assert e.value.lines == [
        f"{path}: row 3: column 'prompt': no messages; expected chat messages (a list of {{role, content}})",
        f"{path}: row 4: column 'tools': expected a list of tool schemas (JSON objects), or its JSON text, "
        "or null",
    ]
    listed = _verl_jsonl(tmp_path / "extra.jsonl", [_row(1), _row(2), _row(3, extra_info=[1, 2])])
    with pytest.raises(DataError) as e:
        load_prompts(str(listed))
    assert e.value.lines == [
        f"{listed}: column 'extra_info': holds list<item: int64>; expected an object a row (or null)"
    ]
