"""An EMA reference in bf16: the RL loop keeps its average in float32, so the reference tracks a
float64 average of the policy within bf16 rounding, and saves the float32 average with each
checkpoint, so a run resumed mid-way ends bit for bit where the straight run does."""

import dataclasses
import json
import shutil

import torch
from run_configs import tiny_rl_config
from test_reference_updates import KL, run_with_reference
from test_rl_loop import _setup

from rollouts.types import CheckpointConfig, ReferenceConfig

DECAY = 0.99


def _bf16_run(inputs, run_dir, *, steps, resume=False, on_step=None):
    """(final state, policy model, reference model) of a bf16 run with an EMA reference, checkpointed
    every 2 steps; `on_step(policy model, metrics)` after each step."""
    tokenizer, model, records = _setup(inputs)
    model = model.to(torch.bfloat16)
    config = dataclasses.replace(
        tiny_rl_config(tokenizer, algorithm=KL, steps=steps, lr=3e-2, prompts=4, n=4, seed=11),
        reference=ReferenceConfig(update="ema", ema_decay=DECAY),
        checkpoint=CheckpointConfig(every_steps=2, keep_last=2),
    )
    return run_with_reference(tokenizer, model, records, config, run_dir, resume=resume, on_step=on_step)


def _weights(model, dtype=None):
    return {k: v.detach().to(dtype or v.dtype, copy=True) for k, v in model.named_parameters()}


def test_a_bf16_ema_reference_tracks_a_float64_average_of_the_policy(tiny_run_inputs, tmp_path):
    start = _weights(_setup(tiny_run_inputs)[1].to(torch.bfloat16), torch.float64)
    average = dict(start)
    policies = []

    def on_step(policy, metrics):
        if metrics["num_trained"]:  # the reference moves after a step that trained
            policies.append(_weights(policy, torch.float64))

    _, _, ref = _bf16_run(tiny_run_inputs, tmp_path, steps=4, on_step=on_step)
    assert len(policies) >= 3
    for policy in policies:
        average = {n: DECAY * a + (1 - DECAY) * policy[n] for n, a in average.items()}
    moved = total = 0
    for name, value in _weights(ref, torch.float64).items():
        exact = average[name]
        # half a bf16 unit in the last place is at most 2^-8 of the value; float32 adds ~1e-7 of it
        bound = exact.abs() * (2.0**-8 + 1e-6) + 1e-30
        assert bool(((value - exact).abs() <= bound).all()), (name, float((value - exact).abs().max()))
        moved += int(((exact - start[name]).abs() > 4 * bound).sum())
        total += exact.numel()
    assert moved > total // 2  # most weights moved by several bf16 units: rounding each step away would show


def test_a_bf16_run_resumed_mid_way_ends_bit_for_bit_as_the_straight_run(tiny_run_inputs, tmp_path):
    _, policy, ref = _bf16_run(tiny_run_inputs, tmp_path / "straight", steps=4)
    step_2 = tmp_path / "straight" / "checkpoints" / "step_2"
    assert (step_2 / "reference_average.safetensors").is_file()
    shutil.copytree(step_2, tmp_path / "resumed" / "checkpoints" / "step_2")
    state, resumed_policy, resumed_ref = _bf16_run(tiny_run_inputs, tmp_path / "resumed", steps=4, resume=True)
    assert state.step == 4
    for mine, theirs in ((resumed_policy, policy), (resumed_ref, ref)):
        expected = _weights(theirs)
        differ = [n for n, v in _weights(mine).items() if not torch.equal(v, expected[n])]
        assert not differ, (mine is resumed_ref, differ)


def test_a_checkpoint_without_the_average_resumes_from_the_reference(tiny_run_inputs, tmp_path):
    """A checkpoint written before the average was saved: the average starts again from the reference."""
    _bf16_run(tiny_run_inputs, tmp_path / "first", steps=2)
    old = tmp_path / "old" / "checkpoints" / "step_2"
    shutil.copytree(tmp_path / "first" / "checkpoints" / "step_2", old)
    (old / "reference_average.safetensors").unlink()
    record = json.loads((old / "state.json").read_text())
    del record["files"]["reference_average.safetensors"]
    (old / "state.json").write_text(json.dumps(record))
    state, _, ref = _bf16_run(tiny_run_inputs, tmp_path / "old", steps=4, resume=True)
    assert state.step == 4
    assert all(v.dtype == torch.bfloat16 and bool(v.isfinite().all()) for v in _weights(ref).values())
