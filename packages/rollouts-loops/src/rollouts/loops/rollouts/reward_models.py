"""Rewards from learned reward models, alone or combined by weights with verifier rewards.

A reward model is a one-label sequence-classification model (HF `*ForSequenceClassification`,
num_labels = 1): its logit for a whole sequence is the score. Score it in process
(`ClassifierRewardModel`: batched, no grad) or on a vLLM server started with `--runner pooling`
(`rollouts.sync.VLLMRewardModel`); both take token ids, so the same ids give the same score. What
the model reads is `encode(sample)`: by default the sample's own tokens (a reward model that shares
the policy's tokenizer); `chat_encoder(tokenizer)` renders prompt and response with the reward
model's own tokenizer and chat template instead.

The score is the logit at the last token whose id is not the pad id, as transformers'
`*ForSequenceClassification` computes it (and TRL, whose reward models are trained through it): a
response ending in an EOS that shares the pad id is scored at the token before it. A vLLM server
pools the last token whatever its id, so `reward_model_reward(..., pad_token_id=...)` drops trailing
pad ids before any scorer sees the ids, and both score the same token.

    reward = weighted_reward([(math_answer, 1.0), (reward_model_reward(rm), 0.5)])
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
from transformers import AutoModelForSequenceClassification

from rollouts.backends.train.components import model_attr
from rollouts.data.user_code import call_user
from rollouts.loops.rollouts.scoring import Reward
from rollouts.types import Sample

__all__ = [
    "ClassifierRewardModel",
    "RewardScorer",
    "chat_encoder",
    "check_reward_model_dir",
    "reward_model_reward",
    "strip_trailing_pad",
    "weighted_reward",
]


class RewardScorer(Protocol):
    """What scores sequences of token ids: `score(inputs) -> list[float]` (sync or async)."""

    def score(self, inputs: Sequence[Sequence[int]]) -> Any: ...


def check_reward_model_dir(path: str | Path) -> dict[str, Any]:
    """The config of the reward model at `path`; ValueError naming the path and the rule unless it is
    a local HF *ForSequenceClassification model with one label."""
    config_path = Path(path) / "config.json"
    if not config_path.is_file():
        raise ValueError(f"reward model {str(path)!r} is not a local HF model directory (no config.json)")
    config: dict[str, Any] = json.loads(config_path.read_text())
    architectures = config.get("architectures") or []
    if not any(str(a).endswith("ForSequenceClassification") for a in architectures):
        raise ValueError(
            f"reward model {str(path)!r} must be a *ForSequenceClassification model, its architectures are "
            f"{architectures}: a causal LM is not a reward model"
        )
    labels = config.get("num_labels", len(config.get("id2label") or {}) or 2)
    if labels != 1:
        raise ValueError(f"reward model {str(path)!r} must have num_labels = 1 (one score per sequence), has {labels}")
    if config.get("pad_token_id") is None:
        raise ValueError(
            f"reward model {str(path)!r} has no pad_token_id in its config: a batch cannot mark where sequences end"
        )
    return config


def strip_trailing_pad(ids: Sequence[int], pad_token_id: int) -> list[int]:
    """`ids` up to its last token whose id is not `pad_token_id`; only pads: the first one (the token
    transformers' sequence classifier scores, whose rule is the last non-pad position, else 0)."""
    end = len(ids)
    while end > 1 and ids[end - 1] == pad_token_id:
        end -= 1
    return list(ids[:end])


class ClassifierRewardModel:
    """A one-label classification model scoring token ids in this process (batched, no grad)."""

    def __init__(self, model: torch.nn.Module, *, batch_size: int = 16) -> None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        pad = getattr(model.config, "pad_token_id", None)
        if pad is None or getattr(model.config, "num_labels", None) != 1:
            raise ValueError("a reward model needs config.num_labels == 1 and a pad_token_id")
        if not hasattr(model, "score") or not hasattr(model, model_attr(model, "base_model_prefix")):
            raise ValueError(
                f"{type(model).__name__} is not a decoder *ForSequenceClassification model (a backbone and a "
                "`score` head): its sequence score cannot be taken at the last token"
            )
        self.model = model.eval()
        self.batch_size = batch_size
        self.pad_token_id = int(pad)

    @classmethod
    def load(
        cls, path: str | Path, *, dtype: torch.dtype = torch.float32, device: str = "cpu", batch_size: int = 16
    ) -> ClassifierRewardModel:
        """The reward model at `path` (checked by `check_reward_model_dir` first)."""
        check_reward_model_dir(path)
        model = AutoModelForSequenceClassification.from_pretrained(
            str(path), torch_dtype=dtype, local_files_only=True, attn_implementation="eager"
        )
        return cls(model.to(device), batch_size=batch_size)

    @torch.no_grad()
    def score(self, inputs: Sequence[Sequence[int]]) -> list[float]:
        """One score per sequence: the model's logit at the sequence's last non-pad token (transformers' rule;
        causal attention, so the trailing pad ids dropped first change nothing before them)."""
        device = next(self.model.parameters()).device
        out: list[float] = []
        for start in range(0, len(inputs), self.batch_size):
            chunk = [list(ids) for ids in inputs[start : start + self.batch_size]]
            if any(len(ids) == 0 for ids in chunk):
                raise ValueError("a reward model cannot score an empty sequence")
            chunk = [strip_trailing_pad(ids, self.pad_token_id) for ids in chunk]
            width = max(len(ids) for ids in chunk)
            ids_B_T = torch.full((len(chunk), width), self.pad_token_id, dtype=torch.long)
            mask_B_T = torch.zeros((len(chunk), width), dtype=torch.long)
            for row, ids in enumerate(chunk):
                ids_B_T[row, : len(ids)] = torch.tensor(ids)
                mask_B_T[row, : len(ids)] = 1
            base = model_attr(self.model, model_attr(self.model, "base_model_prefix"))
            hidden_B_T_H = base(input_ids=ids_B_T.to(device), attention_mask=mask_B_T.to(device))[0]
            last_B = mask_B_T.sum(dim=1).to(device) - 1  # the last token left (right padding)
            logits_B = model_attr(self.model, "score")(
                hidden_B_T_H[torch.arange(len(chunk), device=device), last_B]
            ).float()[:, 0]
            out += logits_B.tolist()
        return out


def chat_encoder(tokenizer: Any) -> Callable[[Sample], list[int]]:
    """Token ids of a sample as a reward model with its own tokenizer reads it: the prompt (text or
    messages) and the response as an assistant turn, through the tokenizer's chat template when it
    has one, else prompt text + response text."""

    def encode(sample: Sample) -> list[int]:
        prompt = sample.prompt
        if getattr(tokenizer, "chat_template", None):
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
            messages.append({"role": "assistant", "content": sample.response})
            ids = tokenizer.apply_chat_template(messages, tokenize=True)
            return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        text = prompt if isinstance(prompt, str) else "".join(str(m.get("content", "")) for m in prompt)
        return list(tokenizer.encode(text + sample.response, add_special_tokens=False))

    return encode


def reward_model_reward(
    scorer: RewardScorer,
    *,
    encode: Callable[[Sample], Sequence[int]] | None = None,
    pad_token_id: int | None = None,
    timeout_s: float = 300.0,
) -> Reward:
    """A batched Reward scoring each group with `scorer` (a ClassifierRewardModel, a VLLMRewardModel,
    anything with `score`); `encode` gives the ids it reads (default: the sample's tokens). With the
    reward model's `pad_token_id`, trailing pad ids are dropped first (`strip_trailing_pad`), so a
    scorer that pools the last token (vLLM) scores the token transformers would."""
    to_ids = encode if encode is not None else (lambda s: s.tokens.tolist())

    def ids_of(sample: Sample) -> list[int]:
        ids = list(to_ids(sample))
        return strip_trailing_pad(ids, pad_token_id) if pad_token_id is not None and ids else ids

    async def score_group(samples: Sequence[Sample], records: Sequence[Any]) -> list[float]:
        inputs = [ids_of(s) for s in samples]
        # the Reward's own bound covers this call; a sync scorer (an in-process model) runs in a thread
        scores = await call_user(scorer.score, inputs, timeout_s=timeout_s)
        return [float(x) for x in scores]

    return Reward(fn=score_group, batched=True, timeout_s=timeout_s)


def weighted_reward(parts: Sequence[tuple[Reward | Callable[..., Any], float]], *, timeout_s: float = 300.0) -> Reward:
    """sum(weight * reward) over `parts`, each a Reward (batched or not) or a reward function; a
    failing part fails the group's reward (the loop's error policy then applies)."""
    if not parts:
        raise ValueError("weighted_reward needs at least one (reward, weight) part")
    rewards = []
    for i, (part, weight) in enumerate(parts):
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
            raise ValueError(f"parts[{i}] weight must be a finite number, got {weight!r}")
        rewards.append((Reward.of(part), float(weight)))

    async def combined(samples: Sequence[Sample], records: Sequence[Any]) -> list[float]:
        total = [0.0] * len(samples)
        for reward, weight in rewards:
            if reward.batched:
                values = await call_user(reward.fn, list(samples), list(records), timeout_s=reward.timeout_s)
            else:
                values = [
                    await call_user(reward.fn, s, r, timeout_s=reward.timeout_s)
                    for s, r in zip(samples, records, strict=True)
                ]
            if len(values) != len(samples):
                raise TypeError(f"a reward returned {len(values)} values for {len(samples)} samples")
            total = [t + weight * float(v) for t, v in zip(total, values, strict=True)]
        return total

    return Reward(fn=combined, batched=True, timeout_s=timeout_s)
