"""AlgorithmConfig: what an RL update computes (advantages, policy loss, clipping, KL, entropy,
importance weights, rejection), frozen and validated like every config (see configs.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rollouts.types.validation import check_fields, require

LossAggregation = Literal[
    "token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
]
AdvantageEstimator = Literal["grpo", "rloo", "reinforce_pp", "gae", "gpg", "remax", "grpo_passk"]
GROUP_ESTIMATORS = frozenset({"grpo", "rloo", "gpg", "remax", "grpo_passk"})
"""Estimators that compare a sample with the other samples of its prompt (they need sampled, distinct groups)."""
PEER_BASELINE_ESTIMATORS = frozenset({"grpo", "rloo", "gpg", "grpo_passk"})
"""Group estimators whose baseline is the other responses to the same prompt: a group of one has none
(ReMax's baseline is a greedy response of its own, so it learns from one sample per prompt)."""
AdvantageScale = Literal["group", "batch", "none"]
PolicyLoss = Literal["ppo_clip", "gspo", "cispo", "pg", "sapo", "gmpo", "dppo_tv", "dppo_kl", "clip_cov", "kl_cov"]
KLKind = Literal["k1", "abs", "k2", "k3", "low_var_kl", "k1+", "k3+"]
RejectionEstimator = Literal["k1", "k2", "k3"]
RejectionLevel = Literal["none", "token", "seq_sum", "seq_mean", "seq_max"]
KLPlacement = Literal["none", "loss", "reward"]
ISLevel = Literal["token", "sequence"]
ISMode = Literal["truncate", "mask"]
KLHorizonUnit = Literal["steps", "samples"]

__all__ = [
    "GROUP_ESTIMATORS",
    "PEER_BASELINE_ESTIMATORS",
    "AdvantageEstimator",
    "AdvantageScale",
    "AlgorithmConfig",
    "ISLevel",
    "ISMode",
    "KLHorizonUnit",
    "KLKind",
    "KLPlacement",
    "LossAggregation",
    "PolicyLoss",
    "RejectionEstimator",
    "RejectionLevel",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class AlgorithmConfig:
    """The RL algorithm: advantages, policy loss, clipping, KL, entropy and importance weights.

    GRPO is the default; Dr.GRPO, DAPO, GSPO, CISPO, RLOO, REINFORCE++ and PPO are settings of
    these fields (rollouts-loops has named presets).
    """

    advantage_estimator: AdvantageEstimator = "grpo"
    advantage_scale: AdvantageScale = "group"
    """GRPO: divide by the group std ("group"), the batch std ("batch") or not ("none": Dr.GRPO)."""
    policy_loss: PolicyLoss = "ppo_clip"
    eps_low: float = 0.2
    eps_high: float = 0.2
    """Upper clip range; DAPO's clip-higher uses 0.28."""
    dual_clip_c: float | None = None
    """Dual-clip constant (> 1), applied where the advantage is negative."""
    loss_aggregation: LossAggregation = "token-mean"
    norm_constant: float | None = None
    """Divisor for seq-mean-token-sum-norm (None: the padded sequence length)."""
    kl_kind: KLKind = "low_var_kl"
    kl_coef: float = 0.0
    kl_placement: KLPlacement = "none"
    """Where the KL to the reference policy goes: in the loss, in the reward, or nowhere."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (the loss subtracts entropy_coef * entropy)."""
    is_cap: float | None = None
    """Cap on importance weights between trainer and engine log-probs (None: no correction)."""
    is_level: ISLevel = "token"
    is_mode: ISMode = "truncate"
    gamma: float = 1.0
    """GAE discount (PPO with a critic)."""
    lam: float = 1.0
    """GAE lambda."""
    overlong_buffer_length: int = 0
    """DAPO soft overlong punishment: penalize responses within this many tokens of the limit (0: off)."""
    overlong_penalty_factor: float = 1.0
    num_updates_per_batch: int = 1
    """Optimizer steps taken on one batch of rollouts (PPO epochs); >1 makes the ratio move."""
    sapo_tau_pos: float = 1.0
    """SAPO gate temperature where the advantage is positive (the paper's and verl's 1.0)."""
    sapo_tau_neg: float = 1.05
    """SAPO gate temperature where the advantage is <= 0 (the paper's and verl's 1.05)."""
    cov_fraction: float = 2e-4
    """clip-cov / kl-cov: fraction of a micro-batch's loss tokens picked by covariance (verl's 2e-4)."""
    clip_cov_bounds: tuple[float, float] = (1.0, 5.0)
    """clip-cov: only tokens with covariance in (low, high) may be picked (verl's (1, 5))."""
    kl_cov_coef: float = 1.0
    """kl-cov: weight of |log r| on the picked tokens (verl's ppo_kl_coef 1.0)."""
    log_ratio_sq_coef: float = 0.0
    """Weight of (log pi - log pi_old)^2 on every loss token (prime-rl's DPPO kl_tau, 1e-3 there)."""
    off_policy_mask_threshold: float | None = None
    """TRL's off-policy sequence mask: drop sequences with A < 0 whose mean log(pi_rollout / pi) exceeds this."""
    top_entropy_quantile: float = 1.0
    """Train only the top this fraction of loss tokens by entropy (1.0: all; the 80/20 paper uses 0.2)."""
    kl_target: float | None = None
    """Adaptive KL controller target (None: kl_coef stays fixed); the loop updates the coefficient."""
    kl_horizon: int = 10_000
    """Adaptive KL controller horizon (Ziegler et al. 2019), counted in `kl_horizon_unit`."""
    kl_horizon_unit: KLHorizonUnit = "steps"
    """What the adaptive KL horizon counts: RL steps ("steps", the default, so a horizon keeps its
    meaning when the batch size changes) or the sequences trained ("samples", verl's
    AdaptiveKLController, which adapts batch-size times faster for the same horizon)."""
    rs_level: RejectionLevel = "none"
    """Rollout rejection: per token, or per sequence by the sum, mean or max of the token statistic."""
    rs_estimator: RejectionEstimator = "k3"
    """Rollout rejection statistic of log(pi_old / pi_rollout): k1 = -log r, k2 = 0.5 log^2 r, k3 = r - 1 - log r."""
    rs_low: float | None = None
    """Reject where the statistic is below this (None: no lower bound)."""
    rs_high: float | None = None
    """Reject where the statistic is above this (None: no upper bound)."""

    def __post_init__(self) -> None:
        check_fields(self)
        n = "AlgorithmConfig"
        self._check_loss_variant_fields()
        require(self.eps_low >= 0.0, f"{n}.eps_low", self.eps_low, "be >= 0 (>= 1: no lower clip)")
        require(self.eps_high >= 0.0, f"{n}.eps_high", self.eps_high, "be >= 0")
        if self.dual_clip_c is not None:
            require(self.dual_clip_c > 1.0, f"{n}.dual_clip_c", self.dual_clip_c, "be > 1 or None")
        if self.norm_constant is not None:
            require(self.norm_constant > 0, f"{n}.norm_constant", self.norm_constant, "be > 0 or None")
        require(self.kl_coef >= 0.0, f"{n}.kl_coef", self.kl_coef, "be >= 0")
        require(
            self.kl_coef == 0.0 or self.kl_placement != "none",
            f"{n}.kl_placement",
            self.kl_placement,
            f"be 'loss' or 'reward' when kl_coef ({self.kl_coef}) > 0, or the KL term is silently ignored",
        )
        require(self.entropy_coef >= 0.0, f"{n}.entropy_coef", self.entropy_coef, "be >= 0")
        if self.is_cap is not None:
            require(self.is_cap >= 1.0, f"{n}.is_cap", self.is_cap, "be >= 1 or None")
        require(0.0 <= self.gamma <= 1.0, f"{n}.gamma", self.gamma, "be in [0, 1]")
        require(0.0 <= self.lam <= 1.0, f"{n}.lam", self.lam, "be in [0, 1]")
        require(self.overlong_buffer_length >= 0, f"{n}.overlong_buffer_length", self.overlong_buffer_length, "be >= 0")
        require(
            self.overlong_penalty_factor >= 0, f"{n}.overlong_penalty_factor", self.overlong_penalty_factor, "be >= 0"
        )
        require(self.num_updates_per_batch >= 1, f"{n}.num_updates_per_batch", self.num_updates_per_batch, "be >= 1")

    def _check_loss_variant_fields(self) -> None:
        """Range checks of the SAPO, covariance, DPPO, masking, adaptive KL and rejection fields."""
        n = "AlgorithmConfig"
        require(self.sapo_tau_pos > 0, f"{n}.sapo_tau_pos", self.sapo_tau_pos, "be > 0 (the gate divides by it)")
        require(self.sapo_tau_neg > 0, f"{n}.sapo_tau_neg", self.sapo_tau_neg, "be > 0 (the gate divides by it)")
        require(0.0 < self.cov_fraction <= 1.0, f"{n}.cov_fraction", self.cov_fraction, "be in (0, 1]")
        low, high = self.clip_cov_bounds
        require(low < high, f"{n}.clip_cov_bounds", self.clip_cov_bounds, "be (low, high) with low < high")
        require(self.kl_cov_coef >= 0, f"{n}.kl_cov_coef", self.kl_cov_coef, "be >= 0")
        require(self.log_ratio_sq_coef >= 0, f"{n}.log_ratio_sq_coef", self.log_ratio_sq_coef, "be >= 0")
        if self.off_policy_mask_threshold is not None:
            require(
                self.off_policy_mask_threshold >= 0,
                f"{n}.off_policy_mask_threshold",
                self.off_policy_mask_threshold,
                "be >= 0 or None (a mean KL estimate is compared to it)",
            )
        require(
            0.0 < self.top_entropy_quantile <= 1.0,
            f"{n}.top_entropy_quantile",
            self.top_entropy_quantile,
            "be in (0, 1] (1.0 trains every token)",
        )
        if self.kl_target is not None:
            require(self.kl_target > 0, f"{n}.kl_target", self.kl_target, "be > 0 or None")
            require(
                self.kl_coef > 0,
                f"{n}.kl_target",
                self.kl_target,
                f"go with kl_coef > 0 (got {self.kl_coef}): the controller multiplies the coefficient, so 0 stays 0",
            )
        require(self.kl_horizon >= 1, f"{n}.kl_horizon", self.kl_horizon, "be >= 1")
        if self.rs_level != "none":
            require(
                self.rs_low is not None or self.rs_high is not None,
                f"{n}.rs_level",
                self.rs_level,
                "go with rs_low or rs_high (a rejection rule without a bound rejects nothing)",
            )
        if self.rs_low is not None and self.rs_high is not None:
            require(self.rs_low < self.rs_high, f"{n}.rs_low", self.rs_low, f"be < rs_high ({self.rs_high})")

    @property
    def needs_reference(self) -> bool:
        """Whether reference-policy log-probs must be computed."""
        return self.kl_coef > 0.0 and self.kl_placement != "none"

    @property
    def needs_rollout_logprobs(self) -> bool:
        """Whether the loss needs the engine's log-probs (IS weights, rejection, or the off-policy mask)."""
        return self.is_cap is not None or self.rs_level != "none" or self.off_policy_mask_threshold is not None
