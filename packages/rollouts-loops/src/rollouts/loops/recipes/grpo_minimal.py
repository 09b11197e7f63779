"""GRPO in one file: the algorithm of `run_rl_training` (rl/loop.py) without its plumbing. Read this
first, then run it:

    python -m rollouts.loops.recipes.grpo_minimal --out runs/grpo-minimal --steps 40

It trains a tiny model on the demo's task (two-digit addition, answers written least significant
digit first) and prints one line per step: mean reward, loss and the weight sync. Run the same
command again and it resumes from the last checkpoint in --out.

One step, for P prompts and G samples per prompt (N = P * G samples):
  1. rollouts    the engine samples G answers per prompt from ITS copy of the weights;
  2. rewards     each answer scored against the record's answer (digit by digit, 1.0 if exact);
  3. advantages  A_i = (r_i - mean of its group) / (std of its group + eps)      `group_baseline`;
  4. update      `rl_step` (the step function `run_rl_training` uses) with `GRPOLoss` below;
  5. sync        the new weights are exported to disk and the engine loads them as version s;
  6. checkpoint  weights, optimizer, scheduler, RNG and the prompt buffer's position (the one part
                 of the run's state besides the model, saved as "prompts").

Left out, and in `run_rl_training`: over-sampling, retries and filters, generation overlapped with
training, KL to a reference, evaluation, several ranks, remote engines (vLLM, SGLang).

Shapes: N samples in the step; B rows and T tokens of one packed micro-batch.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import trio
from torch import Tensor

from rollouts.backends import (
    InProcessEngine,
    TrainingComponents,
    build_components,
    export_weights,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from rollouts.data import DataBuffer
from rollouts.loops.recipes.addition import addition_problems, digit_match_reward
from rollouts.loops.recipes.tiny import build_tiny_model, build_tokenizer
from rollouts.loops.rl.step import rl_step
from rollouts.loops.run.run_dir import CHECKPOINTS_DIR, Stateful, due, load_parts, parts_state
from rollouts.types import (
    AlgorithmConfig,
    CheckpointConfig,
    InferenceEngine,
    MicroBatch,
    OptimizerConfig,
    RLConfig,
    RolloutBatch,
    RolloutConfig,
    Sample,
    SamplingParams,
    TrainingState,
)


@dataclass(frozen=True, slots=True)
class GRPOLoss:
    """The policy-gradient loss of one micro-batch, written out.

        loss = -(1 / num_tokens) * sum over loss tokens t of  A_t * exp(logp_t - stop_grad(logp_t))

    The ratio is 1 in value (one update per batch: the policy trained is the one that sampled)
    but its gradient is grad logp_t, so this is REINFORCE with the group mean as baseline; PPO's
    clip would only act on a second update of the same batch.

    Normalisation: `num_tokens` counts the loss tokens of the whole step (every micro-batch), so
    the micro-batch losses add up to the step's token mean and the gradient does not depend on
    how the step was split. Every token weighs the same (DAPO's "token-mean"); the GRPO paper's
    per-answer mean would give each token of a short answer more weight than one of a long answer.
    """

    needs_entropy: bool = False

    def __call__(
        self,
        logprobs_B_T: Tensor,
        batch: MicroBatch[Tensor],
        *,
        num_tokens: int,
        num_sequences: int,
        entropy_B_T: Tensor | None = None,
    ) -> tuple[Tensor, dict[str, float]]:
        mask_B_T, advantages_B_T = batch.loss_mask, batch.advantages
        assert advantages_B_T is not None, "rl_update scatters the advantages into every micro-batch"
        ratio_B_T = torch.exp(logprobs_B_T - logprobs_B_T.detach())
        loss = -(ratio_B_T * advantages_B_T * mask_B_T).sum() / max(num_tokens, 1)
        mean_logprob = float((logprobs_B_T.detach() * mask_B_T).sum() / mask_B_T.sum().clamp(min=1))
        return loss, {"mean_logprob": mean_logprob}


def group_baseline(rewards_N: Tensor, groups_N: Tensor, *, eps: float = 1e-6) -> Tensor:
    """A_i = (r_i - mean_g) / (std_g + eps) over the samples of each prompt's group g."""
    advantages_N = torch.zeros_like(rewards_N)
    for g in groups_N.unique():  # type: ignore[no-untyped-call]  # torch leaves Tensor.unique unannotated
        in_g = groups_N == g
        r = rewards_N[in_g]
        std = r.std(unbiased=False) if r.numel() > 1 else torch.zeros((), dtype=r.dtype)
        advantages_N[in_g] = (r - r.mean()) / (std + eps)
    return advantages_N


def grpo_minimal(
    components: TrainingComponents,
    engine: InferenceEngine,
    prompts: DataBuffer,
    config: RLConfig,
    *,
    encode_prompt: Callable[[Any], Sequence[int]],
    reward: Callable[[Sample, Any], float],
    run_dir: str | Path,
    log: Callable[[str], None] = print,
) -> tuple[TrainingState, list[float]]:
    """Train up to update `config.num_updates` (resuming from `run_dir` if it holds a checkpoint);
    returns the final state and the mean reward of each step run.

    Of `config` the recipe reads the step counts, `rollout` (batch_size prompts per step,
    samples_per_prompt, sampling), the optimizer, the micro-batch budget and `checkpoint`; the loss
    and the advantages are the ones written out above. `engine` must sample from its own copy of
    the model: each step's weights reach it through disk (`export_weights`, then
    `update_weights_from_disk`), as they would reach a remote engine.
    """
    run_dir = Path(run_dir).absolute()
    group = config.rollout.samples_per_prompt
    parts: dict[str, Stateful] = {"prompts": prompts}  # the run's saved state besides the model
    state = TrainingState()
    checkpoint = latest_checkpoint(run_dir / CHECKPOINTS_DIR)
    if checkpoint is not None:
        state, extra = load_checkpoint(components, checkpoint)
        load_parts(parts, extra)
        log(f"resuming from step {state.step} ({checkpoint})")
        _sync(components, engine, run_dir, state.weight_version, log)  # the engine starts on these weights
    mean_rewards = []
    while state.step < config.num_updates:  # one update per batch with the default algorithm
        records = prompts.get_prompts(config.rollout.batch_size)
        # 1. rollouts: G per prompt, prompt-major, tagged with the engine's weight version; a
        # sampling seed is offset by the step, so a resumed run draws what an uninterrupted one would
        sampling = config.rollout.sampling
        params = dataclasses.replace(
            sampling, n=group, seed=None if sampling.seed is None else sampling.seed + state.step
        )
        samples = trio.run(engine.generate, [list(encode_prompt(r)) for r in records], params)
        # 2. rewards (the group index tells 3. which samples share a prompt)
        samples = [
            s.replace(group_index=i // group).with_reward(float(reward(s, records[i // group])))
            for i, s in enumerate(samples)
        ]
        # 3.-4. advantages and one optimizer step
        state, metrics = rl_step(
            components,
            state,
            RolloutBatch(samples=tuple(samples), step=state.step + 1),
            config,
            advantage_fn=group_baseline,
            loss_fn=GRPOLoss(),
        )
        # 5. weight sync: the engine samples from the new weights next step
        state = state.with_weight_version(state.weight_version + 1)
        _sync(components, engine, run_dir, state.weight_version, log)
        mean_rewards.append(metrics["reward_mean"])
        log(f"step {state.step:4d}  reward {metrics['reward_mean']:.3f}  loss {metrics['loss']:+.4f}")
        # 6. checkpoint (resume continues from here)
        if due(state.step, config.checkpoint.every_steps, config.num_updates):
            save_checkpoint(
                components,
                state,
                run_dir / CHECKPOINTS_DIR,
                extra=parts_state(parts),
                keep_last=config.checkpoint.keep_last,
            )
    return state, mean_rewards


def _sync(
    components: TrainingComponents, engine: InferenceEngine, run_dir: Path, version: int, log: Callable[[str], None]
) -> None:
    path, manifest = export_weights(components, run_dir / "weights")
    trio.run(engine.update_weights_from_disk, str(path), version)
    log(
        f"      sync: engine {engine.name} now samples weight version {version} "
        f"({manifest['total_bytes'] / 1e6:.1f} MB from {path})"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """The recipe on the demo's task: a tiny Qwen2 and addition problems, all built here."""
    parser = argparse.ArgumentParser(
        prog="python -m rollouts.loops.recipes.grpo_minimal", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--out", default="runs/grpo-minimal", help="run directory (resumed if it has a checkpoint)")
    parser.add_argument("--steps", type=int, default=40, help="train up to this step")
    parser.add_argument("--prompts", type=int, default=16, help="prompts per step")
    parser.add_argument("--samples", type=int, default=8, help="samples per prompt (the group)")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    records = addition_problems(2000, digits=2, seed=args.seed)
    tokenizer = build_tokenizer((r["prompt"] + r["answer"] for r in records), vocab_size=32)

    def model() -> torch.nn.Module:  # the same seed: the sampler starts as an exact copy of the policy
        return build_tiny_model(
            len(tokenizer),
            hidden_size=64,
            num_heads=2,
            num_kv_heads=1,
            num_layers=1,
            intermediate_size=128,
            max_position_embeddings=32,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            seed=args.seed,
        )

    policy, sampler = model(), model()
    optimizer = OptimizerConfig(lr=args.lr, schedule="constant", warmup_steps=0, max_grad_norm=1.0)
    sampling = SamplingParams(
        temperature=1.0, max_new_tokens=4, stop_token_ids=(tokenizer.eos_token_id,), seed=args.seed
    )
    config = RLConfig(
        num_steps=args.steps,
        optimizer=optimizer,
        rollout=RolloutConfig(batch_size=args.prompts, samples_per_prompt=args.samples, sampling=sampling),
        algorithm=AlgorithmConfig(advantage_estimator="grpo"),  # rl_step's staleness and metrics; loss passed in
        checkpoint=CheckpointConfig(every_steps=10, keep_last=1),
    )
    grpo_minimal(
        build_components(policy, optimizer, num_training_steps=args.steps),
        InProcessEngine(sampler, shares_training_model=False, tokenizer=tokenizer),
        DataBuffer(records, seed=args.seed),
        config,
        encode_prompt=lambda r: tokenizer.encode(r["prompt"], add_special_tokens=False),
        reward=digit_match_reward,
        run_dir=args.out,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
