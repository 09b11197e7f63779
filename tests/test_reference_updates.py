"""KL reference updates in the RL loop: EMA and periodic reset move the reference exactly as
defined, the moving reference is saved with each checkpoint and a resumed run gets it back bit for bit,
and settings that cannot work are refused by name."""

import copy
import dataclasses

import pytest
import torch
from run_configs import tiny_rl_config
from test_rl_loop import _setup

from rollouts.backends import InProcessEngine, build_components
from rollouts.data import DataBuffer
from rollouts.loops.algorithms import ALGORITHMS
from rollouts.loops.engines.coalescing import CoalescingEngine
from rollouts.loops.rl.loop import RunOutputs, run_rl_training
from rollouts.loops.rl.models import RLModels
from rollouts.loops.run.loggers import NullLogger
from rollouts.types import ReferenceConfig, RLConfig

KL = dataclasses.replace(ALGORITHMS["grpo"], kl_coef=0.05, kl_placement="loss", kl_kind="k3")


def run_with_reference(tokenizer, model, records, config, run_dir, *, resume=False, on_step=None):
    """(final state, policy model, reference model) of `config`'s RL run from `model`, its reference a
    copy of `model`; `on_step(policy model, metrics)` after each step."""
    components = build_components(model, config.optimizer, num_training_steps=config.num_steps)
    ref = dataclasses.replace(components, model=copy.deepcopy(model).eval())
    after_step = None if on_step is None else lambda state, metrics: on_step(components.model, metrics)
    state, _ = run_rl_training(
        RLModels(
            policy=components,
            engine=CoalescingEngine(InProcessEngine(model, tokenizer=tokenizer), max_prompts_per_call=4),
            engine_shares_model=True,
            reference=ref,
        ),
        DataBuffer(records, seed=0),
        config,
        reward=_length,
        encode_prompt=lambda r: tokenizer.encode(r["prompt"], add_special_tokens=False),
        output=RunOutputs(run_dir=run_dir, logger=NullLogger(), resume=resume, on_step=after_step),
    )
    return state, components.model, ref.model


def _run(inputs, run_dir, *, reference, steps, start=None, resume=False):
    """(policy model, reference model) after `steps` RL steps from the tiny model (or `start`)."""
    tokenizer, model, records = _setup(inputs)
    if start is not None:
        model.load_state_dict(start)
    config = dataclasses.replace(
        tiny_rl_config(tokenizer, algorithm=KL, steps=steps, lr=3e-2, prompts=4, n=4), reference=reference
    )
    _, policy, ref = run_with_reference(tokenizer, model, records, config, run_dir, resume=resume)
    return policy, ref


def _length(sample, record):
    """A reward that differs within a group from the first step on (so the policy moves at once): the
    response's token ids summed (samples of equal length differ too)."""
    return float(sum(sample.response_tokens)) / 100.0


def _weights(model):
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def test_an_ema_reference_moves_by_the_decay_toward_the_policy(tiny_run_inputs, tmp_path):
    start = _weights(_setup(tiny_run_inputs)[1])
    policy, ref = _run(tiny_run_inputs, tmp_path, reference=ReferenceConfig(update="ema", ema_decay=0.9), steps=1)
    for name, value in _weights(ref).items():
        assert torch.equal(value, torch.lerp(start[name], _weights(policy)[name], 0.1)), name
    assert any(not torch.equal(_weights(ref)[n], start[n]) for n in start)


def test_a_reset_reference_is_the_policy_every_n_steps(tiny_run_inputs, tmp_path):
    start = _weights(_setup(tiny_run_inputs)[1])
    reset = ReferenceConfig(update="reset", reset_every_steps=2)
    _, ref_one = _run(tiny_run_inputs, tmp_path / "one", reference=reset, steps=1)
    assert all(torch.equal(v, start[n]) for n, v in _weights(ref_one).items())  # not yet
    policy, ref_two = _run(tiny_run_inputs, tmp_path / "two", reference=reset, steps=2)
    assert all(torch.equal(v, _weights(policy)[n]) for n, v in _weights(ref_two).items())


def test_a_resumed_run_gets_the_moving_reference_back_bit_for_bit(tiny_run_inputs, tmp_path):
    ema = ReferenceConfig(update="ema", ema_decay=0.8)
    _, ref = _run(tiny_run_inputs, tmp_path, reference=ema, steps=2)
    assert (tmp_path / "checkpoints" / "step_2" / "reference.safetensors").is_file()
    _, resumed_ref = _run(tiny_run_inputs, tmp_path, reference=ema, steps=2, resume=True)  # loads, trains nothing
    assert all(torch.equal(v, _weights(ref)[n]) for n, v in _weights(resumed_ref).items())


@pytest.mark.parametrize("decay", [0.0, 1.0, -0.5, 1.5])
def test_an_ema_decay_outside_the_open_interval_is_refused(decay):
    with pytest.raises(ValueError, match="ema_decay"):
        ReferenceConfig(update="ema", ema_decay=decay)


def test_a_moving_reference_without_a_kl_term_is_refused():
    with pytest.raises(ValueError, match="reference.update"):
        RLConfig(algorithm=ALGORITHMS["grpo"], reference=ReferenceConfig(update="ema"))
