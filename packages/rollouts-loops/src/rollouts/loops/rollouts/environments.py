"""Multi-turn environments as a rollout function, and one example: a calculator tool.

`environment_rollout(make_env)` runs `n` episodes of fresh environments per prompt record,
token-in/token-out: the engine continues from the exact token ids so far (never re-tokenized),
the environment's observations are appended with loss weight 0 and log-prob 0, and the episode's
reward (the sum of its steps' rewards) is stored in metadata["env_reward"], which the built-in
`environment_reward` returns. Bounds: `max_turns` model turns (an episode still going is
TRUNCATED), `max_total_tokens`, and `step_timeout_s` on every reset and step: a sync one runs in a
worker thread, abandoned at the bound; an async one is cancelled. An environment that raises, hangs
or answers wrongly is an EnvironmentFailure naming its class, the call, the turn and the cause, and
fails its group (the other episodes are cancelled), which the rollout manager retries and counts.
Async reset and step run in an asyncio event loop by default (asyncio code, aiohttp and asyncio
SDKs work under the trio loops), or in the rollout's own (`async_loop="caller"`, for trio code).
Episodes and turns of a seeded group get seeds of their own (rollouts.loops.rollouts.multiturn).
metadata["version_segments"] says which weights sampled each model token (None on observations);
with rl.rollout.partial a turn cut short by a weight sync is continued in place, under the new
weights (rollouts.loops.rollouts.continued), and the episode's weight_version is its oldest token's.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import operator
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rollouts.data import encode_bounded
from rollouts.data.user_code import AsyncLoop, function_name
from rollouts.loops.rollouts.continued import extend_segments, oldest_of
from rollouts.loops.rollouts.functions import RolloutContext, RolloutFn
from rollouts.loops.rollouts.multiturn import EnvironmentFailure, call_environment, part_seed, run_episodes
from rollouts.sync.partial import VERSION_SEGMENTS, version_segments
from rollouts.types import Environment, EnvStep, LogProbs, LossMask, Sample, Status, TokenIds

ENV_REWARD_KEY = "env_reward"


def _ids(observation: str | Sequence[int], ctx: RolloutContext, *, first: bool, room: int) -> list[int] | None:
    """The observation's ids, or None when it has more than `room` tokens (a huge text is measured
    by its prefixes, never tokenized whole)."""
    ids: list[int] | None
    if not isinstance(observation, str):
        ids = list(observation)
    elif first:
        ids = encode_bounded(lambda t: ctx.encode_prompt({"prompt": t}), observation, room)
    elif ctx.tokenizer is None:
        raise ValueError("an environment that answers in text needs a tokenizer in the RolloutContext")
    else:
        tokenizer = ctx.tokenizer
        ids = encode_bounded(lambda t: tokenizer.encode(t, add_special_tokens=False), observation, room)
    return ids if ids is not None and len(ids) <= room else None


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class EpisodeLimits:
    """The bounds of one episode (`environment_rollout`'s)."""

    max_turns: int = 4
    max_total_tokens: int = 4096
    step_timeout_s: float = 30.0
    """Bound on each reset and step."""
    async_loop: AsyncLoop = "asyncio"
    """Where an async reset or step runs: an asyncio event loop, or the rollout's own ("caller")."""


async def run_episode(env: Environment, record: Any, ctx: RolloutContext, limits: EpisodeLimits) -> Sample:
    """One episode as a single Sample: prompt, then model turns (trained) and observations (masked).
    `ctx.sampling.seed` is the episode's: turn t samples with `part_seed(seed, t)`."""
    call = functools.partial(_call_env, env, limits)
    max_total_tokens = limits.max_total_tokens
    first = await call("reset", 0, record)
    prompt = _ids(first, ctx, first=True, room=max_total_tokens - 1)
    if prompt is None:
        size = f"{len(first)} characters" if isinstance(first, str) else f"{len(first)} tokens"
        raise ValueError(f"the first observation ({size}) leaves no room under max_total_tokens={max_total_tokens}")
    params = dataclasses.replace(ctx.sampling, n=1)
    tokens, mask, logprobs = list(prompt), [0.0] * len(prompt), []
    segments: list[list[Any]] = []  # [weight version, length] runs over the response
    total_reward, status, turns, all_logprobs = 0.0, Status.TRUNCATED, 0, True
    while turns < limits.max_turns and len(tokens) < max_total_tokens:
        room = max_total_tokens - len(tokens)
        turn_params = dataclasses.replace(
            params, max_new_tokens=min(params.max_new_tokens, room), seed=part_seed(params.seed, turns)
        )
        (turn,) = await ctx.engine.generate([tokens], turn_params)
        turns, new = turns + 1, list(turn.response_tokens)
        tokens, mask = tokens + new, mask + [1.0] * len(new)
        segments = extend_segments(segments, version_segments(turn))  # two runs for a turn cut by a sync
        all_logprobs = all_logprobs and turn.rollout_logprobs is not None
        logprobs += list(turn.rollout_logprobs) if turn.rollout_logprobs is not None else [0.0] * len(new)
        result = await call("step", turns, turn.response, new)
        if not isinstance(result, EnvStep):
            raise EnvironmentFailure(
                f"{_where(env, 'step', turns)}: step must return an EnvStep, got {type(result).__name__}"
            )
        total_reward += result.reward
        if result.done:
            status = Status.COMPLETED
            break
        observation = _ids(result.observation, ctx, first=False, room=max_total_tokens - len(tokens) - 1)
        if observation is None:  # no room for it: the episode ends truncated
            break
        tokens, mask, logprobs = (
            tokens + observation,
            mask + [0.0] * len(observation),
            logprobs + [0.0] * len(observation),
        )
        segments = extend_segments(segments, [(None, len(observation))])
    response_ids = tokens[len(prompt) :]
    text = ctx.tokenizer.decode(response_ids, skip_special_tokens=True) if ctx.tokenizer is not None else ""
    return Sample(
        tokens=TokenIds(tokens),
        num_prompt_tokens=len(prompt),
        loss_mask=LossMask(mask),
        response=text,
        status=status,
        rollout_logprobs=LogProbs(logprobs) if all_logprobs else None,
        weight_version=oldest_of([v for v, _ in segments]),  # the oldest: a staleness bound holds for every token
        metadata={ENV_REWARD_KEY: total_reward, "turns": turns, VERSION_SEGMENTS: segments},
    )


def _where(env: Environment, method: str, turn: int) -> str:
    """How a failure names the call: the environment's class (an adapter's client's too), the
    method and the turn."""
    name = type(env).__name__
    if isinstance(env, OpenEnvAdapter):
        name = f"{name}({type(env.client).__name__})"
    return f"environment {name}, {method} at turn {turn}"


async def _call_env(env: Environment, limits: EpisodeLimits, method: str, turn: int, *args: Any) -> Any:
    return await call_environment(
        getattr(env, method),
        *args,
        timeout_s=limits.step_timeout_s,
        where=_where(env, method, turn),
        async_loop=limits.async_loop,
    )


def environment_rollout(
    make_env: Callable[[], Environment],
    *,
    max_turns: int = 4,
    max_total_tokens: int = 4096,
    step_timeout_s: float = 30.0,
    async_loop: AsyncLoop = "asyncio",
) -> RolloutFn:
    """A rollout function running `ctx.sampling.n` episodes of fresh environments concurrently;
    episode i of a seeded group samples with `part_seed(ctx.sampling.seed, i)`, so they differ."""
    if max_turns < 1:
        raise ValueError(f"max_turns must be >= 1, got {max_turns}")
    if not step_timeout_s > 0:
        raise ValueError(f"step_timeout_s must be > 0, got {step_timeout_s}")
    if async_loop not in ("asyncio", "caller"):
        raise ValueError(f"async_loop must be 'asyncio' or 'caller', got {async_loop!r}")
    limits = EpisodeLimits(
        max_turns=max_turns, max_total_tokens=max_total_tokens, step_timeout_s=step_timeout_s, async_loop=async_loop
    )

    async def rollout(record: Any, ctx: RolloutContext) -> list[Sample]:
        async def one(i: int) -> Sample:
            sampling = dataclasses.replace(ctx.sampling, seed=part_seed(ctx.sampling.seed, i))
            env = await call_environment(
                make_env,
                timeout_s=step_timeout_s,
                where=f"environment factory {function_name(make_env)}",
                async_loop=async_loop,
            )
            return await run_episode(env, record, dataclasses.replace(ctx, sampling=sampling), limits)

        return await run_episodes(ctx.sampling.n, one)

    return rollout


def environment_reward(sample: Sample, record: Any) -> float:
    """The episode's summed reward, as `environment_rollout` recorded it."""
    if ENV_REWARD_KEY not in sample.metadata:
        raise ValueError(f"sample.metadata has no {ENV_REWARD_KEY!r}: use environment_reward with environment_rollout")
    return float(sample.metadata[ENV_REWARD_KEY])


# ---------------------------------------------------------------- example: a calculator tool

_OPERATORS: dict[type, Callable[..., Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}
_MAX_EXPRESSION_CHARS = 200
_MAX_MAGNITUDE = 10**12  # results beyond it are refused: no exponent towers, no huge products


def safe_arithmetic(expression: str) -> float | int:
    """Evaluate + - * / // % on numbers, nothing else (no names, calls or powers); ValueError otherwise."""
    if len(expression) > _MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {_MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from e

    def value(node: ast.AST) -> float | int:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            result = node.value
        elif isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            result = _OPERATORS[type(node.op)](value(node.left), value(node.right))
        elif isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
            result = _OPERATORS[type(node.op)](value(node.operand))
        else:
            raise ValueError(f"only numbers and + - * / // % are allowed, got {ast.dump(node)[:60]}")
        if abs(result) > _MAX_MAGNITUDE:
            raise ValueError(f"result beyond {_MAX_MAGNITUDE:.0e}")
        return result

    try:
        return value(tree.body)
    except ZeroDivisionError as e:
        raise ValueError("division by zero") from e


@dataclasses.dataclass
class CalculatorEnv:
    """Answer an arithmetic question, with a calculator tool.

    Each model turn either calls the tool, `calc: <expression>` (the observation is `= <result>`, or
    `error: ...`), or answers, `answer: <number>` (done; reward 1.0 when it equals the record's answer).
    A turn that does neither is told how to use the tool. The step limit is the rollout's `max_turns`.
    """

    answer_key: str = "answer"
    _answer: str = ""

    _CALL = re.compile(r"calc:\s*(.+)", re.IGNORECASE)
    _ANSWER = re.compile(r"answer:\s*(-?[\d.]+)", re.IGNORECASE)

    def reset(self, record: Mapping[str, Any]) -> str:
        if self.answer_key not in record:
            raise ValueError(f"the record has no {self.answer_key!r} field (fields: {sorted(record)})")
        self._answer = str(record[self.answer_key]).strip()
        return str(record["prompt"])

    def step(self, action_text: str, action_ids: Sequence[int]) -> EnvStep:
        if answer := self._ANSWER.search(action_text):
            right = _same_number(answer.group(1), self._answer)
            return EnvStep(reward=1.0 if right else 0.0, done=True)
        if call := self._CALL.search(action_text):
            try:
                return EnvStep(observation=f"\n= {safe_arithmetic(call.group(1).splitlines()[0])}\n")
            except ValueError as e:
                return EnvStep(observation=f"\nerror: {e}\n")
        return EnvStep(observation="\nuse 'calc: <expression>' or 'answer: <number>'\n")


@dataclasses.dataclass(slots=True)
class OpenEnvAdapter:
    """An OpenEnv-style client as an Environment: `reset(**kwargs)` and `step(action)` (sync or async)
    return a result with `.observation`, `.reward` (None counts as 0) and `.done`.

    The client's types stay the client's: `to_action(text)` builds the action its `step` takes,
    `render(observation)` is the text the model sees next, `reset_kwargs(record)` the keyword
    arguments of `reset` for a prompt record. Give `environment_rollout` a factory that makes one
    adapter, around a fresh client, per episode. No dependency on OpenEnv itself.
    """

    client: Any
    to_action: Callable[[str], Any]
    render: Callable[[Any], str] = str
    reset_kwargs: Callable[[Any], Mapping[str, Any]] = lambda record: {}

    def reset(self, record: Any) -> str | Any:
        return _then(self.client.reset(**self.reset_kwargs(record)), lambda r: self.render(_field(r, "observation")))

    def step(self, action_text: str, action_ids: Sequence[int]) -> EnvStep | Any:
        return _then(self.client.step(self.to_action(action_text)), self._env_step)

    def _env_step(self, result: Any) -> EnvStep:
        reward, done = _field(result, "reward"), _field(result, "done")
        if not isinstance(done, bool):
            raise TypeError(f"the environment's step result has done={done!r}, not a bool")
        observation = "" if done else self.render(_field(result, "observation"))
        return EnvStep(observation=observation, reward=0.0 if reward is None else float(reward), done=done)


def _field(result: Any, name: str) -> Any:
    if not hasattr(result, name):
        raise TypeError(
            f"the environment returned {type(result).__name__}, which has no {name!r} "
            "(an OpenEnv-style result has observation, reward and done)"
        )
    return getattr(result, name)


def _then(result: Any, finish: Callable[[Any], Any]) -> Any:
    """finish(result), or an awaitable of it when the client's method was async."""
    if inspect.isawaitable(result):

        async def finished() -> Any:
            return finish(await result)

        return finished()
    return finish(result)


def _same_number(a: str, b: str) -> bool:
    try:
        return abs(float(a) - float(b)) <= 1e-9 * max(1.0, abs(float(b)))
    except ValueError:
        return a == b
