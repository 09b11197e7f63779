import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fsdp_worker import DTYPE, GLOBAL_SEQUENCES, NUM_STEPS
from helpers import TRAIN_CONFIG_KW, packed_batch, tiny_model

from rollouts.backends import (
    build_components,
    forward_backward,
    latest_checkpoint,
    load_checkpoint,
    optim_step,
    read_weights,
)
from rollouts.losses import sft_loss_fn
from rollouts.types import OptimizerConfig, TrainingState

_TORCHRUN_TIMEOUT_S = 300

# Tolerances for FSDP2 on 2 ranks against one process, both in float64 (fsdp_worker.DTYPE). The two
# differ only in the order of floating-point sums: FSDP reduce-scatters two partial gradients where one
# process sums all tokens at once, and each rank's packed row is a different matmul shape. A sum of n
# terms has absolute error <= n * u * sum|terms|, u = 2**-53 ~ 1.1e-16; here n is at most a few thousand
# and every gradient's terms sum to O(1) (the norm is clipped at 1.0), so losses and gradient norms agree
# to ~1e-12 relative (_REL_TOL = 1e-10 leaves 100x slack) and each gradient component to delta ~ 1e-13.
# AdamW divides by sqrt(v) + eps, so delta moves a weight by at most lr * delta / eps = 1e-2 * 1e-13 /
# 1e-8 = 1e-7 per step, 3e-7 over the 3 steps: _WEIGHT_ATOL = 1e-6. In float32 (u = 6e-8) the same
# bound is ~0.1: no useful comparison, which is why the model is float64. A real bug is orders of
# magnitude away: a missing 1/world_size doubles every gradient norm (test below).
_REL_TOL = 1e-10
_WEIGHT_ATOL = 1e-6


def _torchrun(worker: str, out: Path, *args: str) -> None:
    """Run tests/<worker> on 2 gloo ranks with `out` as its argument; fail with its stderr."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        str(Path(__file__).parent / worker),
        str(out),
        *args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=_TORCHRUN_TIMEOUT_S, check=False)
    assert done.returncode == 0, done.stderr[-4000:]


def _one_process_step(components, state):
    batch = packed_batch(GLOBAL_SEQUENCES)
    num_tokens = int((batch.loss_mask > 0).sum())
    metrics = forward_backward(components, [batch], sft_loss_fn(), num_tokens=num_tokens, num_sequences=4)
    state, optim_metrics = optim_step(
        components, state, OptimizerConfig(**TRAIN_CONFIG_KW), num_tokens=num_tokens, num_samples=4
    )
    return state, metrics["loss"], optim_metrics["grad_norm"]


def _one_process(seed: int = 0):
    return build_components(
        tiny_model(seed=seed, dtype=DTYPE), OptimizerConfig(**TRAIN_CONFIG_KW), num_training_steps=NUM_STEPS
    )


def _one_process_run() -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    """Losses, gradient norms and final weights of the worker's 3 steps in one process."""
    single, state = _one_process(), TrainingState()
    losses, grad_norms = [], []
    for _ in range(NUM_STEPS):
        state, loss, grad_norm = _one_process_step(single, state)
        losses.append(loss)
        grad_norms.append(grad_norm)
    return losses, grad_norms, single.model.state_dict()


def _mismatches(out: Path) -> list[str]:
    """How the FSDP2 run in `out` differs from the same 3 steps in one process (empty: it matches)."""
    result = json.loads((out / "losses.json").read_text())
    losses, grad_norms, reference = _one_process_run()
    problems = []
    if result["losses"] != pytest.approx(losses, rel=_REL_TOL):
        problems.append(f"losses {result['losses']} != {losses}")
    if result["grad_norms"] != pytest.approx(grad_norms, rel=_REL_TOL):
        problems.append(f"grad norms {result['grad_norms']} != {grad_norms}")
    for directory in ("final", "resumed"):
        weights = read_weights(out / directory)
        assert set(weights) == set(reference)
        worst = max(float((weights[n].double() - reference[n]).abs().max()) for n in reference)
        if worst > _WEIGHT_ATOL:
            problems.append(f"{directory} weights differ by up to {worst:.3g} > {_WEIGHT_ATOL}")
    return problems


@pytest.mark.slow
def test_a_checkpoint_failure_on_one_rank_raises_on_every_rank(tmp_path):
    _torchrun("fsdp_failure_worker.py", tmp_path)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert "No space left on device" in ranks[0]["publish"] and "another rank" in ranks[1]["publish"]
    assert "another rank" in ranks[0]["shard"] and "No space left on device" in ranks[1]["shard"]
    assert ranks[0]["latest"] == ranks[1]["latest"] == str(tmp_path / "ckpt" / "step_4")


@pytest.mark.slow
def test_fsdp2_on_two_gloo_ranks_matches_single_process(tmp_path):
    _torchrun("fsdp_worker.py", tmp_path)
    assert _mismatches(tmp_path) == []
    assert json.loads((tmp_path / "losses.json").read_text())["resumed_step"] == NUM_STEPS
    losses, _, reference = _one_process_run()

    # Each rank wrote only its own optimizer shards: two files, each about half of the whole.
    step_dir = tmp_path / "ckpt" / "step_2"
    shard_files = sorted(p.name for p in step_dir.glob("optimizer*.safetensors"))
    assert shard_files == ["optimizer-rank00000-of-00002.safetensors", "optimizer-rank00001-of-00002.safetensors"]
    moments = 2 * sum(t.numel() * t.element_size() for t in reference.values())
    for name in shard_files:
        assert (step_dir / name).stat().st_size < 0.6 * moments

    # The background-published step 1 is complete too.
    assert latest_checkpoint(tmp_path / "ckpt") == step_dir
    assert load_checkpoint(_one_process(seed=1), tmp_path / "ckpt" / "step_1")[0].step == 1

    # The same checkpoint resumes in one process without FSDP (shards joined): step 3 matches.
    single_resumed = _one_process(seed=1)
    state, _ = load_checkpoint(single_resumed, step_dir)
    assert state.step == 2
    _, loss, _ = _one_process_step(single_resumed, state)
    assert loss == pytest.approx(losses[-1], rel=_REL_TOL)
    for name, tensor in single_resumed.model.state_dict().items():
        torch.testing.assert_close(tensor, reference[name], atol=_WEIGHT_ATOL, rtol=0)

    # Micro-batches of one sequence: per micro-batch and gathered once per step, the same training;
    # gathered, each FSDP unit (the decoder layers and the root) is gathered once and reduced once.
    runs = json.loads((tmp_path / "gathered.json").read_text())
    units = tiny_model().config.num_hidden_layers + 1
    micro_batches = len(GLOBAL_SEQUENCES) // 2
    failure = runs.pop("after_failure")  # a step failing midway leaves no partial gradient behind
    assert failure["sharded"] and failure["after_failure"] == pytest.approx(failure["clean"], rel=_REL_TOL)
    for run in runs.values():
        assert run["losses"] == pytest.approx(losses, rel=_REL_TOL)
    assert runs["True"]["grad_norms"] == pytest.approx(runs["False"]["grad_norms"], rel=_REL_TOL)
    gathered = read_weights(tmp_path / "gathered")
    assert max(float((gathered[n].double() - reference[n]).abs().max()) for n in reference) <= _WEIGHT_ATOL
    # per micro-batch: the layers gathered in forward and again in backward, the root once; all reduced
    per_micro_batch = {"all_gather": micro_batches * (2 * units - 1), "reduce_scatter": micro_batches * units}
    assert runs["False"]["collectives"] == [per_micro_batch] * NUM_STEPS
    assert runs["True"]["collectives"] == [{"all_gather": units, "reduce_scatter": units}] * NUM_STEPS


@pytest.mark.slow
def test_the_fsdp2_comparison_catches_a_missing_one_over_world_size(tmp_path):
    """The comparison above is tight enough to fail on a real bug: each rank normalising by its own tokens."""
    _torchrun("fsdp_worker.py", tmp_path, "missing-world-scale")
    problems = _mismatches(tmp_path)
    assert any(p.startswith("grad norms") for p in problems), problems
