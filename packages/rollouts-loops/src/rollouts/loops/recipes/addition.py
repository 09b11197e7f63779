"""A verifiable task for the demo and tests: multi-digit addition with exact answers.

Problems are prompt records {"prompt": "123+456=", "answer": "975"} (RL) and two-turn
conversations (SFT). The answer may be written reversed (least significant digit first), which
lets a small left-to-right model compute carries in the order it emits digits.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

from rollouts.loops.rollouts.rewards import reference_answer
from rollouts.types import Sample


def addition_problem(a: int, b: int, *, digits: int, reverse_answer: bool) -> dict[str, str]:
    """One problem record; operands zero-padded to `digits`, the sum to digits + 1."""
    total = str(a + b).zfill(digits + 1)
    return {"prompt": f"{a:0{digits}d}+{b:0{digits}d}=", "answer": total[::-1] if reverse_answer else total}


def has_units_carry(record: Mapping[str, str]) -> bool:
    """Whether the units digits of the problem's operands sum to 10 or more."""
    a, b = record["prompt"].rstrip("=").split("+")
    return int(a[-1]) + int(b[-1]) >= 10


def sloppy_teacher(
    records: list[dict[str, str]], *, error_rate: float, seed: int, reverse_answer: bool = True
) -> list[dict[str, str]]:
    """SFT demonstrations from a teacher that forgets the carry out of the units digit `error_rate` of the time.

    The demo's story: imitation learns the teacher's mistakes along with its skill; RL against an
    exact verifier then removes them. Records without a units carry are always right.
    """
    if not 0.0 <= error_rate <= 1.0:
        raise ValueError(f"error_rate must be in [0, 1], got {error_rate}")
    rng = random.Random(seed)
    out = []
    for record in records:
        if has_units_carry(record) and rng.random() < error_rate:
            a, b = (int(x) for x in record["prompt"].rstrip("=").split("+"))
            wrong = str(a + b - 10).zfill(len(record["answer"]))  # the tens digit misses its carry
            record = {**record, "answer": wrong[::-1] if reverse_answer else wrong}
        out.append(record)
    return out


def addition_problems(
    num: int, *, digits: int, seed: int, reverse_answer: bool = True, exclude: frozenset[str] = frozenset()
) -> list[dict[str, str]]:
    """`num` distinct random problems whose prompts are not in `exclude` (for held-out splits)."""
    if num > 10 ** (2 * digits) - len(exclude):
        raise ValueError(f"cannot draw {num} distinct {digits}-digit problems (only {10 ** (2 * digits)} exist)")
    rng = random.Random(seed)
    seen = set(exclude)
    out: list[dict[str, str]] = []
    while len(out) < num:
        record = addition_problem(
            rng.randrange(10**digits), rng.randrange(10**digits), digits=digits, reverse_answer=reverse_answer
        )
        if record["prompt"] not in seen:
            seen.add(record["prompt"])
            out.append(record)
    return out


def as_conversation(record: Mapping[str, Any]) -> list[dict[str, str]]:
    """The SFT conversation of a problem: user asks, assistant answers."""
    return [{"role": "user", "content": record["prompt"]}, {"role": "assistant", "content": record["answer"]}]


def digit_match_reward(sample: Sample, record: Mapping[str, Any] | None = None, *, answer_key: str = "answer") -> float:
    """Partial credit: the fraction of answer positions the response gets right (1.0 only when exact).

    A denser signal than exact match for a model that is partly right, so GRPO groups disagree
    more often; extra or missing characters count as wrong positions.
    """
    answer, response = reference_answer(sample, record, answer_key), sample.response.strip()
    if response == answer:
        return 1.0
    right = sum(a == b for a, b in zip(answer, response, strict=False))
    return right / max(len(answer), len(response)) * 0.9  # never as good as exact
