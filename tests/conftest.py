"""Shared test setup: markers, offline environment, the tiny models (built once, cached by content hash)."""

from __future__ import annotations

import os

import pytest

# No hub access anywhere in the tests; small KV cache for vLLM on CPU.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# Ray's auth mode by name. Left unset, the first local ray.init() turns token auth on for this process and
# everything it starts from then on (and writes ~/.ray/auth_token, after which `ray start` wants tokens
# too): each test would see a mode set by whichever test ran before it. Tests of token auth set their own.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# OpenMP threads that wait sleep instead of spinning. `make test` runs two files at a time on two cores, each
# with its own engine, trainer ranks and torch threads: spinning threads took the cores from the other file.
# Measured on the 2-core machine: the benchmark tests' engine and trainer start took 228 s beside the tiny
# model's supervised warm-up, 76 s with passive waits (50 s alone), and the warm-up itself 207 s and 197 s.
# Set before torch is imported (libgomp reads it once) and inherited by Ray's workers and vLLM's processes.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def pytest_collection_modifyitems(config, items):
    # Files with a slow test first (each file's tests in their own order): `make test` runs two files at a
    # time (pytest-xdist, --dist loadfile, in this order), and a file of minutes that starts last ends the
    # run alone.
    slow_files = {item.nodeid.split("::")[0] for item in items if "slow" in item.keywords}
    items.sort(key=lambda item: item.nodeid.split("::")[0] not in slow_files)
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs CUDA: run on the GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module", autouse=True)
def _environment_of_the_session():
    """Each test file ends with the environment variables it started with. Building a vLLM engine config
    sets about a dozen in the process that builds it (LD_PRELOAD of torch's libgomp, LD_LIBRARY_PATH,
    VLLM_WORKER_MULTIPROC_METHOD, ...), and every process started afterwards inherits them: without this, a
    later file's Ray cluster, and so its trainer ranks, would run with torch's libgomp preloaded or not
    depending on which file the same xdist worker ran before it."""
    before = dict(os.environ)
    yield
    for key in [k for k in os.environ if k not in before]:
        del os.environ[key]
    for key, value in before.items():
        if os.environ.get(key) != value:
            os.environ[key] = value


@pytest.fixture(scope="session")
def tiny_moe_path():
    from rl.tiny import make_tiny

    return make_tiny("qwen3_moe")


@pytest.fixture(scope="session")
def tiny_dense_path():
    from rl.tiny import make_tiny

    return make_tiny("dense")


@pytest.fixture(scope="session")
def tiny_moe_sft_path():
    from rl.tiny import make_tiny

    return make_tiny("qwen3_moe", sft="arith")
