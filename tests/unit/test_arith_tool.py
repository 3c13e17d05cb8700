"""The tool-use demo's pieces without a model: the safe calculator, the tool's messages, the warm-up's
transcripts and their tokenization (rl.data.arith_tool, rl.tiny_tool_sft), and the example environment
(recipes/examples/calculator_env.py)."""

from __future__ import annotations

import importlib.util
import random
from collections import Counter
from pathlib import Path

import pytest

from rl.data import arith_tool
from rl.data.prompts import dapo_prompt
from rollout.env import EnvStep, ToolCall, parse_json_tool_calls

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "text, value",
    [
        ("41 - 15 + 84", 110),
        ("2 + 3 * 4", 14),
        ("(2 + 3) * 4", 20),
        ("-7 - -3", -4),
        ("+5", 5),
        (" 99 ", 99),
        ("12 * 0 - 1", -1),
    ],
)
def test_calculate_integer_arithmetic(text, value):
    assert arith_tool.calculate(text) == value


@pytest.mark.parametrize(
    "text",
    [
        "__import__('os').system('true')",  # a call: never run
        "x + 1",  # a name
        "(1).real",  # an attribute
        "2 ** 100",  # a power (unbounded size)
        "7 / 2",  # division
        "7 // 2",
        "1.5 + 1",  # a float
        "True + 1",  # a bool is an int to Python, not to the calculator
        "'a' * 3",
        "[1, 2]",
        "1 +",  # not an expression
        "",
        "1" + " + 1" * 40,  # longer than MAX_EXPRESSION_CHARS
    ],
)
def test_calculate_refuses_anything_else(text):
    with pytest.raises(ValueError):
        arith_tool.calculate(text)


def test_calculate_refuses_a_non_string():
    with pytest.raises(ValueError, match="string"):
        arith_tool.calculate(12)


def test_tool_result_answers_a_call_or_says_what_is_wrong():
    assert arith_tool.tool_result("calc", {"expr": "41 - 15 + 84"}) == "110"
    assert arith_tool.tool_result("search", {"expr": "1 + 1"}) == arith_tool.BAD_CALL
    assert arith_tool.tool_result("calc", {"expr": "1", "x": 2}) == arith_tool.BAD_CALL
    assert arith_tool.tool_result("calc", {"expr": "os.getcwd()"}).startswith("error: ")


def test_tool_call_text_is_what_the_rollout_parser_reads():
    calls, bad = parse_json_tool_calls(arith_tool.tool_call("41 - 15 + 84"))
    assert (calls, bad) == ([ToolCall("calc", {"expr": "41 - 15 + 84"})], 0)


def test_tool_rows_ask_for_the_expression_and_hold_its_value():
    rows = arith_tool.make_tool_rows(200, 0, split="train")
    assert rows == arith_tool.make_tool_rows(200, 0, split="train")
    test = {r["extra_info"]["expression"] for r in arith_tool.make_tool_rows(200, 0, split="test")}
    assert len(test & {r["extra_info"]["expression"] for r in rows}) < 5  # other streams
    for row in rows:
        expression = row["extra_info"]["expression"]
        assert row["prompt"] == [{"role": "user", "content": dapo_prompt(f"What is {expression}?")}]
        assert row["data_source"] == "calculator" and len(expression.split(" ")) == 5
        assert int(row["reward_model"]["ground_truth"]) == arith_tool.calculate(expression)


def test_transcripts_kinds_shares_and_outcomes():
    rows = arith_tool.make_tool_rows(4000, 0, split="sft")
    rng = random.Random(0)
    kinds = Counter()
    for row in rows:
        kind, messages = arith_tool.transcript(row, rng)
        kinds[kind] += 1
        assistant = [m["content"] for m in messages if m["role"] == "assistant"]
        tools = [m["content"] for m in messages if m["role"] == "tool"]
        right = arith_tool.answer_of(assistant[-1]) == int(row["reward_model"]["ground_truth"])
        assert right == (kind in ("clean", "malformed")), (kind, messages)
        assert [m["role"] for m in messages][-1] == "assistant"
        for turn, result in zip(assistant, tools):  # each tool message is the tool's answer to that turn
            calls, bad = parse_json_tool_calls(turn)
            want = arith_tool.tool_result(calls[0].name, calls[0].arguments) if calls else arith_tool.BAD_CALL
            assert result == want and bad == (0 if calls else 1)
        turns = {"guess": 1, "malformed": 3}.get(kind, 2)
        assert len(assistant) == turns, (kind, messages)
    for kind, share in arith_tool.NOISE.items():
        assert abs(kinds[kind] / len(rows) - share) < 0.03, (kind, kinds)
    assert abs(kinds["clean"] / len(rows) - (1 - sum(arith_tool.NOISE.values()))) < 0.03


def test_warmup_tokens_are_the_episode_tokens_and_only_the_assistant_is_labelled():
    from rl.tiny import train_tokenizer
    from rl.tiny_tool_sft import encode

    tok = train_tokenizer(seed=0)
    call = arith_tool.tool_call("41 - 15 + 84")
    assert tok.decode(tok.encode(call)) == call  # byte-level BPE: the call and its JSON round-trip
    row = arith_tool.make_tool_rows(1, 0, split="sft")[0]
    _, messages = arith_tool.transcript(row, random.Random(1), noise={"malformed": 1.0})
    ids, labels = encode(tok, row, messages)
    assert len(ids) == len(labels)
    # the whole transcript as the chat template renders it (which ends each turn with "\n")
    assert tok.decode(ids) + "\n" == tok.apply_chat_template(row["prompt"] + messages, tokenize=False)
    labelled = [i for i, lab in zip(ids, labels) if lab != -100]
    assert [i for i, lab in zip(ids, labels) if lab != -100] == [lab for lab in labels if lab != -100]
    want = [
        t for m in messages if m["role"] == "assistant" for t in tok.encode(m["content"]) + [tok.eos_token_id]
    ]
    assert labelled == want


def _env_module():
    spec = importlib.util.spec_from_file_location(
        "calculator_env", ROOT / "recipes/examples/calculator_env.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_calculator_env_answers_calls_and_scores_the_final_answer():
    env = _env_module().Calculator(
        {"ground_truth": "110", "data_source": "calculator", "extra_info": {}, "index": 0}
    )
    text = arith_tool.tool_call("41 - 15 + 84")
    step = env.step(text, parse_json_tool_calls(text)[0])
    assert step == EnvStep([{"role": "tool", "content": "110"}], done=False, reward=0.0)
    broken = text.replace("}}", "}")
    assert parse_json_tool_calls(broken) == ([], 1)
    assert env.step(broken, []) == EnvStep([{"role": "tool", "content": arith_tool.BAD_CALL}], reward=0.0)
    final = env.step("Answer: 110", [])
    assert final.done and final.reward == {"score": 1.0, "acc": True, "pred": "110"}
    wrong = env.step("Answer: 111", [])
    assert wrong.done and wrong.reward == {"score": 0.0, "acc": False, "pred": "111"}
    none = env.step("I do not know", [])
    assert none.done and none.reward == {"score": 0.0, "acc": False, "pred": ""}


def test_calculator_reward_function_scores_an_unstepped_episode_zero_or_one():
    score = _env_module().compute_score
    assert score("calculator", '<tool_call>{"name": "ca', "110") == {"score": 0.0, "acc": False, "pred": ""}
    assert score("calculator", "Answer: 110", "110") == {"score": 1.0, "acc": True, "pred": "110"}


def test_the_recipe_loads_builds_its_env_and_holds_the_longest_warmup_episode():
    from rl.config import load_config
    from rl.preflight import env_problems
    from rl.tiny import train_tokenizer
    from rl.tiny_tool_sft import encode

    cfg = load_config(ROOT / "recipes/examples/calculator.yaml", ["logging.tensorboard=false"])
    ro = cfg.rollout
    assert ro.env.endswith("calculator_env.py:Calculator") and ro.max_turns >= 3
    rows = arith_tool.make_tool_rows(64, 0, split="train")
    assert env_problems(cfg, rows) == []
    from rl.setup import env_tools

    (tool,) = env_tools(cfg)  # what a chat template with a tool format would render
    assert tool["function"]["name"] == arith_tool.TOOL_NAME
    assert tool["function"]["parameters"]["required"] == [arith_tool.ARGUMENT]
    tok = train_tokenizer(seed=0)
    # the tiny template has no tool format: the prompts the demo's figures were measured on are unchanged
    msgs = rows[0]["prompt"]
    assert tok.apply_chat_template(msgs, tools=[tool], add_generation_prompt=True, tokenize=False) == (
        tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    )
    malformed = encode(tok, rows[0], arith_tool.transcript(rows[0], random.Random(0), {"malformed": 1.0})[1])[
        0
    ]
    prompt = encode(tok, rows[0], [])[0]
    # max_total_tokens 0: the episode's bound is max_prompt_len + max_response_len
    assert len(prompt) <= ro.max_prompt_len and len(malformed) <= ro.max_prompt_len + ro.max_response_len
