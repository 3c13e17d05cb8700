"""Prompt sources in verl's parquet schema: DAPO-Math-17K, AIME-2024 and a synthetic arithmetic task.

`rl.data.sources.load_prompts(spec)` loads any of them (a hub id, a parquet/JSONL file or directory, or
`synthetic:arith?n=...`) as a `datasets.Dataset`; `rl.data.arith` generates the synthetic task and
`rl.data.prompts` holds the DAPO instruction; `rl.data.problems` reports a source's bad rows (every one, by
the file's own row number). Nothing is imported here, so that `rl.data.arith` stays
light (no `datasets`, no pyarrow).
"""
