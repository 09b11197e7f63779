"""Log-prob memory and speed: fused_token_logprobs vs naive log_softmax(hidden @ W.T).gather, forward + backward.

Sizes are a Qwen2-0.5B output layer on GRPO micro-batches: V=151936, H=896,
float32 on CPU, one thread (OMP_NUM_THREADS=1 / torch.set_num_threads(1)) so that other work on
the machine blurs the comparison as little as possible.

Method
- Every measurement runs in its own fresh subprocess (one forward + backward), so one variant's
  freed memory cannot hide the other's peak; the variants alternate (naive, fused, fused, naive,
  ...) so that load from other work on the machine drifts over both alike. In each: build the
  inputs (hidden [B, T, H] and W [V, H], both requiring grad), read the resident set size (RSS,
  /proc/self/statm), run forward + backward, then read the process's peak RSS (getrusage ru_maxrss). Peak memory beyond the inputs and their
  gradients = peak RSS - RSS after building the inputs - bytes of the two gradients (the V x H
  gradient of W alone is 0.54 GB and unavoidable). Large CPU tensors are mmap'd by the allocator
  and returned to the OS when freed, so RSS tracks live tensors.
- Wall time: the median over `--repeats` subprocesses of one forward + backward.
- Gradients: each variant writes its gradients to a temporary directory; the parent compares
  them as relative errors ||ours - naive|| / ||naive|| (Frobenius) and max |ours - naive| / max |naive|.
  Both variants are float32, so this measures their agreement, not either's distance to exact;
  so the gradient of the hidden states (token t's depends only on token t) is also checked on the
  first `--exact-tokens` tokens against a float64 computation.

Sizes: by default 1k, 2k and 4k tokens (B x T = 2x512, 4x512, 4x1024), the fused variant with its
adaptive chunk size; the goal is memory beyond inputs <= 1/8 of naive and time <= 1.1x naive at
every size from 1k tokens.

Run: uv run python benchmarks/bench_losses_logprobs.py [--shapes 2x512,4x1024 --vocab 151936 --hidden 896]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
_GB = 1024.0**3


def _rss_bytes() -> int:
    """Current resident set size of this process."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE_BYTES


def _peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


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


def run_variant(args: argparse.Namespace) -> None:
    """Child process: time and measure one variant, save its gradients, print a JSON line."""
    import torch

    torch.set_num_threads(1)
    from rollouts.losses import fused_token_logprobs

    hidden, weight, labels, upstream = _inputs(args)
    hidden.requires_grad_()
    weight.requires_grad_()
    baseline_rss = _rss_bytes()
    grad_bytes = (hidden.numel() + weight.numel()) * 4

    def step() -> None:
        hidden.grad, weight.grad = None, None
        if args.variant == "naive":
            logits = hidden @ weight.T
            logp = torch.log_softmax(logits, dim=-1).gather(-1, labels[..., None]).squeeze(-1)
        else:
            logp = fused_token_logprobs(hidden, weight, labels, chunk_size=args.chunk_size or None)
        (logp * upstream).sum().backward()

    start = time.perf_counter()
    step()
    elapsed = time.perf_counter() - start
    peak = _peak_rss_bytes()
    out = Path(args.out_dir)
    hidden.grad.numpy().tofile(out / f"{args.variant}_hidden.f32")
    weight.grad.numpy().tofile(out / f"{args.variant}_weight.f32")
    print(
        json.dumps({"variant": args.variant, "time_s": elapsed, "extra_peak_bytes": peak - baseline_rss - grad_bytes})
    )


def _spawn(args: argparse.Namespace, variant: str, out_dir: str) -> dict:
    """Run one variant in a fresh subprocess and parse its JSON line."""
    cmd = [
        sys.executable,
        __file__,
        "--variant",
        variant,
        "--out-dir",
        out_dir,
        "--batch",
        str(args.batch),
        "--tokens",
        str(args.tokens),
        "--vocab",
        str(args.vocab),
        "--hidden",
        str(args.hidden),
        "--chunk-size",
        str(args.chunk_size),
        "--exact-tokens",
        str(args.exact_tokens),
    ]
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


def _exact_hidden_grad_errors(args: argparse.Namespace, out_dir: str) -> dict[str, float]:
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
    for variant in ("naive", "fused"):
        ours = (
            np.fromfile(Path(out_dir) / f"{variant}_hidden.f32", dtype=np.float32, count=k * h)
            .reshape(k, h)
            .astype(np.float64)
        )
        errors[variant] = float(np.linalg.norm(ours - ref) / np.linalg.norm(ref))
    return errors


def _measure(args: argparse.Namespace) -> dict:
    """Alternate naive and fused subprocesses at one shape; medians, peak memory and gradient errors."""
    runs: dict[str, list[dict]] = {"naive": [], "fused": []}
    with tempfile.TemporaryDirectory() as out_dir:
        for r in range(args.repeats):
            for variant in ("naive", "fused") if r % 2 == 0 else ("fused", "naive"):
                runs[variant].append(_spawn(args, variant, out_dir))
                print(f"  run {r}: {variant} {runs[variant][-1]['time_s']:.2f} s", flush=True)
        errors = {name: _compare(out_dir, name) for name in ("hidden", "weight")}
        exact = _exact_hidden_grad_errors(args, out_dir)
    summary = {
        v: {
            "median_s": statistics.median(x["time_s"] for x in runs[v]),
            "times_s": [x["time_s"] for x in runs[v]],
            "extra_peak_bytes": max(x["extra_peak_bytes"] for x in runs[v]),
        }
        for v in ("naive", "fused")
    }
    return {**summary, "errors": errors, "exact": exact}


def _report(args: argparse.Namespace, m: dict) -> tuple[float, float]:
    """Print one shape's table; return (time ratio, memory ratio) fused / naive."""
    naive, fused = m["naive"], m["fused"]
    time_ratio = fused["median_s"] / naive["median_s"]
    mem_ratio = fused["extra_peak_bytes"] / naive["extra_peak_bytes"]
    print(f"{'':<34}{'naive':>12}{'fused':>12}{'fused/naive':>14}")
    print(f"{'wall time, median (s)':<34}{naive['median_s']:>12.2f}{fused['median_s']:>12.2f}{time_ratio:>14.3f}")
    print(
        f"{'peak beyond inputs+grads (GB)':<34}{naive['extra_peak_bytes'] / _GB:>12.3f}"
        f"{fused['extra_peak_bytes'] / _GB:>12.3f}{mem_ratio:>14.4f}"
    )
    print(
        "all times (s): naive "
        + ", ".join(f"{x:.2f}" for x in naive["times_s"])
        + " | fused "
        + ", ".join(f"{x:.2f}" for x in fused["times_s"])
    )
    for name, (fro, mx) in m["errors"].items():
        print(f"grad {name:<7} relative error vs naive: frobenius {fro:.2e}, max-abs {mx:.2e}")
    print(
        f"grad hidden, first {args.exact_tokens} tokens, relative error vs float64: "
        f"naive {m['exact']['naive']:.2e}, fused {m['exact']['fused']:.2e}"
    )
    return time_ratio, mem_ratio


def main() -> None:
    """Parent: run both variants at each shape, compare, print the figures side by side and against the goals."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="2x512,4x512,4x1024", help="comma-separated BxT shapes (1k, 2k, 4k tokens)")
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--hidden", type=int, default=896)
    p.add_argument("--repeats", type=int, default=3, help="forward+backward runs (subprocesses) per variant")
    p.add_argument("--chunk-size", type=int, default=0, help="tokens per chunk for the fused variant (0: adaptive)")
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
    rows = []
    for shape in args.shapes.split(","):
        args.batch, args.tokens = (int(x) for x in shape.lower().split("x"))
        print(
            f"B={args.batch} T={args.tokens} V={args.vocab} H={args.hidden} float32 CPU, 1 thread, "
            f"forward+backward, {args.repeats} runs each, fused chunk_size="
            f"{args.chunk_size or 'adaptive'}",
            flush=True,
        )
        rows.append((args.batch * args.tokens, *_report(args, _measure(args))))
    print(f"\n{'tokens':>8}{'time fused/naive':>18}{'memory fused/naive':>20}   goal: time <= 1.1, memory <= 0.125")
    for tokens, time_ratio, mem_ratio in rows:
        ok = "met" if time_ratio <= 1.1 and mem_ratio <= 0.125 else "NOT met"
        print(f"{tokens:>8}{time_ratio:>18.3f}{mem_ratio:>20.4f}   {ok}")
    print("gradient relative error vs naive goal: <= 1e-5")


if __name__ == "__main__":
    main()
