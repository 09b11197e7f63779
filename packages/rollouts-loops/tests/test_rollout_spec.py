"""What a RolloutProcess sends its engine process: functions by import path, the records as JSON
lines, the config as JSON; each refused, naming it, where it cannot go."""

import dataclasses
import functools
import json
import sys
import types
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollouts.data import DataBuffer, prompt_encoder
from rollouts.loops.engines.rollout_process import (
    check_crossing,
    function_path,
    function_spec,
    load_function,
    records_from_jsonl,
    records_to_jsonl,
    rollout_spec,
)
from rollouts.loops.plugins import PluginError, load_object
from rollouts.loops.rollouts.functions import RolloutContext, single_turn_rollout
from rollouts.loops.rollouts.rewards import builtin_reward, exact_match
from rollouts.loops.rollouts.scoring import Reward
from rollouts.types import RLConfig, RolloutConfig, Sample, SamplingParams, from_dict


def module_level(sample, record):
    return 0.0


def test_a_module_level_function_goes_by_its_import_path():
    path = function_path(exact_match, key="reward")
    assert path == "rollouts.loops.rollouts.rewards:exact_match"
    assert load_object(path, key="reward") is exact_match
    assert function_path(path, key="reward") == path  # a path given is checked and kept


def test_a_function_of_the_script_being_run_goes_by_its_file(monkeypatch, tmp_path):
    script = types.ModuleType("__main__")
    script.__file__ = str(tmp_path / "train.py")

    def reward(sample, record):
        return 1.0

    reward.__module__, reward.__qualname__ = "__main__", "reward"
    script.reward = reward
    monkeypatch.setitem(sys.modules, "__main__", script)
    assert function_path(reward, key="reward") == f"{tmp_path / 'train.py'}:reward"
    other = types.FunctionType(reward.__code__, {}, "reward")
    other.__module__, other.__qualname__ = "__main__", "reward"  # named as the script's, but not it
    with pytest.raises(PluginError, match="not importable from the file it was defined in"):
        function_path(other, key="reward")


def test_a_function_of_a_plugin_file_goes_by_its_file(tmp_path):
    plugin = tmp_path / "my_reward.py"
    plugin.write_text("def reward(sample, record):\n    return 1.0\n")
    fn = load_object(f"{plugin}:reward", key="reward.fn")  # as a run file's [reward] fn loads it
    path = function_path(fn, key="reward")
    assert path == f"{plugin}:reward" and load_object(path, key="reward") is fn


def test_what_has_no_import_path_is_refused_naming_the_key():
    def nested(sample, record):
        return 0.0

    class Grader:
        def __call__(self, sample, record):
            return 0.0

        def grade(self, sample, record):
            return 0.0

    for fn in (lambda s, r: 0.0, nested, functools.partial(module_level), Grader().grade, Grader()):
        with pytest.raises(PluginError, match="^reward: .*"):
            function_path(fn, key="reward")
    with pytest.raises(PluginError, match="filter_fn 'no.such.module:f': module 'no.such.module' does not import"):
        function_path("no.such.module:f", key="filter_fn")


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=5), children, max_size=3),
    max_leaves=10,
)
records = st.lists(
    st.fixed_dictionaries({"prompt": st.text()}, optional={"answer": json_values, "meta": json_values}),
    min_size=1,
    max_size=6,
)


@settings(max_examples=80, deadline=None)
@given(records=records)
def test_records_travel_as_json_lines_exactly(records):
    # Any text, line and paragraph separators and newlines included, stays on its own line.
    assert records_from_jsonl(records_to_jsonl(DataBuffer(records))) == records


def test_a_record_that_is_not_json_is_refused_naming_it():
    with pytest.raises(ValueError, match="prompt record 1 is not JSON"):
        records_to_jsonl(DataBuffer([{"prompt": "a"}, {"prompt": "b", "x": b"bytes"}]))
    with pytest.raises(ValueError, match="prompt record 0 is not JSON"):
        records_to_jsonl(DataBuffer([{"prompt": "a", "x": float("nan")}]))


def _context(tokenizer_encoder):
    return RolloutContext(
        engine=types.SimpleNamespace(name="e"),
        sampling=SamplingParams(max_new_tokens=4, n=2),
        encode_prompt=tokenizer_encoder,
        vocab_size=32,
        max_sample_tokens=64,
    )


class _Tokenizer:
    chat_template = None

    def encode(self, text, add_special_tokens=False):
        return [ord(c) % 32 for c in text]


def test_the_spec_is_json_and_rebuilds_the_config():
    config = RLConfig(
        num_steps=3,
        overlap=True,
        rollout=RolloutConfig(batch_size=4, samples_per_prompt=2, sampling=SamplingParams(stop_token_ids=(1, 2))),
    )
    buffer = DataBuffer([{"prompt": "1+1="}], seed=7)
    encoder = prompt_encoder(_Tokenizer(), field="prompt", chat=False)
    spec = rollout_spec(
        config, single_turn_rollout, _context(encoder), Reward.of(module_level), None, buffer, max_prompts_per_call=8
    )
    spec = json.loads(json.dumps(spec))  # it travels as JSON
    assert from_dict(RLConfig, spec["config"]) == config
    assert spec["reward"] == {
        "fn": {"path": f"{__name__}:module_level", "kwargs": {}},
        "batched": False,
        "on_error": "raise",
        "timeout_s": 60.0,
    }
    assert spec["rollout"] is None and spec["filter_fn"] is None
    assert spec["encode"] == {"field": "prompt", "chat": False}
    assert spec["buffer"] == buffer.state_dict() and spec["vocab_size"] == 32
    partial = dataclasses.replace(config, rollout=dataclasses.replace(config.rollout, partial=True))
    with pytest.raises(ValueError, match="does not take rl.rollout.partial"):
        rollout_spec(
            partial,
            single_turn_rollout,
            _context(encoder),
            Reward.of(module_level),
            None,
            buffer,
            max_prompts_per_call=8,
        )


def test_a_builtin_reward_with_another_answer_key_crosses_with_its_key():
    reward = builtin_reward("exact_match", answer_key="solution")
    spec = json.loads(json.dumps(function_spec(reward, key="reward")))
    assert spec == {"path": "rollouts.loops.rollouts.rewards:exact_match", "kwargs": {"answer_key": "solution"}}
    rebuilt = load_function(spec, key="reward")  # as the engine process rebuilds it
    sample = Sample(tokens=(1, 2), num_prompt_tokens=1, loss_mask=(0.0, 1.0), response="42")
    assert rebuilt(sample, {"solution": "42", "answer": "7"}) == reward(sample, {"solution": "42"}) == 1.0
    assert rebuilt(sample, {"solution": "7", "answer": "42"}) == 0.0
    with pytest.raises(PluginError, match="reward: .* has no import path"):  # keywords that are not JSON
        function_spec(functools.partial(module_level, record=object()), key="reward")


def test_a_rollout_bound_at_a_plugin_files_top_level_crosses_by_that_name(tmp_path):
    plugin = tmp_path / "tool.py"  # as examples/calculator_tool.py: a closure bound to a top-level name
    plugin.write_text(
        "from rollouts.loops import CalculatorEnv, environment_rollout\n"
        "rollout = environment_rollout(CalculatorEnv, max_turns=2, max_total_tokens=64, step_timeout_s=1.0)\n"
    )
    rollout = load_object(f"{plugin}:rollout", key="hooks.rollout")
    assert not rollout.__qualname__.isidentifier()  # a closure: not named where it was defined
    spec = function_spec(rollout, key="rollout")
    assert spec == {"path": f"{plugin}:rollout", "kwargs": {}}
    assert load_function(spec, key="rollout") is rollout


def test_the_shipped_tool_example_and_a_keyed_builtin_reward_are_decided_to_cross():
    example = Path(__file__).parents[3] / "examples" / "calculator_tool.py"
    rollout = load_object(f"{example}:rollout", key="hooks.rollout")
    crossing = check_crossing(RLConfig(), Reward.of(builtin_reward("math_answer", answer_key="target")), rollout, None)
    assert crossing["rollout"] == {"path": f"{example.resolve()}:rollout", "kwargs": {}}
    assert crossing["reward"]["kwargs"] == {"answer_key": "target"} and crossing["filter_fn"] is None
    partial = RLConfig(overlap=True, rollout=RolloutConfig(partial=True))
    with pytest.raises(ValueError, match="does not take rl.rollout.partial"):
        check_crossing(partial, Reward.of(module_level), None, None)
