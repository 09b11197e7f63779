import dataclasses
import math

import numpy as np
import pytest
import torch
from helpers import (
    grads,
    packed_batch,
    padded_batch,
    random_sequences,
    tiny_model,
    unpack_rows,
)
from hypothesis import example, given, settings
from hypothesis import strategies as st

from rollouts.backends import (
    NonFiniteError,
    attention_mask_4d,
    build_components,
    build_optimizer,
    compute_logprobs,
    forward_backward,
    lr_multiplier,
    optim_step,
)
from rollouts.backends.train.inputs import micro_batch_to_torch, one_sequence_per_row
from rollouts.backends.train.step import token_logprobs_of_model
from rollouts.losses import loss_fn_from_config, sft_loss_fn
from rollouts.types import AlgorithmConfig, OptimizerConfig, TrainingState

LENGTHS = [5, 11, 3, 8]


@pytest.fixture
def components():
    return build_components(tiny_model(), OptimizerConfig(lr=1e-3), num_training_steps=10)


@pytest.fixture
def seqs():
    return random_sequences(np.random.default_rng(0), LENGTHS)


def _naive_logprobs(model, seq):
    with torch.no_grad():
        logits = model(torch.tensor([seq])).logits[0].float()
    lp = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(seq[1:])[:, None])[:, 0]
    return np.concatenate([[0.0], lp.numpy()])


def test_logprobs_match_naive_full_logits_per_sequence(components, seqs):
    packed = compute_logprobs(components, [packed_batch(seqs)])[0]
    for got, seq in zip(unpack_rows(packed, LENGTHS), seqs, strict=True):
        np.testing.assert_allclose(got, _naive_logprobs(components.model, seq), atol=1e-5)
        assert got[0] == 0.0


def test_packed_and_padded_give_same_logprobs(components, seqs):
    packed = compute_logprobs(components, [packed_batch(seqs)])[0]
    padded = compute_logprobs(components, [padded_batch(seqs)])[0]
    for i, (got, n) in enumerate(zip(unpack_rows(packed, LENGTHS), LENGTHS, strict=True)):
        np.testing.assert_allclose(got, padded[i, :n], atol=1e-6)
        assert np.all(padded[i, n:] == 0.0)


def test_packed_sequences_cannot_see_each_other(components, seqs):
    """Changing one packed sequence leaves the others' log-probs untouched."""
    base = unpack_rows(compute_logprobs(components, [packed_batch(seqs)])[0], LENGTHS)
    changed = [list(s) for s in seqs]
    changed[0] = [(t + 7) % 120 + 2 for t in changed[0]]
    after = unpack_rows(compute_logprobs(components, [packed_batch(changed)])[0], LENGTHS)
    for i in range(1, len(seqs)):
        np.testing.assert_array_equal(base[i], after[i])
    assert not np.array_equal(base[0], after[0])


def test_attention_mask_is_block_diagonal_causal():
    seg = torch.tensor([[0, 0, 1, 1, 1, -1]])
    mask = attention_mask_4d(seg)[0, 0]
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [0, 0, 1, 0, 0, 0],
            [0, 0, 1, 1, 0, 0],
            [0, 0, 1, 1, 1, 0],
            [0, 0, 0, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(mask, expected)
    additive = attention_mask_4d(seg, dtype=torch.float32)[0, 0]
    assert torch.equal(additive == 0, expected)


def _grads_after(components, micro_batches, loss_fn, num_tokens, num_sequences):
    components.optimizer.zero_grad(set_to_none=True)
    metrics = forward_backward(components, micro_batches, loss_fn, num_tokens=num_tokens, num_sequences=num_sequences)
    return grads(components.model), metrics


def _num_loss_tokens(micro_batches):
    return int(sum((mb.loss_mask > 0).sum() for mb in micro_batches))


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_packed_and_padded_give_same_gradients(components, seqs, mode):
    loss_fn = sft_loss_fn(mode=mode)
    n = _num_loss_tokens([packed_batch(seqs)])
    g_packed, m_packed = _grads_after(components, [packed_batch(seqs)], loss_fn, n, len(seqs))
    g_padded, m_padded = _grads_after(components, [padded_batch(seqs)], loss_fn, n, len(seqs))
    assert math.isclose(m_packed["loss"], m_padded["loss"], rel_tol=1e-5)
    for name in g_packed:
        torch.testing.assert_close(g_packed[name], g_padded[name], atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum"])
def test_micro_batches_accumulate_to_one_batch(components, seqs, mode):
    """N micro-batches give the gradient and loss of one batch holding them all."""
    loss_fn = sft_loss_fn(mode=mode)
    whole = [packed_batch(seqs)]
    split = [packed_batch(seqs[:1]), packed_batch(seqs[1:3]), padded_batch(seqs[3:])]
    n = _num_loss_tokens(whole)
    assert n == _num_loss_tokens(split)
    g_whole, m_whole = _grads_after(components, whole, loss_fn, n, len(seqs))
    g_split, m_split = _grads_after(components, split, loss_fn, n, len(seqs))
    assert m_split["num_micro_batches"] == 3.0
    assert math.isclose(m_whole["loss"], m_split["loss"], rel_tol=1e-5)
    for name in g_whole:
        torch.testing.assert_close(g_whole[name], g_split[name], atol=1e-6, rtol=1e-4)


def test_rl_loss_runs_and_entropy_only_when_asked(components, seqs):
    seen = []

    class Recorder:
        needs_entropy = False

        def __call__(self, logprobs_B_T, batch, *, num_tokens, num_sequences, **kwargs):
            seen.append(sorted(kwargs))
            return -(logprobs_B_T * batch.loss_mask).sum() / num_tokens, {}

    rec = Recorder()
    forward_backward(components, [packed_batch(seqs)], rec, num_tokens=10, num_sequences=4)
    rec.needs_entropy = True
    forward_backward(components, [packed_batch(seqs)], rec, num_tokens=10, num_sequences=4)
    assert seen == [[], ["entropy_B_T"]]

    algorithm = AlgorithmConfig(entropy_coef=0.01)
    old = compute_logprobs(components, [packed_batch(seqs)])[0]
    mb = packed_batch(seqs, extra={"advantages": [1.0, -1.0, 0.5, -0.5]})
    mb = mb.replace(old_logprobs=old)
    metrics = forward_backward(
        components, [mb], loss_fn_from_config(algorithm), num_tokens=_num_loss_tokens([mb]), num_sequences=4
    )
    assert math.isfinite(metrics["loss"])
    assert all(p.grad is not None for p in components.model.parameters())


def test_bad_micro_batch_is_rejected(components, seqs):
    as_dict = {k: v for k, v in packed_batch(seqs).token_arrays().items()}
    with pytest.raises(TypeError, match="MicroBatch"):
        forward_backward(components, [as_dict], sft_loss_fn(), num_tokens=1, num_sequences=1)
    mb = packed_batch(seqs)
    with pytest.raises(ValueError, match="loss_mask"):
        mb.replace(loss_mask=mb.loss_mask[:, :-1])
    with pytest.raises(TypeError, match="segment_ids"):
        compute_logprobs(components, [mb.replace(segment_ids=mb.segment_ids.astype(np.float32))])


def test_no_weight_decay_on_norms_and_biases():
    model = tiny_model()
    opt = build_optimizer(model, OptimizerConfig(weight_decay=0.1))
    decay_of = {id(p): g["weight_decay"] for g in opt.param_groups for p in g["params"]}
    for name, p in model.named_parameters():
        expected = 0.0 if ("norm" in name or "bias" in name) else 0.1
        assert decay_of[id(p)] == expected, name


_CUDA = pytest.param(
    "cuda",
    marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")],
)


@pytest.mark.parametrize("device", ["cpu", _CUDA])
def test_optimizer_is_fused_and_matches_the_per_tensor_adamw(device):
    """Three steps of the fused AdamW (CPU or CUDA) against torch's per-tensor loop from the same start.

    The two order the same float32 operations differently: each step may round a parameter
    differently in its last place (rel 2e-6 after three steps; on CPU that is all). The CUDA
    kernel also works with beta2 and the bias correction 1 - beta2^t in float32: 0.999 is not a
    float32 (1 - beta2 is off by 1.3e-5 relative), and 1 - beta2^t cancels, so the update carries a
    relative error of order u / (1 - beta2^t) (u = 2^-24: 6e-5 at t = 1, 2e-5 at t = 3); 4x that,
    times the largest update of the step, is allowed.
    """
    config = OptimizerConfig(lr=1e-2, weight_decay=0.1)
    model = tiny_model().to(device)
    reference = tiny_model().to(device)
    reference.load_state_dict(model.state_dict())
    fused = build_optimizer(model, config)
    assert fused.defaults["fused"] is True
    twin = {id(p): q for p, q in zip(model.parameters(), reference.parameters(), strict=True)}
    groups = [
        {"params": [twin[id(p)] for p in g["params"]], "weight_decay": g["weight_decay"]} for g in fused.param_groups
    ]
    loop = torch.optim.AdamW(groups, lr=config.lr, betas=config.betas, eps=config.eps, foreach=False)
    generator = torch.Generator().manual_seed(0)
    u = 2.0**-24
    atol = dict.fromkeys(range(len(list(model.parameters()))), 1e-8)
    cancels = device == "cuda"
    for t in range(1, 4):
        before = [q.detach().clone() for q in reference.parameters()]
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            p.grad = torch.randn(p.shape, generator=generator).to(device)
            q.grad = p.grad.clone()
        fused.step()
        loop.step()
        for i, (q, old) in enumerate(zip(reference.parameters(), before, strict=True)):
            atol[i] += cancels * 4 * u / (1 - config.betas[1] ** t) * float((q.detach() - old).abs().max())
    for i, ((name, p), q) in enumerate(zip(model.named_parameters(), reference.parameters(), strict=True)):
        torch.testing.assert_close(p, q, rtol=2e-6, atol=atol[i], msg=lambda m, name=name: f"{name}: {m}")


def test_the_optimizer_implementation_follows_the_weights():
    """Fused for plain weights on one CPU or CUDA device, else foreach on CUDA, else the loop."""
    from rollouts.backends.train.components import _adamw_implementation

    plain = torch.nn.Parameter(torch.zeros(2))
    assert _adamw_implementation([plain]) == {"fused": True}
    meta = torch.nn.Parameter(torch.zeros(2, device="meta"))
    assert _adamw_implementation([meta]) == {"foreach": False}
    assert _adamw_implementation([plain, meta]) == {"foreach": False}
    assert _adamw_implementation([torch.zeros(2)]) == {"foreach": False}  # not a Parameter (a sharded weight)


@settings(max_examples=30, deadline=None)
@given(
    warmup=st.integers(0, 10),
    total=st.integers(1, 50),
    schedule=st.sampled_from(["constant", "linear", "cosine"]),
    floor=st.floats(0.0, 1.0),
)
def test_schedule_warms_up_then_stays_between_floor_and_one(warmup, total, schedule, floor):
    config = OptimizerConfig(warmup_steps=warmup, schedule=schedule, min_lr_ratio=floor)
    values = [lr_multiplier(s, config=config, num_training_steps=total) for s in range(total + 5)]
    for s in range(min(warmup, total)):
        assert values[s] == pytest.approx((s + 1) / warmup)
    for v in values[warmup:]:
        assert floor - 1e-9 <= v <= 1.0 + 1e-9
    if schedule != "constant" and total > warmup:
        assert values[total + 4] == pytest.approx(floor)


def test_optim_step_reports_lr_and_follows_schedule(seqs):
    config = OptimizerConfig(lr=1e-2, warmup_steps=2, schedule="cosine", min_lr_ratio=0.0)
    components = build_components(tiny_model(), config, num_training_steps=4)
    state = TrainingState()
    lrs = []
    for _ in range(4):
        forward_backward(components, [packed_batch(seqs)], sft_loss_fn(), num_tokens=20, num_sequences=4)
        state, metrics = optim_step(components, state, config, num_tokens=20, num_samples=4)
        lrs.append(metrics["lr"])
    # warm-up (1/2, 2/2), then cosine over the 2 remaining steps: progress 0, then 1/2
    assert lrs == pytest.approx([5e-3, 1e-2, 1e-2, 5e-3], abs=1e-9)
    assert state.step == 4 and state.tokens_seen == 80 and state.samples_seen == 16


def test_clipping_bounds_the_update(seqs):
    config = OptimizerConfig(lr=1e-3, max_grad_norm=1e-3)
    components = build_components(tiny_model(), config, num_training_steps=4)
    forward_backward(components, [packed_batch(seqs)], sft_loss_fn(), num_tokens=20, num_sequences=4)
    params = [p for p in components.model.parameters()]
    before = torch.nn.utils.get_total_norm([p.grad for p in params])
    _, metrics = optim_step(components, TrainingState(), config)
    assert metrics["grad_norm"] == pytest.approx(float(before), rel=1e-5)
    assert metrics["grad_norm"] > 1e-3


def test_non_finite_gradient_is_skipped_then_raises(seqs):
    config = OptimizerConfig(lr=1e-2, max_consecutive_skips=2)
    components = build_components(tiny_model(), config, num_training_steps=10)
    model = components.model
    target = "model.layers.1.mlp.up_proj.weight"
    before = {n: p.detach().clone() for n, p in model.named_parameters()}

    def poisoned_step(state):
        forward_backward(components, [packed_batch(seqs)], sft_loss_fn(), num_tokens=20, num_sequences=4)
        model.get_parameter(target).grad[0, 0] = float("nan")
        return optim_step(components, state, config)

    state, metrics = poisoned_step(TrainingState())
    assert metrics["skipped"] == 1.0 and state.skipped_steps == 1 and state.step == 0
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]) and p.grad is None
    assert components.optimizer.state == {} or all(not s for s in components.optimizer.state.values())
    with pytest.raises(NonFiniteError, match=target.replace(".", r"\.")):
        poisoned_step(state)


def test_applied_step_resets_consecutive_skips_and_nan_loss_skips(seqs):
    config = OptimizerConfig(lr=1e-2, max_consecutive_skips=2)
    components = build_components(tiny_model(), config, num_training_steps=10)
    forward_backward(components, [packed_batch(seqs)], sft_loss_fn(), num_tokens=20, num_sequences=4)
    state, metrics = optim_step(components, TrainingState(), config, loss=float("inf"))
    assert metrics["skipped"] == 1.0 and state.consecutive_skipped_steps == 1
    forward_backward(components, [packed_batch(seqs)], sft_loss_fn(), num_tokens=20, num_sequences=4)
    state, metrics = optim_step(components, state, config, loss=1.0)
    assert metrics["skipped"] == 0.0 and state.consecutive_skipped_steps == 0 and state.step == 1
    forward_backward(components, [packed_batch(seqs)], sft_loss_fn(), num_tokens=20, num_sequences=4)
    state, _ = optim_step(components, state, config, loss=float("nan"))
    with pytest.raises(NonFiniteError, match="loss nan"):
        optim_step(components, state, config, loss=float("nan"))


def test_eager_attention_packs_like_sdpa(seqs):
    """The additive mask used for eager attention isolates sequences the same way."""
    eager = build_components(tiny_model(attn="eager"), OptimizerConfig(), num_training_steps=2)
    sdpa = build_components(tiny_model(attn="sdpa"), OptimizerConfig(), num_training_steps=2)
    got = compute_logprobs(eager, [packed_batch(seqs), padded_batch(seqs)])
    ref = compute_logprobs(sdpa, [padded_batch(seqs)])[0]
    for i, (packed_row, n) in enumerate(zip(unpack_rows(got[0], LENGTHS), LENGTHS, strict=True)):
        np.testing.assert_allclose(packed_row, ref[i, :n], atol=1e-5)
        np.testing.assert_allclose(got[1][i, :n], ref[i, :n], atol=1e-5)


@settings(max_examples=15, deadline=None)
@given(lengths=st.lists(st.integers(2, 12), min_size=1, max_size=5), seed=st.integers(0, 2**16))
def test_causal_fast_path_equals_the_segment_mask(lengths, seed):
    """Right-padded rows of one sequence each skip the [B, 1, T, T] mask (SDPA's causal kernel);
    their log-probs and gradients equal the masked, packed computation of the same sequences."""
    components = build_components(tiny_model(), OptimizerConfig(lr=1e-3), num_training_steps=10)
    seqs = random_sequences(np.random.default_rng(seed), lengths)
    padded, packed = padded_batch(seqs), packed_batch(seqs)
    assert one_sequence_per_row(micro_batch_to_torch(padded, torch.device("cpu")))
    assert one_sequence_per_row(micro_batch_to_torch(packed, torch.device("cpu"))) == (len(seqs) == 1)
    got = compute_logprobs(components, [padded])[0]
    want = compute_logprobs(components, [packed])[0]
    for i, (row, n) in enumerate(zip(unpack_rows(want, lengths), lengths, strict=True)):
        np.testing.assert_allclose(got[i, :n], row, atol=1e-5)
        assert np.all(got[i, n:] == 0.0)
    loss_fn = sft_loss_fn(mode="token-mean")
    n = _num_loss_tokens([packed])
    g_padded, _ = _grads_after(components, [padded], loss_fn, n, len(seqs))
    g_packed, _ = _grads_after(components, [packed], loss_fn, n, len(seqs))
    for name in g_packed:
        torch.testing.assert_close(g_padded[name], g_packed[name], atol=1e-6, rtol=1e-4)


def test_rows_with_two_sequences_or_left_padding_keep_the_mask(seqs):
    two = micro_batch_to_torch(packed_batch(seqs[:2]), torch.device("cpu"))
    assert not one_sequence_per_row(two)
    left = micro_batch_to_torch(padded_batch(seqs), torch.device("cpu"))
    flipped = left.map(lambda _name, t: torch.flip(t, dims=[1]) if t.dim() == 2 else t)
    assert not one_sequence_per_row(flipped)


@settings(max_examples=15, deadline=None)
@given(
    lengths=st.lists(st.integers(2, 12), min_size=1, max_size=4),
    seed=st.integers(0, 2**16),
    packed=st.booleans(),
    with_entropy=st.booleans(),
)
@example(lengths=[3, 2], seed=11575, packed=True, with_entropy=False)  # loss tokens at sequence starts only
def test_loss_positions_only_equals_the_full_computation(lengths, seed, packed, with_entropy):
    """The output layer over loss positions only: the same log-probs (and entropy) there, 0 elsewhere,
    and the same gradients of any loss that reads loss positions, for random masks, packed or padded."""
    rng = np.random.default_rng(seed)
    model = tiny_model()
    seqs = random_sequences(rng, lengths)
    mb = (packed_batch if packed else padded_batch)(seqs, num_prompt=0)
    mask = (rng.random(mb.loss_mask.shape) < 0.5).astype(np.float32) * (mb.attention_mask > 0)
    batch = micro_batch_to_torch(dataclasses.replace(mb, loss_mask=mask), torch.device("cpu"))
    weights_B_T = torch.from_numpy(rng.normal(size=mask.shape).astype(np.float32))
    results = []
    for only in (False, True):
        model.zero_grad(set_to_none=True)
        lp, ent = token_logprobs_of_model(model, batch, with_entropy=with_entropy, loss_positions_only=only)
        total = (lp * weights_B_T * batch.loss_mask).sum()
        if ent is not None:
            total = total + (ent * batch.loss_mask).sum()
        total.backward()
        results.append((lp.detach(), None if ent is None else ent.detach(), grads(model)))
    (full, full_ent, full_g), (only, only_ent, only_g) = results
    on = batch.loss_mask > 0
    # a loss token at a sequence start (position 0) has no log-prob; with no other, the layout keeps
    # every position (the forward needs one), so the zeros elsewhere hold only when one is predicted
    if bool((on[:, 1:] & (batch.position_ids[:, 1:] > 0)).any()):
        assert bool((only[~on] == 0).all())
    torch.testing.assert_close(only[on], full[on], atol=1e-6, rtol=1e-5)
    if with_entropy:
        torch.testing.assert_close(only_ent[on], full_ent[on], atol=1e-6, rtol=1e-5)
    for name in full_g:
        torch.testing.assert_close(only_g[name], full_g[name], atol=1e-6, rtol=1e-4)


def _device_layout_rules(batch, *, loss_positions_only):
    """The layout rules written on torch tensors, as the forward applied them before they moved to
    the host: a boolean [B, T - 1] mask of the positions whose next token gets a log-prob, and
    whether each row holds one sequence from position 0."""
    keep_B_T = (batch.position_ids[:, 1:] > 0) & (batch.attention_mask[:, 1:] > 0)
    if loss_positions_only and bool((keep_B_T & (batch.loss_mask[:, 1:] > 0)).any()):
        keep_B_T = keep_B_T & (batch.loss_mask[:, 1:] > 0)
    real_B_T = batch.segment_ids >= 0
    positions_T = torch.arange(batch.input_ids.shape[1])
    one_per_row = (
        bool((real_B_T[:, 1:] <= real_B_T[:, :-1]).all())
        and bool(((batch.segment_ids == batch.segment_ids[:, :1]) | ~real_B_T).all())
        and bool(((batch.position_ids == positions_T) | ~real_B_T).all())
    )
    return keep_B_T, one_per_row


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(2, 12), min_size=1, max_size=5),
    num_prompt=st.integers(1, 14),
    layout=st.sampled_from(["packed", "padded"]),
    loss_positions_only=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_the_host_layout_follows_the_rules_of_the_batch(lengths, num_prompt, layout, loss_positions_only, seed):
    """The layout the forward reads on the host (so a GPU never waits on it) is what the batch's
    tensors say: the kept positions, one sequence per row, padding, and the token counts."""
    from rollouts.backends.train.inputs import host_layout

    seqs = random_sequences(np.random.default_rng(seed), lengths)
    micro_batch = (packed_batch if layout == "packed" else padded_batch)(seqs, num_prompt=num_prompt)
    batch = micro_batch_to_torch(micro_batch, torch.device("cpu"))
    found = host_layout(micro_batch, loss_positions_only=loss_positions_only)
    from_tensors = host_layout(batch, loss_positions_only=loss_positions_only)
    assert found.kept.tolist() == from_tensors.kept.tolist()
    assert found.labels.tolist() == from_tensors.labels.tolist()
    assert dataclasses.replace(found, kept=None, labels=None) == dataclasses.replace(
        from_tensors, kept=None, labels=None
    )
    keep_B_T, one_per_row = _device_layout_rules(batch, loss_positions_only=loss_positions_only)
    t = batch.input_ids.shape[1]
    rows, cols = torch.nonzero(keep_B_T, as_tuple=True)
    assert found.kept.tolist() == (rows * t + cols).tolist()
    assert found.one_sequence_per_row == one_per_row == one_sequence_per_row(batch)
    assert found.all_real == bool((batch.attention_mask != 0).all())
    assert found.num_loss_tokens == int((batch.loss_mask > 0).sum())
    assert found.num_real_tokens == int(batch.attention_mask.sum())
    # the labels the log-probs are of: the device's gather of the predicted tokens, found on the host
    assert found.labels.tolist() == batch.input_ids.reshape(-1)[torch.from_numpy(found.kept) + 1].tolist()
    assert found.token_ids == (int(batch.input_ids.min()), int(batch.input_ids.max()))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_step_on_cuda_matches_the_cpu(seqs):
    """forward_backward on CUDA (pinned, non-blocking copies; the layout found on the host) gives
    the CPU's loss, metrics and gradients: float32 throughout, so within float32 rounding of sums
    over a few hundred terms (rel 1e-4)."""
    micro_batches = [packed_batch(seqs[:2]), padded_batch(seqs[2:])]
    results = {}
    for device in ("cpu", "cuda"):
        components = build_components(tiny_model(), OptimizerConfig(lr=1e-3), num_training_steps=2, device=device)
        metrics = forward_backward(components, micro_batches, sft_loss_fn(), num_tokens=20, num_sequences=4)
        grads = {n: p.grad.detach().cpu() for n, p in components.model.named_parameters()}
        logprobs = compute_logprobs(components, micro_batches)
        results[device] = (metrics, grads, logprobs)
    (cpu_metrics, cpu_grads, cpu_lps), (gpu_metrics, gpu_grads, gpu_lps) = results["cpu"], results["cuda"]
    assert cpu_metrics.keys() == gpu_metrics.keys()
    for key in cpu_metrics:
        assert math.isclose(cpu_metrics[key], gpu_metrics[key], rel_tol=1e-4, abs_tol=1e-6), key
    for name in cpu_grads:
        torch.testing.assert_close(gpu_grads[name], cpu_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    for a, b in zip(cpu_lps, gpu_lps, strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("bad", [-1, "vocab"])
def test_an_id_outside_the_vocabulary_is_refused_on_the_host_before_the_forward(components, seqs, bad):
    """Checked on the host (a GPU would assert on the device, or wait to read the ids back), naming
    the range and the rule, before any forward: no gradient is left behind."""
    vocab = components.model.get_input_embeddings().weight.shape[0]
    micro_batch = packed_batch(seqs)
    micro_batch.input_ids[0, 4] = vocab if bad == "vocab" else bad
    low, high = (-1, int(micro_batch.input_ids.max())) if bad == -1 else (int(micro_batch.input_ids.min()), vocab)
    rule = rf"input_ids must lie in \[0, {vocab}\) \(the model's vocabulary\), got values in \[{low}, {high}\]"
    with pytest.raises(ValueError, match=rule):
        forward_backward(components, [micro_batch], sft_loss_fn, num_tokens=10, num_sequences=4)
    assert grads(components.model) == {}
    with pytest.raises(ValueError, match=rule):
        compute_logprobs(components, [micro_batch])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_micro_batch_on_cuda_queues_its_forward_and_backward_without_a_host_wait(seqs):
    """No read of a device tensor between a micro-batch's copy to the GPU and its backward: the ids
    and labels are checked on the host (HostLayout), and the metrics are read once after the step."""
    components = build_components(tiny_model().cuda(), OptimizerConfig(lr=1e-3), num_training_steps=2)
    loss_fn = loss_fn_from_config(AlgorithmConfig())
    extra = {"advantages": [0.5, -1.0, 0.2, 1.0]}
    micro_batches = [packed_batch(seqs, extra=extra), padded_batch(seqs, extra=extra)]
    forward_backward(components, micro_batches, loss_fn, num_tokens=20, num_sequences=8)  # warm-up
    from rollouts.backends.train import step as step_module

    read = step_module.floats_of
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:  # every sync raises, except the step's one read of its metrics at the end
        step_module.floats_of = lambda values: (torch.cuda.set_sync_debug_mode(0), read(values))[1]
        forward_backward(components, [micro_batches[0]], loss_fn, num_tokens=20, num_sequences=8)
    finally:
        step_module.floats_of = read
        torch.cuda.set_sync_debug_mode(0)
