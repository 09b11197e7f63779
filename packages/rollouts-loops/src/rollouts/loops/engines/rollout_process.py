"""RolloutProcess: the in-process sampler and the run's rollout manager, in a process of their own.

With ProcessEngine the sampler runs beside training, but the rollout manager still runs in the
trainer's process: encoding prompts, building, checking and scoring each group's Samples, keeping
the step's accounting. That is pure Python, and in an overlapped run it shares the trainer's
interpreter lock with the training step.
A RolloutProcess is a ProcessEngine whose engine process (rollouts.loops.engines.rollout_worker) also runs
the rollout manager; the trainer sends a step number and receives the finished RolloutBatch.

`run_rl_training` does this by itself when its engine is a RolloutProcess: it sends the rollout
spec (what `rollout_spec` builds: the config, the reward, rollout function and filter named by
import path, how prompts are encoded, the buffer's state) and the prompt records (as JSON lines),
and drives the remote manager (`RemoteRolloutManager`) as it drives a local one: a batch per step
(with the remote DataBuffer's position after it, which the loop gives the trainer's buffer), its
state in checkpoints.

What must be true for that (`check_crossing` decides it before any work; the `rollouts rl`
command before it loads the model): the reward, rollout and filter functions are importable by
name (defined at a module's top level or in the script being run, or bound to a top-level name of
a plugin file or the script, as the tool example's `rollout = environment_rollout(...)`), or are a
functools.partial of such a function with JSON keywords (a built-in reward with its answer key); the prompts are encoded by
`rollouts.data.prompt_encoder` (rebuilt over the engine's copy of the tokenizer) or by a function
importable by name; the prompt records are JSON. Partial rollouts are refused: their sync pauses
the manager mid-step, which this process's request order cannot do. Everything else the engine
does (evaluation, the sync probe, weight loads) goes through ProcessEngine's own requests.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
from collections.abc import Callable
from typing import Any

import trio

from rollouts.backends import ProcessEngine
from rollouts.data import DataBuffer
from rollouts.data.prompts import TokenizerEncoder
from rollouts.loops.plugins import PLUGIN_MODULE_PREFIX, PluginError, load_object
from rollouts.loops.rollouts.functions import RolloutContext, RolloutFn, single_turn_rollout
from rollouts.loops.rollouts.scoring import Reward
from rollouts.types import FilterFn, RLConfig, RolloutBatch
from rollouts.types.wire import batch_from_bytes

__all__ = [
    "RemoteRolloutManager",
    "RolloutProcess",
    "check_crossing",
    "function_path",
    "function_spec",
    "load_function",
    "rollout_spec",
]


class RolloutProcess(ProcessEngine):
    """A ProcessEngine whose engine process also runs the rollout manager (module docstring).

    `max_prompts_per_call`: the most prompts one sampler call batches (the engine process's
    CoalescingEngine). `timeout_s` bounds every request, a step's whole batch included. Other
    options as for ProcessEngine (and `RolloutProcess.from_model(model, tokenizer=...)`)."""

    _worker_module = "rollouts.loops.engines.rollout_worker"

    def __init__(self, *args: Any, max_prompts_per_call: int = 64, **kwargs: Any) -> None:
        if max_prompts_per_call < 1:
            raise ValueError(f"max_prompts_per_call must be >= 1, got {max_prompts_per_call}")
        super().__init__(*args, **kwargs)
        self.max_prompts_per_call = max_prompts_per_call

    def configure_rollouts(self, spec: dict[str, Any], records: bytes) -> None:
        """Build the rollout manager in the engine process from `spec` (`rollout_spec`) and the
        prompt records (JSON lines); a new configuration replaces the old."""
        self.request({"op": "rollouts_configure", "spec": spec}, records)

    def generate_batch_blocking(self, step: int, train_version: int | None) -> tuple[RolloutBatch, dict[str, Any]]:
        """The rollout manager's batch for `step` (blocks; see AsyncRolloutManager.generate_batch),
        and the state of its DataBuffer after it."""
        answer, body = self.request({"op": "rollouts_batch", "step": step, "train_version": train_version})
        return batch_from_bytes(body), answer["buffer"]

    def manager_state(self) -> dict[str, Any]:
        """The remote rollout manager's state_dict (its buffer's position comes with each batch)."""
        answer, _ = self.request({"op": "rollouts_state"})
        return answer["state"]  # type: ignore[no-any-return]

    def load_rollout_state(self, buffer: dict[str, Any], manager: dict[str, Any]) -> None:
        """Restore the remote DataBuffer's and rollout manager's state_dicts."""
        self.request({"op": "rollouts_load_state", "buffer": buffer, "manager": manager})


class RemoteRolloutManager:
    """The rollout manager of a RolloutProcess, driven as the loop drives AsyncRolloutManager:
    `generate_batch`, `state_dict`, `load_state_dict`. The remote manager draws prompts from a
    copy of `buffer` (the trainer's) in the engine process: each batch comes with that copy's
    position after it, for the caller to give `buffer`, and `load_state_dict` sends `buffer`'s
    position along."""

    def __init__(self, engine: RolloutProcess, buffer: DataBuffer) -> None:
        self._engine = engine
        self.buffer = buffer
        """The trainer's DataBuffer, which the remote one mirrors."""

    async def generate_batch(
        self, *, step: int, train_version: int | None = None
    ) -> tuple[RolloutBatch, dict[str, Any]]:
        """The batch for `step` and the remote DataBuffer's state_dict after it."""
        return await trio.to_thread.run_sync(self._engine.generate_batch_blocking, step, train_version)

    def state_dict(self) -> dict[str, Any]:
        return self._engine.manager_state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._engine.load_rollout_state(self.buffer.state_dict(), state)


def remote_rollout_manager(
    engine: RolloutProcess,
    buffer: DataBuffer,
    config: RLConfig,
    rollout: RolloutFn,
    ctx: RolloutContext,
    reward: Reward,
    filter_fn: FilterFn | None,
) -> RemoteRolloutManager:
    """`rollout_manager`'s counterpart: the same manager, built and run in `engine`'s process."""
    spec = rollout_spec(
        config,
        rollout,
        ctx,
        reward,
        filter_fn,
        buffer,
        max_prompts_per_call=engine.max_prompts_per_call,
        engine_name=engine.name,
    )
    engine.configure_rollouts(spec, records_to_jsonl(buffer))
    return RemoteRolloutManager(engine, buffer)


def rollout_spec(
    config: RLConfig,
    rollout: RolloutFn,
    ctx: RolloutContext,
    reward: Reward,
    filter_fn: FilterFn | None,
    buffer: DataBuffer,
    *,
    max_prompts_per_call: int,
    engine_name: str = "rollout-process",
) -> dict[str, Any]:
    """The JSON the engine process builds the rollout manager from; ValueError naming what cannot go."""
    crossing = check_crossing(config, reward, rollout, filter_fn)
    encode = ctx.encode_prompt
    if isinstance(encode, TokenizerEncoder):
        encode_spec: dict[str, Any] = {"field": encode.field, "chat": encode.chat}
    else:
        encode_spec = {"fn": function_spec(encode, key="encode_prompt")}
    return {
        "config": json.loads(json.dumps(dataclasses.asdict(config))),
        "reward": {
            "fn": crossing["reward"],
            "batched": reward.batched,
            "on_error": reward.on_error,
            "timeout_s": reward.timeout_s,
        },
        "rollout": crossing["rollout"],
        "filter_fn": crossing["filter_fn"],
        "encode": encode_spec,
        "vocab_size": ctx.vocab_size,
        "buffer": buffer.state_dict(),
        "max_prompts_per_call": max_prompts_per_call,
        "engine_name": engine_name,
        "sys_path": list(sys.path),  # where this process imports from (as multiprocessing's spawn passes it on)
    }


def check_crossing(
    config: RLConfig, reward: Reward, rollout: RolloutFn | None, filter_fn: FilterFn | None
) -> dict[str, Any]:
    """What of a run crosses to a RolloutProcess, decided before any work: the function specs of
    the reward, rollout and filter (None: the built-in rollout, no filter); ValueError (PluginError
    for a function) naming the first thing that cannot go."""
    if config.rollout.partial:
        raise ValueError(
            "a RolloutProcess does not take rl.rollout.partial: a partial sync pauses the rollout manager "
            "mid-step, and this one runs in another process (use ProcessEngine wrapped in CoalescingEngine)"
        )
    return {
        "reward": function_spec(reward.fn, key="reward"),
        "rollout": None if rollout in (None, single_turn_rollout) else function_spec(rollout, key="rollout"),
        "filter_fn": None if filter_fn is None else function_spec(filter_fn, key="filter_fn"),
    }


def function_spec(fn: Callable[..., Any] | str, *, key: str) -> dict[str, Any]:
    """{"path": import path, "kwargs": {...}} naming `fn` in another process: `function_path`'s, or
    for a functools.partial of such a function with JSON keywords (a built-in reward with its
    answer key), the function's and the keywords."""
    if isinstance(fn, functools.partial) and not fn.args:
        try:
            kwargs = json.loads(json.dumps(fn.keywords, allow_nan=False))
        except (TypeError, ValueError):
            kwargs = None
        if kwargs == fn.keywords:
            return {"path": function_path(fn.func, key=key), "kwargs": kwargs}
    return {"path": function_path(fn, key=key), "kwargs": {}}


def load_function(spec: dict[str, Any], *, key: str) -> Any:
    """The function `function_spec` named, in this process."""
    fn = load_object(spec["path"], key=key)
    return functools.partial(fn, **spec["kwargs"]) if spec["kwargs"] else fn


def function_path(fn: Callable[..., Any] | str, *, key: str) -> str:
    """The import path ("package.module:name", or "path/to/script.py:name" for the script being run)
    that names `fn` in another process; PluginError where none does (a lambda, a closure, a method,
    a partial)."""
    if isinstance(fn, str):
        load_object(fn, key=key)  # refused here, naming the key, rather than in the engine process
        return fn
    bound = _bound_name(fn)
    if bound is not None:  # e.g. `rollout = environment_rollout(...)` in a plugin file: a closure, by its name there
        return bound
    module, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if module is None or not name.isidentifier():
        raise PluginError(
            f"{key}: {fn!r} has no import path (a lambda, closure, method or partial): the rollout process "
            "imports it by name, so define it at a module's top level"
        )
    if module == "__main__" or module.startswith(PLUGIN_MODULE_PREFIX):  # the script run, a plugin file
        loaded = sys.modules.get(module)
        file = getattr(loaded, "__file__", None)
        if file is None or getattr(loaded, name, None) is not fn:
            raise PluginError(f"{key}: {fn!r} is not importable from the file it was defined in; define it in a module")
        return f"{file}:{name}"
    if load_object(f"{module}:{name}", key=key) is not fn:
        raise PluginError(f"{key}: {module}:{name} is not {fn!r}: the rollout process would import another object")
    return f"{module}:{name}"


def _bound_name(fn: Any) -> str | None:
    """ "path/to/file.py:name" where a loaded plugin file or the script being run binds `fn` at its
    top level under a name other than its own (a closure, a partial, an instance), else None."""
    qualname = getattr(fn, "__qualname__", None)
    if isinstance(qualname, str) and qualname.isidentifier():
        return None  # a plain top-level function: named where it is defined
    for module_name, module in list(sys.modules.items()):
        if module_name != "__main__" and not module_name.startswith(PLUGIN_MODULE_PREFIX):
            continue
        file = getattr(module, "__file__", None)
        names = [n for n, value in vars(module).items() if value is fn and n.isidentifier()]
        if file is not None and names:
            return f"{file}:{names[0]}"
    return None


def records_to_jsonl(buffer: DataBuffer) -> bytes:
    """The buffer's prompt records as JSON lines (ASCII: no line separator inside one); ValueError
    naming the first record that is not JSON."""
    lines = []
    for i, record in enumerate(buffer.prompts):
        try:
            lines.append(json.dumps(record, separators=(",", ":"), allow_nan=False))
        except (TypeError, ValueError) as e:
            raise ValueError(
                f"prompt record {i} is not JSON ({e}): a RolloutProcess receives the records as JSON"
            ) from e
    return "\n".join(lines).encode("ascii")


def records_from_jsonl(data: bytes) -> list[Any]:
    """What `records_to_jsonl` wrote."""
    return [json.loads(line) for line in data.decode("ascii").split("\n")]
