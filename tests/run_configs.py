"""The `rollouts rl` TOML the end-to-end tests share: the tiny model on 2-digit addition, 3 GRPO steps."""

from pathlib import Path


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
