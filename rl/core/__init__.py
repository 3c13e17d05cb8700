"""The bottom layer: what the driver, the rollout workers and the trainer ranks share.

The sample contract (`batch`), the loss math (`algo`), version shims (`compat`), worker log capture
(`worker_logs`), the adapter's file format (`adapter_files`), model facts read from a checkpoint's config
(`model_info`), the cache and shipped-file locations (`paths`) and waiting on Ray for resources
(`resource_wait`). Modules here import nothing from the rest of `rl` (the CLI, the driver, its setup, the
planner, sweeps, submission); rollout/ and trainer/ import from `rl` only this package and `rl.models`.
tests/unit/test_layers.py holds every module to that.
"""
