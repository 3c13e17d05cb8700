"""The DAPO instruction that wraps a raw math problem, as in DAPO-Math-17K's own `prompt` column."""

DAPO_PREFIX = (
    "Solve the following math problem step by step. The last line of your response should be of the "
    "form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
)
DAPO_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'


def dapo_prompt(problem: str) -> str:
    """The user message DAPO-Math-17K gives its policy for `problem`."""
    return f"{DAPO_PREFIX}{problem}{DAPO_SUFFIX}"
