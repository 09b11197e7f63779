"""A verifiable task for the demo and tests: multi-digit addition with exact answers.

Problems are prompt records {"prompt": "123+456=", "answer": "975"} (RL) and two-turn
conversations (SFT). The answer may be written reversed (least significant digit first), which
lets a small left-to-right model compute carries in the order it emits digits.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

from rollouts.types import Sample


def addition_problem(a: int, b: int, *, digits: int, reverse_answer: bool) -> dict[str, str]:
    """One problem record; operands zero-padded to `digits`, the sum to digits + 1."""
    total = str(a + b).zfill(digits + 1)
    return {"prompt": f"{a:0{digits}d}+{b:0{digits}d}=", "answer": total[::-1] if reverse_answer else total}


def addition_problems(
    num: int, *, digits: int, seed: int, reverse_answer: bool = True, exclude: frozenset[str] = frozenset()
) -> list[dict[str, str]]:
    """`num` distinct random problems whose prompts are not in `exclude` (for held-out splits)."""
    if num > 10 ** (2 * digits) - len(exclude):
        raise ValueError(f"cannot draw {num} distinct {digits}-digit problems (only {10 ** (2 * digits)} exist)")
    rng = random.Random(seed)
    seen, out = set(exclude), []
    while len(out) < num:
        record = addition_problem(rng.randrange(10**digits), rng.randrange(10**digits), digits=digits,
                                  reverse_answer=reverse_answer)
        if record["prompt"] not in seen:
            seen.add(record["prompt"])
            out.append(record)
    return out


def as_conversation(record: Mapping[str, Any]) -> list[dict[str, str]]:
    """The SFT conversation of a problem: user asks, assistant answers."""
    return [{"role": "user", "content": record["prompt"]}, {"role": "assistant", "content": record["answer"]}]


def exact_answer_reward(sample: Sample, *, answer_key: str = "answer") -> float:
    """1.0 when the response (stripped) is exactly the reference answer, else 0.0."""
    if answer_key not in sample.metadata:
        raise ValueError(f"sample.metadata has no {answer_key!r} (keys: {sorted(sample.metadata)})")
    return 1.0 if sample.response.strip() == str(sample.metadata[answer_key]) else 0.0
