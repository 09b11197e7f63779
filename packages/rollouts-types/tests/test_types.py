"""rollouts-types: validation, immutability and round trips (hypothesis where it states a property)."""

import dataclasses
import json
import math
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollouts.types import (
    AlgorithmConfig,
    CheckpointConfig,
    InferenceEngine,
    MetricsLogger,
    OptimizerConfig,
    RLConfig,
    RolloutBatch,
    RolloutConfig,
    Sample,
    SamplingParams,
    SFTConfig,
    Status,
    TrainingState,
    from_dict,
)

CONFIG_TYPES = [OptimizerConfig, CheckpointConfig, SamplingParams, RolloutConfig, AlgorithmConfig, SFTConfig, RLConfig]


def _valid_config(cls, draw):
    """Draw a valid instance of a config class by perturbing its defaults within the rules."""
    if cls is OptimizerConfig:
        return OptimizerConfig(
            lr=draw(st.floats(1e-7, 1.0)),
            betas=(draw(st.floats(0.0, 0.999)), draw(st.floats(0.0, 0.9999))),
            weight_decay=draw(st.floats(0.0, 1.0)),
            max_grad_norm=draw(st.none() | st.floats(1e-3, 100.0)),
            warmup_steps=draw(st.integers(0, 1000)),
            schedule=draw(st.sampled_from(["constant", "linear", "cosine"])),
            min_lr_ratio=draw(st.floats(0.0, 1.0)),
        )
    if cls is CheckpointConfig:
        return CheckpointConfig(every_steps=draw(st.integers(0, 100)), keep_last=draw(st.integers(1, 10)))
    if cls is SamplingParams:
        return SamplingParams(
            n=draw(st.integers(1, 64)),
            max_new_tokens=draw(st.integers(1, 4096)),
            temperature=draw(st.floats(0.0, 2.0)),
            top_p=draw(st.floats(0.01, 1.0)),
            stop_token_ids=tuple(draw(st.lists(st.integers(0, 1000), max_size=3))),
            seed=draw(st.none() | st.integers(0, 2**31)),
        )
    if cls is RolloutConfig:
        samples_per_prompt = draw(st.integers(1, 64))
        sampling = _valid_config(SamplingParams, draw)
        return RolloutConfig(
            batch_size=draw(st.integers(1, 512)),
            samples_per_prompt=samples_per_prompt,
            over_sampling_factor=draw(st.floats(1.0, 4.0)),
            dynamic_sampling=draw(st.booleans()),
            sampling=dataclasses.replace(sampling, n=draw(st.sampled_from([1, samples_per_prompt]))),
        )
    if cls is AlgorithmConfig:
        placement = draw(st.sampled_from(["none", "loss", "reward"]))
        return AlgorithmConfig(
            policy_loss=draw(
                st.sampled_from(
                    ["ppo_clip", "gspo", "cispo", "pg", "sapo", "gmpo", "dppo_tv", "dppo_kl", "clip_cov", "kl_cov"]
                )
            ),
            rs_level=draw(st.sampled_from(["none", "token", "seq_sum", "seq_mean", "seq_max"])),
            rs_high=draw(st.floats(0.01, 10.0)),
            top_entropy_quantile=draw(st.floats(0.01, 1.0)),
            eps_low=draw(st.floats(0.0, 0.99)),
            eps_high=draw(st.floats(0.0, 5.0)),
            dual_clip_c=draw(st.none() | st.floats(1.01, 10.0)),
            kl_placement=placement,
            kl_coef=0.0 if placement == "none" else draw(st.floats(0.0, 1.0)),
            is_cap=draw(st.none() | st.floats(1.0, 10.0)),
        )
    if cls is SFTConfig:
        return SFTConfig(
            num_steps=draw(st.integers(1, 10**6)),
            max_length=draw(st.integers(2, 4096)),
            max_tokens_per_micro_batch=draw(st.integers(4096, 65536)),
            optimizer=_valid_config(OptimizerConfig, draw),
            checkpoint=_valid_config(CheckpointConfig, draw),
        )
    assert cls is RLConfig
    rollout = _valid_config(RolloutConfig, draw)
    if rollout.sampling.temperature == 0:  # greedy groups cannot learn: one sample per prompt
        rollout = dataclasses.replace(
            rollout, samples_per_prompt=1, sampling=dataclasses.replace(rollout.sampling, n=1)
        )
    algorithm = _valid_config(AlgorithmConfig, draw)
    if rollout.samples_per_prompt == 1:  # a group of one has no peers to compare with
        algorithm = dataclasses.replace(algorithm, advantage_estimator="reinforce_pp")
    return RLConfig(
        num_steps=draw(st.integers(1, 10**6)),
        rollout=rollout,
        algorithm=algorithm,
        optimizer=_valid_config(OptimizerConfig, draw),
        overlap=draw(st.booleans()),
    )


@pytest.mark.parametrize("cls", CONFIG_TYPES)
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_config_round_trips_through_asdict(cls, data):
    config = _valid_config(cls, data.draw)
    as_dict = dataclasses.asdict(config)
    assert from_dict(cls, as_dict) == config
    # A TOML/JSON file gives lists, not tuples: the round trip through JSON holds too.
    assert from_dict(cls, json.loads(json.dumps(as_dict))) == config


@pytest.mark.parametrize(
    ("cls", "field", "value"),
    [
        (OptimizerConfig, "lr", 0.0),
        (OptimizerConfig, "lr", -1.0),
        (OptimizerConfig, "min_lr_ratio", 1.5),
        (CheckpointConfig, "keep_last", 0),
        (SamplingParams, "top_p", 0.0),
        (SamplingParams, "n", 0),
        (RolloutConfig, "batch_size", 0),
        (RolloutConfig, "over_sampling_factor", 0.5),
        (RolloutConfig, "request_timeout_s", 0.0),
        (AlgorithmConfig, "dual_clip_c", 1.0),
        (AlgorithmConfig, "eps_low", -0.5),
        (AlgorithmConfig, "policy_loss", "sgd"),
        (AlgorithmConfig, "loss_aggregation", "mean"),
        (SFTConfig, "num_steps", 0),
        (RLConfig, "sync_every_steps", 0),
    ],
)
def test_invalid_values_name_the_field(cls, field, value):
    with pytest.raises(ValueError, match=rf"{cls.__name__}\.{field}") as info:
        cls(**{field: value})
    assert repr(value) in str(info.value)


def _float_fields(cls):
    return [f.name for f in dataclasses.fields(cls) if f.type in ("float", "float | None")]


@settings(max_examples=60, deadline=None)
@given(data=st.data(), value=st.sampled_from([math.inf, -math.inf, math.nan]))
def test_non_finite_floats_are_refused_in_every_config(data, value):
    """inf passes every "> 0" rule (a timeout that never fires, a loss divided to 0): refused by name."""
    cls = data.draw(st.sampled_from([c for c in CONFIG_TYPES if _float_fields(c)]))
    field = data.draw(st.sampled_from(_float_fields(cls)))
    with pytest.raises(ValueError, match=rf"{cls.__name__}\.{field} must be a finite number"):
        cls(**{field: value})
    with pytest.raises(ValueError, match=rf"{cls.__name__}\.{field} must be a finite number"):
        from_dict(cls, {field: value})


@settings(max_examples=50, deadline=None)
@given(
    cls=st.sampled_from(CONFIG_TYPES),
    value=st.text(max_size=5) | st.lists(st.integers(), max_size=2) | st.just(object()),
)
def test_wrong_types_are_type_errors_naming_the_field(cls, value):
    field = next(f for f in dataclasses.fields(cls) if f.type not in ("str",) and "Literal" not in str(f.type))
    with pytest.raises((TypeError, ValueError), match=rf"{cls.__name__}\.{field.name}"):
        cls(**{field.name: value})


def test_from_dict_unknown_key_lists_allowed_keys():
    with pytest.raises(
        ValueError, match=r"RLConfig\.rollout: unknown key\(s\) \['batch_sizes'\]; allowed keys: .*batch_size"
    ):
        from_dict(RLConfig, {"rollout": {"batch_sizes": 4}})


def test_from_dict_nested_error_names_full_path():
    with pytest.raises(TypeError, match=r"RLConfig\.algorithm\.eps_high must be float"):
        from_dict(RLConfig, {"algorithm": {"eps_high": "0.28"}})
    with pytest.raises(ValueError, match=r"RLConfig\.rollout: RolloutConfig\.batch_size must be >= 1, got 0"):
        from_dict(RLConfig, {"rollout": {"batch_size": 0}})


def test_kl_coef_without_placement_is_rejected():
    with pytest.raises(ValueError, match="kl_placement"):
        AlgorithmConfig(kl_coef=0.1)
    assert AlgorithmConfig(kl_coef=0.1, kl_placement="loss").needs_reference


def test_sft_micro_batch_must_hold_a_sample():
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch"):
        SFTConfig(max_length=4096, max_tokens_per_micro_batch=1024)


def test_rl_micro_batch_must_hold_a_full_response():
    sampling = SamplingParams(max_new_tokens=256)
    with pytest.raises(
        ValueError,
        match=r"RLConfig\.max_tokens_per_micro_batch must be > rollout\.sampling\.max_new_tokens \(256\).*got 256",
    ):
        RLConfig(rollout=RolloutConfig(sampling=sampling), max_tokens_per_micro_batch=256)
    assert (
        RLConfig(rollout=RolloutConfig(sampling=sampling), max_tokens_per_micro_batch=257).max_tokens_per_micro_batch
        == 257
    )


# ---- Samples ---------------------------------------------------------------------------------


@st.composite
def samples(draw):
    num_tokens = draw(st.integers(0, 40))
    num_prompt = draw(st.integers(0, num_tokens))
    tokens = draw(st.lists(st.integers(0, 50_000), min_size=num_tokens, max_size=num_tokens))
    mask = [0.0] * num_prompt + draw(
        st.lists(st.sampled_from([0.0, 1.0]), min_size=num_tokens - num_prompt, max_size=num_tokens - num_prompt)
    )
    logprobs = draw(
        st.none()
        | st.lists(st.floats(-30.0, 0.0, width=32), min_size=num_tokens - num_prompt, max_size=num_tokens - num_prompt)
    )
    return Sample(
        prompt=draw(st.text(max_size=10) | st.just([{"role": "user", "content": "hi"}])),
        response=draw(st.text(max_size=10)),
        tokens=tokens,
        num_prompt_tokens=num_prompt,
        loss_mask=mask,
        reward=draw(st.none() | st.floats(-10, 10)),
        group_index=draw(st.none() | st.integers(0, 100)),
        rollout_logprobs=logprobs,
        metadata={"answer": draw(st.integers()), "trace": [1, {"a": 2}]},
        status=draw(st.sampled_from(list(Status))),
    )


@settings(max_examples=100, deadline=None)
@given(sample=samples())
def test_sample_invariants_and_json_round_trip(sample):
    assert len(sample.tokens) == len(sample.loss_mask)
    assert sample.response_length == len(sample.response_tokens)
    assert sample.prompt_tokens + sample.response_tokens == sample.tokens
    if sample.rollout_logprobs is not None:
        assert len(sample.rollout_logprobs) == sample.response_length
    assert Sample.from_dict(json.loads(json.dumps(sample.to_dict()))) == sample


@settings(max_examples=50, deadline=None)
@given(sample=samples(), reward=st.floats(-100, 100))
def test_with_reward_returns_a_new_sample(sample, reward):
    rewarded = sample.with_reward(reward)
    assert rewarded.reward == reward
    assert rewarded.tokens == sample.tokens and rewarded is not sample
    assert dataclasses.replace(rewarded, reward=sample.reward) == sample


_CHANGES = st.fixed_dictionaries(
    {},
    optional={
        "reward": st.none() | st.floats(-10, 10),
        "advantage": st.none() | st.floats(-5, 5),
        "group_index": st.none() | st.integers(0, 9),
        "index": st.none() | st.integers(0, 9),
        "weight_version": st.none() | st.integers(0, 9),
        "response": st.text(max_size=5),
        "prompt": st.text(max_size=5) | st.just([{"role": "user", "content": "x"}]),
        "metadata": st.just({"k": [1, 2]}),
        "status": st.sampled_from([*Status, "aborted"]),
        "rollout_logprobs": st.none(),
        "num_prompt_tokens": st.integers(0, 3),
    },
)


@settings(max_examples=100, deadline=None)
@given(sample=samples(), changes=_CHANGES)
def test_replace_is_dataclasses_replace(sample, changes):
    """Sample.replace checks only the changed fields, and gives what dataclasses.replace gives
    (which checks all of them), or refuses what it refuses, with the same error."""
    if "num_prompt_tokens" in changes:
        changes["rollout_logprobs"] = None  # their lengths go together
    try:
        expected = dataclasses.replace(sample, **changes)
    except (ValueError, TypeError) as error:
        with pytest.raises(type(error), match=re.escape(str(error))):
            sample.replace(**changes)
        return
    got = sample.replace(**changes)
    assert got == expected and got is not sample
    assert {f.name: type(getattr(got, f.name)) for f in dataclasses.fields(Sample)} == {
        f.name: type(getattr(expected, f.name)) for f in dataclasses.fields(Sample)
    }
    assert got.tokens is sample.tokens  # passed on, not packed or checked again


@pytest.mark.parametrize(
    ("changes", "error", "match"),
    [
        ({"reward": math.nan}, ValueError, r"Sample\.reward must be finite"),
        ({"reward": True}, TypeError, r"Sample\.reward must be a float"),
        ({"index": -1}, ValueError, r"Sample\.index must be a non-negative int"),
        ({"num_prompt_tokens": 9}, ValueError, r"num_prompt_tokens \(9\) must be in \[0, len\(tokens\)=3\]"),
        ({"num_prompt_tokens": 1.0}, TypeError, r"num_prompt_tokens must be an int"),
        ({"tokens": [1, 2]}, ValueError, r"loss_mask has 3 entries but tokens has 2"),
        ({"status": "done"}, ValueError, r"'done' is not a valid Status"),
        ({"metadata": [1]}, TypeError, r"metadata must be a mapping"),
        ({"rewardd": 1.0}, TypeError, r"unknown fields \['rewardd'\]"),
    ],
)
def test_replace_checks_what_it_changes(changes, error, match):
    sample = Sample(tokens=[1, 2, 3], num_prompt_tokens=1, loss_mask=[0, 1, 1], rollout_logprobs=[-1.0, -2.0])
    with pytest.raises(error, match=match):
        sample.replace(**changes)


def test_frozen_really_means_frozen():
    sample = Sample(
        prompt=[{"role": "user", "content": "2+2?"}],
        tokens=[1, 2, 3],
        num_prompt_tokens=1,
        loss_mask=[0, 1, 1],
        metadata={"answer": [4]},
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        sample.reward = 1.0  # type: ignore[misc]
    with pytest.raises(TypeError):
        sample.metadata["answer"] = 5  # type: ignore[index]
    with pytest.raises(TypeError):
        sample.prompt[0]["content"] = "changed"  # type: ignore[index]
    with pytest.raises(AttributeError):
        sample.metadata["answer"].append(5)  # tuple: no append
    with pytest.raises((AttributeError, TypeError)):
        sample.new_field = 1  # type: ignore[attr-defined]  # slots: no new attributes
    config = RLConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.rollout.batch_size = 3  # type: ignore[misc]
    assert isinstance(OptimizerConfig(betas=[0.8, 0.9]).betas, tuple)


def test_caller_mutation_does_not_leak_in():
    tokens, metadata = [1, 2], {"k": [1]}
    sample = Sample(tokens=tokens, loss_mask=[0, 1], metadata=metadata)
    tokens.append(3)
    metadata["k"].append(2)
    assert sample.tokens == (1, 2) and sample.metadata["k"] == (1,)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"tokens": [1, 2], "loss_mask": [1.0]}, r"loss_mask has 1 entries but tokens has 2"),
        ({"tokens": [1, -2], "loss_mask": [1, 1]}, r"tokens\[1\] must be a non-negative int"),
        ({"tokens": [1], "loss_mask": [float("nan")]}, r"loss_mask\[0\] must be finite"),
        ({"tokens": [1], "loss_mask": [-1.0]}, r"loss_mask\[0\] must be >= 0"),
        ({"tokens": [1], "loss_mask": [1], "num_prompt_tokens": 2}, r"num_prompt_tokens \(2\)"),
        (
            {"tokens": [1, 2], "loss_mask": [0, 1], "num_prompt_tokens": 1, "rollout_logprobs": [-1, -2]},
            r"rollout_logprobs has 2 entries but the response has 1",
        ),
        ({"reward": math.inf}, r"Sample\.reward must be finite"),
        ({"group_index": -1}, r"group_index must be a non-negative int"),
    ],
)
def test_sample_rejects_bad_input(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        Sample(**kwargs)


def test_rollout_batch_counts_and_validation():
    batch = RolloutBatch(samples=[Sample(reward=1.0), Sample()], step=3, num_filtered=2, filter_reasons={"zero_std": 2})
    assert batch.num_kept == 2 and batch.step == 3
    assert batch.rewards[0] == 1.0 and math.isnan(batch.rewards[1])
    with pytest.raises(TypeError, match=r"samples\[0\] must be a Sample"):
        RolloutBatch(samples=[{"tokens": []}])
    with pytest.raises(ValueError, match=r"num_failed must be a non-negative int"):
        RolloutBatch(samples=[], num_failed=-1)


# ---- TrainingState -------------------------------------------------------------------------


@settings(max_examples=50, deadline=None)
@given(ops=st.lists(st.sampled_from(["step", "skip", "sync"]), max_size=30))
def test_training_state_transitions(ops):
    state = TrainingState()
    steps = skips = run = 0
    for op in ops:
        previous = state
        if op == "step":
            state = state.after_step(num_tokens=10, num_samples=2)
            steps, run = steps + 1, 0
        elif op == "skip":
            state = state.after_skip()
            skips, run = skips + 1, run + 1
        else:
            state = state.with_weight_version(state.weight_version + 1)
        assert previous is not state
    assert (state.step, state.skipped_steps, state.consecutive_skipped_steps) == (steps, skips, run)
    assert state.tokens_seen == 10 * steps and state.samples_seen == 2 * steps
    assert TrainingState.from_dict(json.loads(json.dumps(state.to_dict()))) == state


def test_training_state_rejects_bad_values():
    with pytest.raises(ValueError, match=r"TrainingState\.step must be a non-negative int, got -1"):
        TrainingState(step=-1)
    with pytest.raises(ValueError, match="may only grow"):
        TrainingState(weight_version=3).with_weight_version(2)


# ---- Protocols -------------------------------------------------------------------------------


def test_protocols_are_structural():
    class Logger:
        def log(self, step, metrics):
            pass

        def close(self):
            pass

    class Engine:
        name = "fake"

        async def generate(self, prompts, params):
            return []

        async def update_weights_from_disk(self, path, weight_version):
            pass

        async def weight_version(self):
            return None

        async def health(self):
            return True

    assert isinstance(Logger(), MetricsLogger)
    assert isinstance(Engine(), InferenceEngine)
    assert not isinstance(Logger(), InferenceEngine)


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "gpg", "remax", "grpo_passk"])
def test_greedy_groups_are_refused_for_a_group_estimator(estimator):
    """Temperature 0 with several samples per prompt: identical samples, all advantages 0."""
    greedy = RolloutConfig(samples_per_prompt=4, sampling=SamplingParams(temperature=0.0))
    with pytest.raises(ValueError, match=r"RLConfig\.rollout\.sampling\.temperature.*nothing is learned"):
        RLConfig(rollout=greedy, algorithm=AlgorithmConfig(advantage_estimator=estimator))


@given(st.sampled_from(["grpo", "rloo", "reinforce_pp", "gpg"]), st.integers(1, 8), st.sampled_from([0.0, 0.7, 1.0]))
def test_greedy_sampling_is_accepted_where_it_can_learn(estimator, n, temperature):
    rollout = RolloutConfig(samples_per_prompt=n, sampling=SamplingParams(temperature=temperature))
    group = estimator != "reinforce_pp"
    if group and (temperature == 0 or n == 1):  # identical samples, or a group of one: no peer baseline
        with pytest.raises(ValueError):
            RLConfig(rollout=rollout, algorithm=AlgorithmConfig(advantage_estimator=estimator))
    else:  # a batch-level baseline, or real sampling of several responses
        RLConfig(rollout=rollout, algorithm=AlgorithmConfig(advantage_estimator=estimator))


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=8,
)


@given(value=_JSON)
def test_freeze_copies_every_container_immutably_and_thaw_gives_it_back(value):
    from types import MappingProxyType

    from rollouts.types.frozen import empty_mapping, freeze, thaw

    frozen = freeze(value)
    assert thaw(frozen) == value and freeze(frozen) == frozen

    def mutable_inside(v):
        if isinstance(v, MappingProxyType):
            return any(mutable_inside(x) for x in v.values())
        if isinstance(v, tuple):
            return any(mutable_inside(x) for x in v)
        return isinstance(v, (dict, list))

    assert not mutable_inside(frozen)
    if isinstance(value, dict):  # a copy: changing the original leaves it as it was
        value["new key"] = 1
        assert "new key" not in frozen
        if len(value) == 1:  # it was empty: every empty mapping freezes to the one shared empty mapping
            assert frozen is empty_mapping()
