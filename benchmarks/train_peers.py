"""The peer training steps bench_cuda.py's train section runs beside `rl_step`, on its model and batch.

Each is a GRPO step as the peer library takes it, written out here (neither TRL nor its trainer is
imported): the rows in micro-batches of the same token budget, the clipped loss (eps 0.2) over the
response tokens normalised by the step's response-token count, backward per micro-batch, then
grad-norm clipping and torch's fused AdamW with the same hyperparameters as the library's.

- trl: HF forward with `logits_to_keep` (the response positions and one more), logits / temperature,
  TRL's `selective_log_softmax` for bf16 logits (log_softmax row by row, then gather);
- trl-compile: the same with each decoder layer compiled (`layer.compile()`, regional);
- liger: HF decoder, then liger_kernel's fused linear cross-entropy with reduction="none" on the
  response positions (log p = -CE), the logits never materialised.

As in `rl_step` with one update per batch, the old log-probs are the current ones, detached (ratio 1,
its gradient the policy gradient); advantages are the group-normalised rewards (GRPO).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

PEERS = ("trl", "trl-compile", "liger")
CLIP_EPS = 0.2


def batch_tensors(batch, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, T] token ids of a RolloutBatch of equal-length samples, and [N] GRPO advantages."""
    ids_N_T = torch.tensor([list(s.tokens) for s in batch.samples], device=device)
    rewards_N = torch.tensor([s.reward for s in batch.samples], dtype=torch.float32)
    groups_N = torch.tensor([s.group_index for s in batch.samples])
    adv_N = torch.empty_like(rewards_N)
    for g in groups_N.unique():
        r = rewards_N[groups_N == g]
        adv_N[groups_N == g] = (r - r.mean()) / (r.std() + 1e-4)  # TRL's scale_rewards="group"
    return ids_N_T, adv_N.to(device)


def selective_log_softmax(logits_B_K_V: torch.Tensor, labels_B_K: torch.Tensor) -> torch.Tensor:
    """TRL's formula for bf16 / fp16 logits: log_softmax of one row at a time, then gather."""
    rows = []
    for row_K_V, row_labels_K in zip(logits_B_K_V, labels_B_K, strict=True):
        row_logps = torch.log_softmax(row_K_V, dim=-1)
        rows.append(row_logps.gather(-1, row_labels_K[:, None]).squeeze(-1))
    return torch.stack(rows)


def _hf_logprobs(model: torch.nn.Module, ids_B_T: torch.Tensor, prompt: int) -> torch.Tensor:
    response = ids_B_T.shape[1] - prompt
    logits = model(input_ids=ids_B_T, logits_to_keep=response + 1, use_cache=False).logits[:, :-1]
    logits = logits / 1.0  # TRL divides by the sampling temperature (1 here)
    return selective_log_softmax(logits, ids_B_T[:, prompt:])


def _liger_logprobs(model: torch.nn.Module, ids_B_T: torch.Tensor, prompt: int) -> torch.Tensor:
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    hidden_B_T_H = model.model(input_ids=ids_B_T, use_cache=False).last_hidden_state
    hidden_K_H = hidden_B_T_H[:, prompt - 1 : -1].reshape(-1, hidden_B_T_H.shape[-1])
    labels_K = ids_B_T[:, prompt:].reshape(-1)
    ce_K = LigerFusedLinearCrossEntropyLoss(reduction="none")(model.lm_head.weight, hidden_K_H, labels_K)
    return -ce_K.view(ids_B_T.shape[0], -1)


def peer_step_fn(variant: str, model: torch.nn.Module, optimizer_config) -> Callable[..., dict[str, float]]:
    """A function (ids_N_T, adv_N, prompt, micro_tokens, sync) -> seconds of its parts and the loss."""
    if variant == "liger":
        import liger_kernel  # noqa: F401  (ImportError: the row says it is not installed)
    if variant == "trl-compile":
        for layer in model.model.layers:
            layer.compile()
    logprobs_of = _liger_logprobs if variant == "liger" else _hf_logprobs
    params = [p for p in model.parameters() if p.requires_grad]
    c = optimizer_config
    fused = params[0].device.type in ("cuda", "cpu")
    opt = torch.optim.AdamW(params, lr=c.lr, betas=c.betas, eps=c.eps, weight_decay=c.weight_decay, fused=fused)

    def step(ids_N_T, adv_N, prompt: int, micro_tokens: int, sync) -> dict[str, float]:
        n, t = ids_N_T.shape
        rows = max(1, micro_tokens // t)
        num_tokens = n * (t - prompt)
        loss = torch.zeros((), device=ids_N_T.device)
        sync()
        t0 = time.perf_counter()
        for start in range(0, n, rows):
            ids_B_T, adv_B = ids_N_T[start : start + rows], adv_N[start : start + rows, None]
            lp_B_K = logprobs_of(model, ids_B_T, prompt)
            ratio = torch.exp(lp_B_K - lp_B_K.detach())
            per_token = -torch.min(ratio * adv_B, ratio.clamp(1 - CLIP_EPS, 1 + CLIP_EPS) * adv_B)
            micro_loss = per_token.sum() / num_tokens
            micro_loss.backward()
            loss += micro_loss.detach()
        sync()
        t1 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(params, c.max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        return {"forward_backward": t1 - t0, "optimizer": time.perf_counter() - t1, "loss": float(loss)}

    return step
