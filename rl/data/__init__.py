"""Prompt sources in verl's parquet schema: DAPO-Math-17K, AIME-2024 and a synthetic arithmetic task."""
