"""The `rollouts rl` TOML the end-to-end tests share: the tiny model on 2-digit addition, 3 GRPO steps;
`child_processes`, which the engine process tests check their reaping with; and
`reset_vllm_weights`, for tests of the session's shared vLLM server."""

import os
from pathlib import Path


def child_processes(module: bytes) -> list[int]:
    """Pids of this process's children whose command line names `module` (an engine worker's)."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            command = (entry / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue  # not a process, or one that exited while we looked
        if ppid == os.getpid() and module in command:
            pids.append(int(entry.name))
    return pids


def rl_toml(inputs: Path, out: Path, model: Path, extra: str = "") -> Path:
    """Write `<out>.toml` beside `out` (which becomes the run's out_dir); `extra` TOML tables go last."""
    path = out.parent / f"{out.name}.toml"
    path.write_text(f"""
preset = "grpo"
[model]
path = "{model}"
[data]
train_path = "{inputs / "prompts.jsonl"}"
[run]
out_dir = "{out}"
[reward]
fn = "exact_match"
[rl]
num_steps = 3
max_tokens_per_micro_batch = 512
[rl.rollout]
batch_size = 4
samples_per_prompt = 4
[rl.rollout.sampling]
max_new_tokens = 5
temperature = 1.0
[rl.optimizer]
lr = 1e-3
{extra}
""")
    return path


def sft_toml(
    inputs: Path,
    path: Path,
    *,
    out_dir: str | Path = "",
    steps: int,
    batch_size: int,
    every: int = 0,
    keep_last: int = 2,
    extra: str = "",
) -> Path:
    """Write an SFT run file for the tiny model and conversations to `path`; `extra` TOML goes under [sft]."""
    path.write_text(f"""
[model]
path = "{inputs / "model"}"
[data]
train_path = "{inputs / "sft.jsonl"}"
[run]
out_dir = "{out_dir}"
[sft]
num_steps = {steps}
batch_size = {batch_size}
max_length = 32
max_tokens_per_micro_batch = 256
{extra}
[sft.checkpoint]
every_steps = {every}
keep_last = {keep_last}
""")
    return path


def tiny_rl_config(tokenizer, *, algorithm, steps: int, lr: float, prompts: int = 8, n: int = 8, seed=None, **rollout):
    """The RLConfig of the in-process loop tests: `prompts` x `n` samples of 4 new tokens per step."""
    from rollouts.types import CheckpointConfig, OptimizerConfig, RLConfig, RolloutConfig, SamplingParams

    sampling = SamplingParams(temperature=1.0, max_new_tokens=4, stop_token_ids=(tokenizer.eos_token_id,), seed=seed)
    return RLConfig(
        num_steps=steps,
        rollout=RolloutConfig(
            batch_size=prompts,
            samples_per_prompt=n,
            max_concurrency=prompts,
            request_timeout_s=120.0,
            sampling=sampling,
            **rollout,
        ),
        algorithm=algorithm,
        optimizer=OptimizerConfig(lr=lr, schedule="constant"),
        checkpoint=CheckpointConfig(every_steps=0, keep_last=1),
        max_tokens_per_micro_batch=256,
    )


def reset_vllm_weights(url, model_dir):
    """Load `model_dir`'s own weights into the server at `url` (version 0), from disk."""
    import trio

    from rollouts.sync import HTTPOptions, VLLMEngine

    async def load():
        async with VLLMEngine(url, http=HTTPOptions(timeout_s=60.0)) as engine:
            await engine.update_weights_from_disk(str(model_dir), 0)

    trio.run(load)
