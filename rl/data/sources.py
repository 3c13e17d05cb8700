"""Load prompt sets into verl's schema: a hub id, a parquet/JSONL file, a directory, or the synthetic task.

One entry, `load_prompts(spec, **options)`, returns a `datasets.Dataset` whose rows are

    data_source: str, prompt: [{"role", "content"}, ...], ability: str,
    reward_model: {"style", "ground_truth": str (any JSON value for rows a function of your own scores)},
    extra_info: {...}

Spec format: `SOURCE[?key=value&key=value...]`; keyword arguments override the query.

    BytedTsinghua-SIA/DAPO-Math-17k        hub id (owner/name; `hf:` forces the hub over a local path)
    data/aime-2024.parquet                 a local .parquet, .jsonl or .json (JSON lines) file
    data/aime/                             a directory: all its .parquet files (recursively), else .jsonl/.json
    synthetic:arith?n=256&seed=0           the embedded arithmetic task (rl.data.arith), no network

Options (all sources): `data_source` (override the column), `dedup` (true/false), `limit` (keep the
first N rows after dedup). Files and hub: `problem_key`, `answer_key` (raw-schema column names).
Hub only: `split` (default train), `config`. Synthetic: `n` (256), `seed` (0), `split` (train),
`num_terms`, `max_operand`, `ops` (ArithSpec knobs).

Schemas, detected from the columns: verl (`prompt` chat messages + `reward_model.ground_truth`;
DAPO-Math-17k, BytedTsinghua-SIA/AIME-2024), HuggingFaceH4/aime_2024 (`problem`, `answer`, `id`, ...) and
Maxwell-Jia/AIME_2024 (`Problem`, `Answer` as int64, `ID`, ...). Raw problems get the DAPO instruction
(rl.data.prompts). Rows are deduplicated by prompt, keeping the first (DAPO-Math-17k's 1.79M rows hold
17,398 prompts; BytedTsinghua's AIME-2024 repeats its 30 problems 32 times); synthetic rows are not,
unless `dedup=true`, so that `n` is the number of rows. Raw rows without a `data_source` get the hub id,
else the file's stem (the directory's name).

Bad cells (a null prompt or answer, a non-integer number or an empty string as the answer, a column of the
wrong type) are all reported in one `rl.data.problems.DataError`, each with the file's own row number
(counted from 1 before dedup) and the column; so is every record of a JSON lines file that pyarrow cannot
read. Answers are checked in the rows that are kept (after dedup and `limit`), prompts in all rows.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pa_json
import pyarrow.parquet as pq
from datasets.table import InMemoryTable

from rl.data import arith
from rl.data.loader import tool_schemas
from rl.data.problems import Part, Problems, RowNames, json_lines_problems
from rl.data.prompts import dapo_prompt

log = logging.getLogger(__name__)

SYNTHETIC_PREFIX = "synthetic:"
HUB_PREFIX = "hf:"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_FILE_SUFFIXES = (".parquet", ".jsonl", ".json")

# Raw (problem, answer) schemas, tried in order: HuggingFaceH4/aime_2024, then Maxwell-Jia/AIME_2024.
_RAW_SCHEMAS = (("problem", "answer", "id"), ("Problem", "Answer", "ID"))

_COMMON_OPTIONS = {"data_source": str, "dedup": bool, "limit": int}
_FILE_OPTIONS = {**_COMMON_OPTIONS, "problem_key": str, "answer_key": str}
_HUB_OPTIONS = {**_FILE_OPTIONS, "split": str, "config": str}
_SYNTHETIC_OPTIONS = {
    **_COMMON_OPTIONS,
    "n": int,
    "seed": int,
    "split": str,
    "num_terms": int,
    "max_operand": int,
    "ops": str,
}
SYNTHETIC_TASKS = ("arith",)


@dataclass
class PromptSource:
    """A loaded prompt set and where it came from."""

    dataset: datasets.Dataset
    origin: str  # the file, directory or hub id (with split) the rows came from
    schema: str  # "verl", "raw" or "synthetic"
    num_raw_rows: int  # rows before dedup and limit
    num_duplicates: int  # rows dropped by dedup


def load_prompts(spec: str, **options: Any) -> datasets.Dataset:
    """The prompt set `spec` names, in verl's schema (see the module docstring for the spec format)."""
    return load_source(spec, **options).dataset


def load_source(
    spec: str, text_answers: bool | Callable[[str], bool] = True, prompt_key: str = "prompt", **options: Any
) -> PromptSource:
    """Like `load_prompts`, plus the origin, the detected schema and the dedup count.

    prompt_key (data.prompt_key): the column of a file's or hub dataset's chat messages, read as the verl
    schema's `prompt` (a synthetic task makes its own).

    text_answers: whether the rows of a data source need `reward_model.ground_truth` as text (the math
    checkers do): True for every row, or a function of the row's data_source. Those rows' answers are
    checked and made stripped strings (numbers converted); the others keep the value the row holds, of any
    type, null included (a function of the user's own scores them), unless a text row shares a column of
    numbers with them, which then becomes text for all."""
    location, query = parse_spec(spec)
    if location.startswith(SYNTHETIC_PREFIX):
        opts = _typed_options(spec, {**query, **options}, _SYNTHETIC_OPTIONS)
        return _load_synthetic(location[len(SYNTHETIC_PREFIX) :], opts, spec)

    hub_id = hub_dataset(location)
    path = Path(location).expanduser()
    if hub_id is None and path.exists():
        opts = _typed_options(spec, {**query, **options}, _FILE_OPTIONS)
        table, origin, rows = _read_local(path)
        default_source = path.name if path.is_dir() else path.stem
    elif hub_id is not None:
        opts = _typed_options(spec, {**query, **options}, _HUB_OPTIONS)
        table, origin = _read_hub(hub_id, opts.get("split", "train"), opts.get("config"))
        rows = RowNames([Part(origin, 0)])
        default_source = hub_id
    else:
        raise FileNotFoundError(
            f"prompt source {spec!r}: no such file or directory, and {location!r} is not a hub id (owner/name)"
        )
    table = _prompt_column(table, origin, prompt_key)
    return _to_verl(table, origin, default_source, opts, rows, text_answers, prompt_key)


def _prompt_column(table: pa.Table, origin: str, prompt_key: str) -> pa.Table:
    """The table with its `prompt_key` column named `prompt`, the verl schema's name."""
    columns = table.column_names
    if prompt_key == "prompt":
        return table
    if prompt_key not in columns:
        raise ValueError(
            f"{origin}: no column {prompt_key!r} (data.prompt_key: the chat messages); the columns are {columns}"
        )
    if "prompt" in columns:
        raise ValueError(
            f"{origin}: data.prompt_key={prompt_key!r}, but the dataset also has a 'prompt' column; drop or "
            "rename one of them"
        )
    return table.rename_columns(["prompt" if c == prompt_key else c for c in columns])


def hub_dataset(location: str) -> str | None:
    """The hub dataset id a spec's source names (`hf:ID`, or `owner/name` that is no local path), else None."""
    if location.startswith(HUB_PREFIX):
        return location[len(HUB_PREFIX) :]
    if location.startswith(SYNTHETIC_PREFIX) or Path(location).expanduser().exists():
        return None
    return location if _HUB_ID.match(location) else None


def parse_spec(spec: str) -> tuple[str, dict[str, str]]:
    """Split `SOURCE?key=value&...` into the source and its options (strings; no URL decoding)."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"prompt source spec must be a non-empty string, got {spec!r}")
    location, _, query = spec.strip().partition("?")
    options: dict[str, str] = {}
    for item in filter(None, query.split("&")):
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ValueError(f"prompt source {spec!r}: option {item!r} is not of the form key=value")
        if key in options:
            raise ValueError(f"prompt source {spec!r}: option {key!r} is given twice")
        options[key] = value
    return location, options


def _typed_options(spec: str, raw: dict[str, Any], allowed: dict[str, type]) -> dict[str, Any]:
    out = {}
    for key, value in raw.items():
        if key not in allowed:
            raise ValueError(
                f"prompt source {spec!r}: unknown option {key!r}; this kind of source takes {sorted(allowed)}"
            )
        kind = allowed[key]
        if isinstance(value, str) and kind is bool:
            if value.lower() not in ("true", "false", "1", "0"):
                raise ValueError(f"prompt source {spec!r}: option {key}={value!r} must be true or false")
            value = value.lower() in ("true", "1")
        elif isinstance(value, str) and kind is int:
            try:
                value = int(value)
            except ValueError:
                raise ValueError(
                    f"prompt source {spec!r}: option {key}={value!r} must be an integer"
                ) from None
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ValueError(
                f"prompt source {spec!r}: option {key}={value!r} must be {kind.__name__}, got {type(value).__name__}"
            )
        out[key] = value
    if "limit" in out and out["limit"] <= 0:
        raise ValueError(f"prompt source {spec!r}: option limit must be positive, got {out['limit']}")
    return out


# Reading ---------------------------------------------------------------------------------------------


def _read_file(path: Path) -> pa.Table:
    try:
        if path.suffix == ".parquet":
            return pq.read_table(path)
        if path.suffix in (".jsonl", ".json"):
            return pa_json.read_json(path)
    except pa.ArrowInvalid as e:
        if path.suffix == ".parquet":
            raise ValueError(
                f"{path}: cannot read it as parquet ({'empty file' if not path.stat().st_size else e})"
            ) from e
        if not path.read_text().strip():
            raise ValueError(f"{path}: the file is empty (expected one JSON object per line)") from e
        hint = "JSON files must hold one object per line, each column one type; store answers as strings"
        problems = Problems(str(path), RowNames.of_file(path))
        json_lines_problems(path, problems)
        problems.raise_if_any(f"cannot read it as {path.suffix[1:]}: {hint}")
        raise ValueError(f"{path}: cannot read it as {path.suffix[1:]}: {e} ({hint})") from e
    raise ValueError(f"{path}: unsupported file type {path.suffix!r}; expected one of {list(_FILE_SUFFIXES)}")


def _read_local(path: Path) -> tuple[pa.Table, str, RowNames]:
    """The table of a file or directory, its origin, and the files its rows came from."""
    if path.is_file():
        return _read_file(path), str(path), RowNames.of_file(path)
    # Hidden entries (.cache/ of a hub snapshot, editor files) are not data.
    visible = [
        f
        for f in path.rglob("*")
        if f.is_file() and not any(p.startswith(".") for p in f.relative_to(path).parts)
    ]
    files = sorted(f for f in visible if f.suffix == ".parquet")
    if not files:
        files = sorted(f for f in visible if f.suffix in (".jsonl", ".json"))
    if not files:
        raise FileNotFoundError(f"{path}: directory holds no {', '.join(_FILE_SUFFIXES)} files")
    tables = [_read_file(f) for f in files]
    starts = np.cumsum([0] + [t.num_rows for t in tables[:-1]])
    rows = RowNames(
        [Part(str(f), int(s), f if f.suffix != ".parquet" else None) for f, s in zip(files, starts)]
    )
    for f, t in zip(files[1:], tables[1:]):
        if set(t.column_names) != set(tables[0].column_names):
            raise ValueError(
                f"{path}: its files hold different columns: {files[0]} has {tables[0].column_names}, "
                f"{f} has {t.column_names}"
            )
    try:
        table = pa.concat_tables(tables, promote_options="permissive")
    except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
        raise ValueError(f"{path}: its files {[str(f) for f in files]} have incompatible columns: {e}") from e
    return table, str(path), rows


def _read_hub(hub_id: str, split: str, config: str | None) -> tuple[pa.Table, str]:
    ds = datasets.load_dataset(hub_id, config, split=split)
    if ds._indices is not None:
        ds = ds.flatten_indices()
    return ds.data.table, f"{hub_id} (split {split})"


# Schema mapping --------------------------------------------------------------------------------------


def _to_verl(
    table: pa.Table,
    origin: str,
    default_source: str,
    opts: dict[str, Any],
    rows: RowNames,
    text_answers: bool | Callable[[str], bool] = True,
    prompt_name: str = "prompt",
) -> PromptSource:
    """The table in verl's schema. prompt_name: what the problems call the `prompt` column (the file's own
    name for it: data.prompt_key)."""
    if table.num_rows == 0:
        raise ValueError(f"{origin}: the dataset is empty (no rows)")
    columns = table.column_names
    problems = Problems(origin, rows)
    explicit_raw = "problem_key" in opts or "answer_key" in opts
    if not explicit_raw and ("prompt" in columns or "reward_model" in columns):
        schema, key_column = "verl", "prompt"
        _check_verl_columns(table, origin, prompt_name)
        _check_messages(table["prompt"], problems, prompt_name)
        dedup_ok = True
    else:
        schema = "raw"
        problem_key, answer_key, id_key = _raw_columns(columns, opts, origin)
        key_column = problem_key
        dedup_ok = _check_problem_column(table[problem_key], problem_key, problems)

    # `kept`: the table rows (the file's, before dedup) that stay, in order; the checks below run on the kept
    # rows and name them by these numbers, never by their position after dedup.
    num_raw = table.num_rows
    kept = np.arange(num_raw, dtype=np.int64)
    if opts.get("dedup", True) and dedup_ok:
        kept = _first_occurrences(table[key_column])
    duplicates = num_raw - len(kept)
    if "limit" in opts:
        kept = kept[: opts["limit"]]
    if len(kept) < num_raw:
        table = table.take(pa.array(kept))

    if schema == "verl":
        table = _normalise_verl(table, problems, kept, opts.get("data_source"), default_source, text_answers)
    else:
        table = _raw_to_verl(
            table, problem_key, answer_key, id_key, problems, kept, opts.get("data_source") or default_source
        )
    if duplicates:
        log.info(
            "%s: dropped %d duplicate prompts, kept %d of %d rows",
            origin,
            duplicates,
            table.num_rows,
            num_raw,
        )
    return PromptSource(datasets.Dataset(InMemoryTable(table)), origin, schema, num_raw, duplicates)


def _raw_columns(columns: list[str], opts: dict[str, Any], origin: str) -> tuple[str, str, str | None]:
    if "problem_key" in opts or "answer_key" in opts:
        problem_key, answer_key = opts.get("problem_key", "problem"), opts.get("answer_key", "answer")
        id_key = next((c for c in ("id", "ID") if c in columns), None)
    else:
        match = next((s for s in _RAW_SCHEMAS if s[0] in columns or s[1] in columns), _RAW_SCHEMAS[0])
        problem_key, answer_key, id_key = match
        id_key = id_key if id_key in columns else None
    for role, key in (("prompt", problem_key), ("answer", answer_key)):
        if key not in columns:
            raise ValueError(
                f"{origin}: no {role} column {key!r}. Expected the verl schema ('prompt' chat messages and "
                f"'reward_model.ground_truth'), HuggingFaceH4/aime_2024 ('problem', 'answer'), Maxwell-Jia/AIME_2024 "
                f"('Problem', 'Answer'), or problem_key=/answer_key= options; the columns are {columns}"
            )
    return problem_key, answer_key, id_key


def _check_verl_columns(table: pa.Table, origin: str, name: str = "prompt") -> None:
    """The verl schema's columns and their types: without them no row can be read, so these raise at once.
    name: the file's name for the `prompt` column, as the messages say it."""
    columns = table.column_names
    if "prompt" not in columns:
        raise ValueError(
            f"{origin}: no prompt column {name!r} (chat messages), which the verl schema needs next to "
            f"'reward_model'; the columns are {columns}"
        )
    if "reward_model" not in columns:
        raise ValueError(
            f"{origin}: no answer column 'reward_model' (a struct with 'ground_truth'), which the verl schema "
            f"needs next to {name!r}; the columns are {columns}"
        )
    rm_type = table.schema.field("reward_model").type
    if not pa.types.is_struct(rm_type) or rm_type.get_field_index("ground_truth") < 0:
        raise ValueError(
            f"{origin}: column 'reward_model' must be a struct with a 'ground_truth' field, got {rm_type}"
        )
    prompt_type = table.schema.field("prompt").type
    item = (
        prompt_type.value_type
        if pa.types.is_list(prompt_type) or pa.types.is_large_list(prompt_type)
        else None
    )
    if item is None or not pa.types.is_struct(item) or {"role", "content"} - {f.name for f in item}:
        raise ValueError(
            f"{origin}: column {name!r} must hold chat messages (a list of {{role, content}}), got {prompt_type}; "
            "raw problem text belongs in a 'problem' column"
        )


def _check_messages(col: pa.ChunkedArray, problems: Problems, name: str = "prompt") -> None:
    """Rows whose prompt is null, empty, or holds a message that is null or has no role or content; `name`:
    the file's name for the column, as the problems say it."""
    _check_nulls(col, np.arange(len(col)), name, problems, "chat messages (a list of {role, content})")
    bad_rows, start = [], 0
    for chunk in col.chunks:
        messages = _messages(chunk)
        bad = pc.or_(
            pc.is_null(messages),
            pc.or_(
                pc.is_null(pc.struct_field(messages, "role")),
                pc.is_null(pc.struct_field(messages, "content")),
            ),
        )
        parents = pc.list_parent_indices(chunk).to_numpy()  # one a message, as _messages gives them
        rows = np.unique(parents[bad.to_numpy(zero_copy_only=False)])
        rows = rows[
            ~chunk.is_null().to_numpy(zero_copy_only=False)[rows]
        ]  # a null prompt is reported as such
        bad_rows.append(rows + start)
        start += len(chunk)
    rows = np.concatenate(bad_rows) if bad_rows else np.array([], dtype=np.int64)
    if len(rows):
        problems.cells(
            rows, name, "a message that is null or has no role or content; expected {role, content}"
        )
    lengths = pc.list_value_length(col).to_numpy(zero_copy_only=False)  # nan where null (reported above)
    empty = np.flatnonzero(lengths == 0)
    if len(empty):
        problems.cells(empty, name, "no messages; expected chat messages (a list of {role, content})")


def _check_problem_column(col: pa.ChunkedArray, column: str, problems: Problems) -> bool:
    """Raw problem text: strings without nulls. False when the column's type rules out deduplicating by it."""
    if not _is_str(col.type):
        problems.column(column, f"holds {col.type}; expected the problem text as strings")
        return False
    _check_nulls(col, np.arange(len(col)), column, problems, "the problem text")
    return True


def _is_str(kind: pa.DataType) -> bool:
    return pa.types.is_string(kind) or pa.types.is_large_string(kind)


def _check_nulls(
    col: pa.ChunkedArray, rows: np.ndarray, column: str, problems: Problems, expected: str
) -> None:
    """Null cells of `col`, whose i-th value is table row `rows[i]`."""
    if col.null_count:
        nulls = np.flatnonzero(pc.is_null(col).to_numpy(zero_copy_only=False))
        problems.cells(rows[nulls], column, f"empty (null); expected {expected}")


def _messages(chunk: pa.Array) -> pa.Array:
    """Every message a chunk of prompts spans, null rows' included, so that they line up with its offsets
    and `list_parent_indices` (`flatten()` leaves out what a null row's offsets span, where they span any)."""
    first, last = chunk.offsets[0].as_py(), chunk.offsets[-1].as_py()
    return chunk.values.slice(first, last - first)


def _prompt_keys(col: pa.ChunkedArray) -> pa.ChunkedArray:
    """One string per row that is equal exactly when the prompts are: role and content of every message."""
    if _is_str(col.type):
        return col
    chunks = []
    for chunk in col.chunks:
        messages = _messages(chunk)
        per_message = pc.binary_join_element_wise(
            pc.struct_field(messages, "role"), pc.struct_field(messages, "content"), "\x1f"
        )
        offsets = pc.subtract(chunk.offsets, chunk.offsets[0])
        lists = type(chunk).from_arrays(offsets, per_message)
        chunks.append(pc.binary_join(lists, "\x1e"))
    return pa.chunked_array(chunks, type=chunks[0].type if chunks else pa.string())


def _first_occurrences(col: pa.ChunkedArray) -> np.ndarray:
    """Sorted row indices of the first row of every distinct prompt (a hash group-by, no Python loop). Null
    prompts group together; the checks before have reported them."""
    keys = _prompt_keys(col)
    indexed = pa.table({"key": keys, "row": pa.array(np.arange(len(keys), dtype=np.int64))})
    first = indexed.group_by("key", use_threads=False).aggregate([("row", "min")])["row_min"]
    return np.sort(first.to_numpy())


def _answers_as_strings(
    col: pa.ChunkedArray, column: str, rows: np.ndarray, problems: Problems
) -> pa.ChunkedArray | None:
    """Answers as stripped strings; integers (and integral floats) are converted. Every null, non-integer
    number and empty string goes to `problems` (the i-th value is table row `rows[i]`), so the result is only
    good once `problems` is empty; None where the column cannot be converted at all."""
    _check_nulls(col, rows, column, problems, "the answer")
    kind = col.type
    if _is_str(kind):
        out = col
    elif pa.types.is_integer(kind):
        out = pc.cast(col, pa.string())
    elif pa.types.is_floating(kind):
        integral = pc.and_(pc.is_finite(col), pc.equal(pc.floor(col), col))
        bad = np.flatnonzero(~pc.fill_null(integral, True).to_numpy(zero_copy_only=False))
        if len(bad):
            problems.cells(
                rows[bad],
                column,
                lambda k: (
                    f"the non-integer number {col[int(bad[k])].as_py()!r}; store answers as strings so "
                    "that their exact form is kept"
                ),
            )
            return None
        out = pc.cast(pc.cast(col, pa.int64()), pa.string())
    else:
        problems.column(column, f"holds {kind}; expected strings (integers are converted)")
        return None
    out = pc.utf8_trim_whitespace(out)
    empty = np.flatnonzero(
        pc.fill_null(pc.equal(pc.utf8_length(out), 0), False).to_numpy(zero_copy_only=False)
    )
    if len(empty):
        problems.cells(rows[empty], column, "an empty string; expected the answer")
    return out.cast(pa.string())


def _text_rows(
    table: pa.Table, data_source: str | None, default_source: str, text_answers: bool | Callable[[str], bool]
) -> np.ndarray:
    """Which rows need their answer as text: `text_answers` of each row's data source (as it will be after
    `data_source=` or the default fills it in)."""
    n = table.num_rows
    if isinstance(text_answers, bool):
        return np.full(n, text_answers)
    if data_source is not None or "data_source" not in table.column_names:
        return np.full(n, bool(text_answers(data_source or default_source)))
    column = table["data_source"]
    if not _is_str(column.type):
        return np.full(n, True)  # reported as a problem of the column; the answers are checked as text
    values = column.to_pylist()
    wanted = {v: bool(text_answers(v)) for v in set(values) if v is not None}
    return np.array([wanted.get(v, True) for v in values], dtype=bool)


def _ground_truth(
    col: pa.ChunkedArray, text: np.ndarray, rows: np.ndarray, problems: Problems
) -> pa.Array | None:
    """reward_model.ground_truth with the rows in `text` made (checked) text; the others as they are."""
    if text.all():
        return _answers_as_strings(col, "reward_model.ground_truth", rows, problems)
    if not text.any():
        return col.combine_chunks()
    sub = pc.filter(col, pa.array(text))
    converted = _answers_as_strings(sub, "reward_model.ground_truth", rows[text], problems)
    if converted is None:
        return None
    if _is_str(col.type):
        trimmed = pc.utf8_trim_whitespace(col)
        return pc.if_else(pa.array(text), trimmed, col).combine_chunks().cast(pa.string())
    # A column of numbers shared with text rows: text for all (the column holds one type).
    return pc.cast(col, pa.string()).combine_chunks()


def _normalise_verl(
    table: pa.Table,
    problems: Problems,
    rows: np.ndarray,
    data_source: str | None,
    default_source: str,
    text_answers: bool | Callable[[str], bool] = True,
) -> pa.Table:
    reward_model = table["reward_model"].combine_chunks()
    text = _text_rows(table, data_source, default_source, text_answers)
    ground_truth = _ground_truth(
        pa.chunked_array([pc.struct_field(reward_model, "ground_truth")]), text, rows, problems
    )
    if data_source is None and "data_source" in table.column_names:
        if not _is_str(table["data_source"].type):
            problems.column(
                "data_source",
                f"holds {table['data_source'].type}; expected strings (or data_source= in the spec)",
            )
        else:
            _check_nulls(
                table["data_source"], rows, "data_source", problems, "a string (or data_source= in the spec)"
            )
    if "extra_info" in table.column_names:
        t = table["extra_info"].type
        if not (pa.types.is_struct(t) or pa.types.is_map(t) or pa.types.is_null(t)):
            problems.column("extra_info", f"holds {t}; expected an object a row (or null)")
    if "tools" in table.column_names:
        bad = []
        for i, cell in enumerate(table["tools"].to_pylist()):
            try:
                tool_schemas(cell, "")
            except ValueError:
                bad.append(i)
        if bad:
            problems.cells(
                rows[bad],
                "tools",
                "expected a list of tool schemas (JSON objects), or its JSON text, or null",
            )
    problems.raise_if_any()
    if isinstance(ground_truth, pa.ChunkedArray):
        ground_truth = ground_truth.combine_chunks()
    names = [f.name for f in reward_model.type]
    fields = [ground_truth if n == "ground_truth" else pc.struct_field(reward_model, n) for n in names]
    if "style" not in names:
        names, fields = names + ["style"], fields + [pa.array(["rule"] * len(reward_model))]
    table = table.set_column(
        table.column_names.index("reward_model"), "reward_model", pa.StructArray.from_arrays(fields, names)
    )
    if data_source is not None or "data_source" not in table.column_names:
        column = pa.array([data_source or default_source] * table.num_rows, pa.string())
        if "data_source" in table.column_names:
            table = table.set_column(table.column_names.index("data_source"), "data_source", column)
        else:
            table = table.add_column(0, "data_source", column)
    if "ability" not in table.column_names:
        table = table.append_column("ability", pa.array(["math"] * table.num_rows))
    return table


def _raw_to_verl(
    table: pa.Table,
    problem_key: str,
    answer_key: str,
    id_key: str | None,
    problems: Problems,
    rows: np.ndarray,
    data_source: str,
) -> pa.Table:
    answers = _answers_as_strings(table[answer_key], answer_key, rows, problems)
    problems.raise_if_any()
    answers = answers.to_pylist()
    texts = table[problem_key].to_pylist()
    ids = table[id_key].to_pylist() if id_key else list(range(len(texts)))
    out = {
        "data_source": [data_source] * len(texts),
        # Field order as in DAPO-Math-17k's parquet, so that the two concatenate.
        "prompt": [[{"content": dapo_prompt(p), "role": "user"}] for p in texts],
        "ability": ["math"] * len(texts),
        "reward_model": [{"ground_truth": a, "style": "rule"} for a in answers],
        "extra_info": [{"index": i, "id": str(x)} for i, x in enumerate(ids)],
    }
    return pa.table(out)


# Synthetic -------------------------------------------------------------------------------------------


def _load_synthetic(task: str, opts: dict[str, Any], spec: str) -> PromptSource:
    if task not in SYNTHETIC_TASKS:
        raise ValueError(
            f"prompt source {spec!r}: unknown synthetic task {task!r}; known: {list(SYNTHETIC_TASKS)}"
        )
    knobs = {k: opts[k] for k in ("num_terms", "max_operand", "ops") if k in opts}
    rows = arith.make_rows(
        opts.get("n", 256), opts.get("seed", 0), arith.ArithSpec(**knobs), opts.get("split", "train")
    )
    table = pa.Table.from_pylist(rows)
    if "data_source" in opts:
        table = table.set_column(0, "data_source", pa.array([opts["data_source"]] * table.num_rows))
    num_raw = table.num_rows
    if opts.get("dedup", False):
        table = table.take(pa.array(_first_occurrences(table["prompt"])))
    duplicates = num_raw - table.num_rows
    if "limit" in opts:
        table = table.slice(0, opts["limit"])
    return PromptSource(datasets.Dataset(InMemoryTable(table)), spec, "synthetic", num_raw, duplicates)
