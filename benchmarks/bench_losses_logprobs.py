"""Log-prob memory and speed: fused_token_logprobs vs naive log_softmax(hidden @ W.T).gather, forward + backward.

Sizes are a Qwen2-0.5B output layer on GRPO micro-batches: V=151936, H=896,
float32 on CPU, one thread (OMP_NUM_THREADS=1 / torch.set_num_threads(1)) so that other work on
the machine blurs the comparison as little as possible.

Method
- Every measurement runs in its own fresh subprocess (one forward + backward), so one variant's
  freed memory cannot hide the other's peak; the variants alternate (naive, fused, fused, naive,
  ...) so that load from other work on the machine drifts over both alike. In each: build the
  inputs (hidden [B, T, H] and W [V, H], both requiring grad), run one tiny forward + backward of
  the same variant (4 tokens, 64 vocabulary rows) so that one-off library set-up is not billed to
  either, read the resident set size (RSS, /proc/self/statm) and reset the kernel's peak-RSS mark
  (/proc/self/clear_refs), run forward + backward, then read the peak (VmHWM, /proc/self/status).
  Peak memory beyond the inputs = peak RSS - RSS before the step - bytes of what both variants
  must return (the gradients of hidden and W, and the [B, T] log-probs; the V x H gradient of W
  alone is 0.54 GB). The same definition on both sides, forward + backward; the peak reached by the
  end of the forward (when no gradient exists yet, so nothing is subtracted but the log-probs) is
  printed too, so memory held from forward to backward shows even where the gradients' bytes
  would cover it. Large CPU tensors are
  mmap'd by the allocator and returned to the OS when freed, so RSS tracks live tensors.
- The naive variant is the minimal one, log_softmax(hidden @ W.T).gather with nothing else kept
  (its logits die once log_softmax has its output), so its peak is what autograd itself needs.
- Time: CPU seconds of the process (user + system, one thread) for the forward + backward, median
  over `--repeats` subprocesses; the goal is judged on CPU seconds, which other work on a shared
  machine disturbs less than wall time (also printed).
- Naive holds about 2 K x V float32 tensors at its peak; a shape where 3 of them (plus the inputs
  and 2 GB to spare) do not fit in the memory the system reports available is run for the fused
  variant only, and says so.
- Gradients: each variant writes its gradients to a temporary directory; the parent compares
  them as relative errors ||ours - naive|| / ||naive|| (Frobenius) and max |ours - naive| / max |naive|.
  Both variants are float32, so this measures their agreement, not either's distance to exact;
  so the gradient of the hidden states (token t's depends only on token t) is also checked on the
  first `--exact-tokens` tokens against a float64 computation.

Sizes: by default 1k, 2k, 4k and 8k tokens (B x T = 2x512, 4x512, 4x1024, 8x1024), the fused variant
with its adaptive block shape (fused_block_shape); the goal is memory beyond inputs <= 1/8 of naive and time <= 1.1x naive at
every size from 1k tokens.

Run: uv run python benchmarks/bench_losses_logprobs.py [--shapes 2x512,4x1024 --vocab 151936 --hidden 896]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
_GB = 1024.0**3
_NAIVE_KV_TENSORS = 3
"""K x V float32 tensors to expect naive to hold at its peak, with a margin (measured: 2.1 at 1k tokens)."""
_SPARE_BYTES = 2 * 2**30
"""Memory left to the rest of the machine when deciding whether naive can run."""


def _rss_bytes() -> int:
    """Current resident set size of this process."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE_BYTES


def _reset_peak_rss() -> None:
    """Reset the kernel's peak-RSS mark (VmHWM) to the current RSS (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _status_kib(field: str, path: str = "/proc/self/status") -> int:
    """A 'Field: N kB' line of /proc/self/status or /proc/meminfo, in KiB."""
    with open(path) as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not found in {path}")


def _inputs(args: argparse.Namespace):  # noqa: ANN202
    """(hidden [B, T, H], W [V, H], labels [B, T], upstream gradient [B, T]), seeded."""
    import torch

    g = torch.Generator().manual_seed(0)
    b, t, v, h = args.batch, args.tokens, args.vocab, args.hidden
    hidden = torch.randn(b, t, h, generator=g)
    weight = torch.randn(v, h, generator=g) * 0.05
    labels = torch.randint(0, v, (b, t), generator=g)
    upstream = torch.randn(b, t, generator=g) / (b * t)
    return hidden, weight, labels, upstream


def _step(variant: str, hidden, weight, labels, upstream):  # noqa: ANN001, ANN202
    """One forward + backward; returns the [B, T] log-probs (the output both variants hold) and the
    peak RSS (bytes) reached by the end of the forward."""
    import torch

    from rollouts.losses import fused_token_logprobs

    if variant == "naive":
        # nothing but the autograd graph keeps the logits: they die once log_softmax has its output
        logp = torch.log_softmax(hidden @ weight.T, dim=-1).gather(-1, labels[..., None]).squeeze(-1)
    else:
        logp = fused_token_logprobs(hidden, weight, labels)
    forward_peak = _status_kib("VmHWM") * 1024
    (logp * upstream).sum().backward()
    return logp.detach(), forward_peak


def run_variant(args: argparse.Namespace) -> None:
    """Child process: time and measure one variant, save its gradients, print a JSON line."""
    import torch

    torch.set_num_threads(1)
    hidden, weight, labels, upstream = _inputs(args)
    hidden.requires_grad_()
    weight.requires_grad_()
    tiny = [x.detach()[:1, :4].clone().requires_grad_(x.requires_grad) for x in (hidden, labels, upstream)]
    _step(args.variant, tiny[0], weight.detach()[:64].clone().requires_grad_(), tiny[1] % 64, tiny[2])  # warm-up
    del tiny
    baseline_rss = _rss_bytes()
    _reset_peak_rss()
    cpu_start, wall_start = time.process_time(), time.perf_counter()
    logp, forward_peak = _step(args.variant, hidden, weight, labels, upstream)
    cpu_s, wall_s = time.process_time() - cpu_start, time.perf_counter() - wall_start
    peak = _status_kib("VmHWM") * 1024
    returned_bytes = (hidden.numel() + weight.numel() + logp.numel()) * 4
    out = Path(args.out_dir)
    hidden.grad.numpy().tofile(out / f"{args.variant}_hidden.f32")
    weight.grad.numpy().tofile(out / f"{args.variant}_weight.f32")
    result = {"variant": args.variant, "cpu_s": cpu_s, "wall_s": wall_s}
    result["forward_peak_bytes"] = forward_peak - baseline_rss - logp.numel() * 4
    print(json.dumps(result | {"extra_peak_bytes": peak - baseline_rss - returned_bytes}))


def _spawn(args: argparse.Namespace, variant: str, out_dir: str) -> dict:
    """Run one variant in a fresh subprocess and parse its JSON line."""
    cmd = [sys.executable, __file__, "--variant", variant, "--out-dir", out_dir]
    for flag in ("batch", "tokens", "vocab", "hidden"):
        cmd += [f"--{flag}", str(getattr(args, flag))]
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout_s, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{variant} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _compare(out_dir: str, name: str) -> tuple[float, float]:
    """(relative Frobenius error, max abs error / max abs) of the fused gradient vs naive's."""
    import numpy as np

    ours = np.fromfile(Path(out_dir) / f"fused_{name}.f32", dtype=np.float32).astype(np.float64)
    ref = np.fromfile(Path(out_dir) / f"naive_{name}.f32", dtype=np.float32).astype(np.float64)
    return float(np.linalg.norm(ours - ref) / np.linalg.norm(ref)), float(np.abs(ours - ref).max() / np.abs(ref).max())


def _exact_hidden_grad_errors(args: argparse.Namespace, out_dir: str, variants: tuple[str, ...]) -> dict[str, float]:
    """Relative error (Frobenius) of each variant's hidden-state gradient on the first tokens vs float64."""
    import numpy as np
    import torch

    hidden, weight, labels, upstream = _inputs(args)
    k, h = args.exact_tokens, args.hidden
    h64 = hidden.reshape(-1, h)[:k].double().requires_grad_()
    logp = torch.log_softmax(h64 @ weight.double().T, dim=-1).gather(-1, labels.reshape(-1)[:k, None]).squeeze(-1)
    (logp * upstream.reshape(-1)[:k].double()).sum().backward()
    ref = h64.grad.numpy()
    errors = {}
    for variant in variants:
        ours = (
            np.fromfile(Path(out_dir) / f"{variant}_hidden.f32", dtype=np.float32, count=k * h)
            .reshape(k, h)
            .astype(np.float64)
        )
        errors[variant] = float(np.linalg.norm(ours - ref) / np.linalg.norm(ref))
    return errors


def _naive_fits(args: argparse.Namespace) -> tuple[bool, float]:
    """(whether naive's estimated peak fits in MemAvailable, that estimate in bytes)."""
    k = args.batch * args.tokens
    need = (_NAIVE_KV_TENSORS * k * args.vocab + 3 * args.vocab * args.hidden + 3 * k * args.hidden) * 4
    return need + _SPARE_BYTES < _status_kib("MemAvailable", "/proc/meminfo") * 1024, need


def _measure(args: argparse.Namespace, variants: tuple[str, ...]) -> dict:
    """Alternate the variants' subprocesses at one shape; medians, peak memory and gradient errors."""
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory() as out_dir:
        for r in range(args.repeats):
            for variant in variants if r % 2 == 0 else variants[::-1]:
                runs[variant].append(_spawn(args, variant, out_dir))
                x = runs[variant][-1]
                print(f"  run {r}: {variant} {x['cpu_s']:.2f} CPU s, {x['wall_s']:.2f} s wall", flush=True)
        errors = {name: _compare(out_dir, name) for name in ("hidden", "weight")} if len(variants) == 2 else {}
        exact = _exact_hidden_grad_errors(args, out_dir, variants)
    summary = {
        v: {
            "cpu_s": statistics.median(x["cpu_s"] for x in runs[v]),
            "wall_s": statistics.median(x["wall_s"] for x in runs[v]),
            "all_cpu_s": [x["cpu_s"] for x in runs[v]],
            "extra_peak_bytes": max(x["extra_peak_bytes"] for x in runs[v]),
            "forward_peak_bytes": max(x["forward_peak_bytes"] for x in runs[v]),
        }
        for v in variants
    }
    return {**summary, "errors": errors, "exact": exact}


def _report(args: argparse.Namespace, m: dict) -> tuple[float, float] | None:
    """Print one shape's table; return (CPU time ratio, memory ratio) fused / naive, None without naive."""
    fused, naive = m["fused"], m.get("naive")
    cols = [("naive", naive), ("fused", fused)] if naive else [("fused", fused)]
    print(f"{'':<34}" + "".join(f"{name:>12}" for name, _ in cols) + (f"{'fused/naive':>14}" if naive else ""))
    rows = [
        ("CPU time, median (s)", "cpu_s", 1.0, ".2f", ".3f"),
        ("wall time, median (s)", "wall_s", 1.0, ".2f", ".3f"),
        ("peak beyond inputs+outputs (GB)", "extra_peak_bytes", _GB, ".3f", ".4f"),
        ("peak by end of forward (GB)", "forward_peak_bytes", _GB, ".3f", ".4f"),
    ]
    for label, key, unit, fmt, ratio_fmt in rows:
        line = f"{label:<34}" + "".join(f"{x[key] / unit:>12{fmt}}" for _, x in cols)
        print(line + (f"{fused[key] / naive[key]:>14{ratio_fmt}}" if naive else ""))
    print("all CPU times (s): " + " | ".join(f"{n} " + ", ".join(f"{t:.2f}" for t in x["all_cpu_s"]) for n, x in cols))
    for name, (fro, mx) in m["errors"].items():
        print(f"grad {name:<7} relative error vs naive: frobenius {fro:.2e}, max-abs {mx:.2e}")
    exact = ", ".join(f"{v} {e:.2e}" for v, e in m["exact"].items())
    print(f"grad hidden, first {args.exact_tokens} tokens, relative error vs float64: {exact}")
    if not naive:
        return None
    return fused["cpu_s"] / naive["cpu_s"], fused["extra_peak_bytes"] / naive["extra_peak_bytes"]


def main() -> None:
    """Parent: run both variants at each shape, compare, print the figures side by side and against the goals."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="2x512,4x512,4x1024,8x1024", help="comma-separated BxT shapes")
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--hidden", type=int, default=896)
    p.add_argument("--repeats", type=int, default=3, help="forward+backward runs (subprocesses) per variant")
    p.add_argument("--exact-tokens", type=int, default=64, help="tokens whose hidden gradient is checked in float64")
    p.add_argument("--timeout-s", type=float, default=3600.0, help="bound on each variant's subprocess")
    p.add_argument("--variant", choices=["naive", "fused"], help=argparse.SUPPRESS)
    p.add_argument("--out-dir", help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, default=2, help=argparse.SUPPRESS)
    p.add_argument("--tokens", type=int, default=512, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.variant:
        run_variant(args)
        return
    from rollouts.losses import fused_block_shape

    rows = []
    for shape in args.shapes.split(","):
        args.batch, args.tokens = (int(x) for x in shape.lower().split("x"))
        k = args.batch * args.tokens
        fits, need = _naive_fits(args)
        print(
            f"\nB={args.batch} T={args.tokens} V={args.vocab} H={args.hidden} float32 CPU, 1 thread, "
            f"forward+backward, {args.repeats} runs each, fused block (C, U) = {fused_block_shape(k, args.vocab)}",
            flush=True,
        )
        if not fits:
            print(f"naive not run: needs about {need / _GB:.1f} GB, more than this machine has available")
        rows.append((k, _report(args, _measure(args, ("naive", "fused") if fits else ("fused",)))))
    print(f"\n{'tokens':>8}{'CPU time fused/naive':>22}{'memory fused/naive':>20}   goal: time <= 1.1, memory <= 0.125")
    for tokens, ratios in rows:
        if ratios is None:
            print(f"{tokens:>8}{'-':>22}{'-':>20}   naive not run (memory), goal not judged")
            continue
        ok = "met" if ratios[0] <= 1.1 and ratios[1] <= 0.125 else "NOT met"
        print(f"{tokens:>8}{ratios[0]:>22.3f}{ratios[1]:>20.4f}   {ok}")
    print("gradient relative error vs naive goal: <= 1e-5")


if __name__ == "__main__":
    main()
