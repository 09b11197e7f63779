"""Test helper: the same sequences laid out padded ([B, T], one per row) and packed ([1, sum of lengths])."""

import torch


def padded(seqs):
    """List of dicts of 1-D tensors (equal lengths per dict) -> dict of [B, T] tensors, 0 padding, plus segment_ids."""
    t = max(len(next(iter(s.values()))) for s in seqs)
    out = {}
    for key in seqs[0]:
        rows = [torch.cat([s[key], s[key].new_zeros(t - len(s[key]))]) for s in seqs]
        out[key] = torch.stack(rows)
    seg = torch.full((len(seqs), t), -1)
    for i, s in enumerate(seqs):
        seg[i, : len(next(iter(s.values())))] = i
    out["segment_ids"] = seg
    return out


def packed(seqs, *, pad=0):
    """List of dicts of 1-D tensors -> dict of [1, total + pad] tensors and segment_ids (-1 on the pad tail)."""
    out = {key: torch.cat([s[key] for s in seqs] + [seqs[0][key].new_zeros(pad)])[None] for key in seqs[0]}
    ids = [torch.full((len(next(iter(s.values()))),), i) for i, s in enumerate(seqs)]
    out["segment_ids"] = torch.cat(ids + [torch.full((pad,), -1)])[None]
    return out


def random_seqs(seed, lengths, *, dtype=torch.float64):
    """Sequences with logprobs, old/ref/rollout logprobs, advantages (constant per sequence) and a loss mask."""
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for n in lengths:
        mask = (torch.rand(n, generator=g) > 0.3).to(dtype)
        mask[0] = 0.0  # position 0 has no prediction
        logp = -torch.rand(n, generator=g, dtype=dtype) * 3
        seqs.append(
            {
                "logprobs": logp,
                "old_logprobs": logp + 0.3 * torch.randn(n, generator=g, dtype=dtype),
                "ref_logprobs": logp + 0.3 * torch.randn(n, generator=g, dtype=dtype),
                "rollout_logprobs": logp + 0.3 * torch.randn(n, generator=g, dtype=dtype),
                "advantages": torch.randn((), generator=g, dtype=dtype).expand(n).clone(),
                "loss_mask": mask,
                "values": torch.randn(n, generator=g, dtype=dtype),
                "entropy": torch.rand(n, generator=g, dtype=dtype),
            }
        )
    return seqs


def micro_batch(layout):
    """A layout's arrays as the MicroBatch a LossFn takes (logprobs and entropy left out: the trainer
    passes those separately). Token ids, positions and the attention mask are derived from segment_ids;
    arrays that are not MicroBatch fields (e.g. values) go to extras."""
    import dataclasses

    from rollouts.types import MicroBatch

    seg = layout["segment_ids"]
    real = seg >= 0
    positions = torch.zeros_like(seg)
    for row in range(seg.shape[0]):
        for s in seg[row][real[row]].unique():
            where = seg[row] == s
            positions[row, where] = torch.arange(int(where.sum()))
    names = {f.name for f in dataclasses.fields(MicroBatch)}
    arrays = {k: v for k, v in layout.items() if k not in ("logprobs", "entropy", "segment_ids")}
    return MicroBatch(
        input_ids=torch.zeros_like(seg),
        position_ids=positions,
        segment_ids=seg,
        attention_mask=real.long(),
        sample_indices=torch.arange(int(seg.max()) + 1),
        **{k: v for k, v in arrays.items() if k in names},
        extras={k: v for k, v in arrays.items() if k not in names},
    )
