"""rollouts-data benchmarks: packing efficiency and AsyncRolloutManager overhead.

1. Padding waste on a long-tailed length mix (16..4096 tokens, log-normal): padded micro-batches
   in arrival order (the common baseline), our padded planner (length-sorted), next-fit packing in
   arrival order, and our best-fit-decreasing packing. Waste = token slots of the micro-batch
   budget not holding a real token. Target: packed < 5%.
2. AsyncRolloutManager wall time for 256 one-sample requests at concurrency 64 with a generate
   function that sleeps 50 ms (async and sync/threaded), vs the ideal 256/64 x 50 ms = 200 ms and
   vs a bare trio nursery + CapacityLimiter doing the same calls. Target: within 1.3x of ideal.
3. Chat tokenization of 20-message conversations (a locally trained byte-level BPE, ChatML, and the
   same template with {% generation %} markup): tokenize_conversation vs the previous algorithm
   (render and tokenize every prefix, kept below as the baseline), same masks asserted.
   Target: >= 10x faster.

Run: OMP_NUM_THREADS=1 uv run --package rollouts-data python benchmarks/bench_data.py
"""

from __future__ import annotations

import os
import statistics
import time
from functools import partial

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
import trio

from rollouts.data import AsyncRolloutManager, DataBuffer, best_fit_decreasing, plan_micro_batches
from rollouts.types import RolloutConfig, Sample, Status

NUM_SAMPLES = 1024
MAX_TOKENS = 16384  # micro-batch token budget: four longest samples
MIN_LEN, MAX_LEN = 16, 4096
REPEATS = 5


def long_tailed_lengths(seed: int) -> list[int]:
    """Log-normal lengths (median ~400 tokens, long tail), clipped to [16, 4096]."""
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(6.0, 1.0, size=NUM_SAMPLES), MIN_LEN, MAX_LEN).astype(int).tolist()


def samples_of(lengths: list[int]) -> list[Sample]:
    return [
        Sample(tokens=[1] * n, num_prompt_tokens=n // 2, loss_mask=[0.0] * (n // 2) + [1.0] * (n - n // 2))
        for n in lengths
    ]


def padded_arrival_order(lengths: list[int]) -> tuple[int, int]:
    """Micro-batches filled in arrival order while rows * longest <= budget: (tensor slots, micro-batches)."""
    slots, num, batch = 0, 0, []
    for n in lengths:
        if batch and (len(batch) + 1) * max(*batch, n) > MAX_TOKENS:
            slots, num, batch = slots + len(batch) * max(batch), num + 1, []
        batch.append(n)
    return slots + len(batch) * max(batch), num + 1


def next_fit_bins(lengths: list[int]) -> int:
    bins, load = 0, MAX_TOKENS
    for n in lengths:
        if load + n > MAX_TOKENS:
            bins, load = bins + 1, 0
        load += n
    return bins


def bench_packing() -> None:
    """Two waste figures per layout: padding inside the tensors, and budget left unused (micro-batches x budget)."""
    names = (
        "padded, arrival order",
        "padded, planner (sorted)",
        "packed, next-fit arrival order",
        "packed, best-fit-decreasing (ours)",
    )
    pad_frac: dict[str, list[float]] = {k: [] for k in names}
    budget_frac: dict[str, list[float]] = {k: [] for k in names}
    plan_s, bfd_s = [], []
    for seed in range(REPEATS):
        lengths = long_tailed_lengths(seed)
        real = sum(lengths)
        samples = samples_of(lengths)
        slots, num = padded_arrival_order(lengths)
        pad_frac[names[0]].append(1 - real / slots)
        budget_frac[names[0]].append(1 - real / (num * MAX_TOKENS))
        padded = plan_micro_batches(samples, max_tokens=MAX_TOKENS, layout="padded")
        pad_frac[names[1]].append(padded.num_padding_tokens / (padded.num_padding_tokens + real))
        budget_frac[names[1]].append(1 - real / (len(padded.micro_batches) * MAX_TOKENS))
        nf = next_fit_bins(lengths)
        pad_frac[names[2]].append(0.0)
        budget_frac[names[2]].append(1 - real / (nf * MAX_TOKENS))
        t0 = time.perf_counter()
        bins = best_fit_decreasing(lengths, capacity=MAX_TOKENS)
        bfd_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        packed = plan_micro_batches(samples, max_tokens=MAX_TOKENS, layout="packed")
        plan_s.append(time.perf_counter() - t0)
        assert len(packed.micro_batches) == len(bins)
        pad_frac[names[3]].append(packed.num_padding_tokens / (packed.num_padding_tokens + real))
        budget_frac[names[3]].append(1 - real / (len(bins) * MAX_TOKENS))
    lengths = long_tailed_lengths(0)
    print(
        f"== packing: {NUM_SAMPLES} samples, lengths {MIN_LEN}..{MAX_LEN} log-normal "
        f"(median {int(np.median(lengths))}, mean {int(np.mean(lengths))}, p99 {int(np.percentile(lengths, 99))}), "
        f"budget {MAX_TOKENS} tokens/micro-batch, median of {REPEATS} draws"
    )
    print(f"{'layout':38s} {'pad / tensor slots':>19s} {'unused budget':>14s}")
    for name in names:
        pad, unused = statistics.median(pad_frac[name]), statistics.median(budget_frac[name])
        print(f"{name:38s} {100 * pad:18.2f}% {100 * unused:13.2f}%")
    worst = max(statistics.median(pad_frac[names[3]]), statistics.median(budget_frac[names[3]]))
    print(f"target packed < 5% (either measure): {'met' if worst < 0.05 else 'NOT met'}")
    print(
        f"best_fit_decreasing time: {1e3 * statistics.median(bfd_s):.2f} ms; "
        f"plan_micro_batches(packed) incl. array building: {1e3 * statistics.median(plan_s):.1f} ms"
    )


SLEEP_S = 0.05
NUM_REQUESTS = 256
CONCURRENCY = 64


def _sample(prompt: int) -> list[Sample]:
    return [
        Sample(prompt=str(prompt), tokens=[1, 2, 3], num_prompt_tokens=2, loss_mask=[0, 0, 1], status=Status.COMPLETED)
    ]


async def async_gen(prompt: int, n: int) -> list[Sample]:
    await trio.sleep(SLEEP_S)
    return _sample(prompt)


def sync_gen(prompt: int, n: int) -> list[Sample]:
    time.sleep(SLEEP_S)
    return _sample(prompt)


async def bare_nursery(*, threaded: bool = False) -> None:
    limiter = trio.CapacityLimiter(CONCURRENCY)
    thread_limiter = trio.CapacityLimiter(CONCURRENCY)  # trio's default thread limit is 40
    results = []

    async def one(p: int) -> None:
        async with limiter:
            if threaded:
                results.append(await trio.to_thread.run_sync(sync_gen, p, 1, limiter=thread_limiter))
            else:
                results.append(await async_gen(p, 1))

    async with trio.open_nursery() as nursery:
        for p in range(NUM_REQUESTS):
            nursery.start_soon(one, p)
    assert len(results) == NUM_REQUESTS


def _time_trio(fn) -> float:
    t0 = time.perf_counter()
    trio.run(fn)
    return time.perf_counter() - t0


def bench_manager() -> None:
    ideal = NUM_REQUESTS / CONCURRENCY * SLEEP_S
    config = RolloutConfig(
        batch_size=NUM_REQUESTS, samples_per_prompt=1, max_concurrency=CONCURRENCY, request_timeout_s=10.0
    )

    def manager_run(gen):
        manager = AsyncRolloutManager(DataBuffer(list(range(1000))), config, gen)

        async def run():
            batch = await manager.generate_batch(step=0)
            assert batch.num_kept == NUM_REQUESTS

        return run

    print(
        f"\n== AsyncRolloutManager: {NUM_REQUESTS} requests x 1 sample, concurrency {CONCURRENCY}, "
        f"generate sleeps {1e3 * SLEEP_S:.0f} ms; ideal {1e3 * ideal:.0f} ms; median of {REPEATS}"
    )
    print(f"{'runner':42s} {'wall ms':>9s} {'x ideal':>8s}")
    for name, fn in (
        ("bare nursery + limiter, async (baseline)", bare_nursery),
        ("AsyncRolloutManager, async generate_fn", manager_run(async_gen)),
        ("bare nursery + to_thread, sync (baseline)", partial(bare_nursery, threaded=True)),
        ("AsyncRolloutManager, sync generate_fn", manager_run(sync_gen)),
    ):
        wall = statistics.median(_time_trio(fn) for _ in range(REPEATS))
        print(f"{name:42s} {1e3 * wall:9.1f} {wall / ideal:8.3f}")
    print("target: within 1.3x of ideal")


CHATML = (
    "{%- for message in messages %}"
    "{%- if loop.first and message['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
CHATML_GENERATION = CHATML.replace(
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}",
    "{%- if message['role'] == 'assistant' %}{{- '<|im_start|>assistant\\n' }}{% generation %}"
    "{{- message['content'] + '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{%- endif %}",
)
NUM_CONVERSATIONS = 20
NUM_MESSAGES = 20
WORDS = "the answer is because six times seven please add numbers explain result hello world reasoning".split()


def chat_tokenizer(template: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=2000,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([" ".join(WORDS)] * 50, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    hf.chat_template = template
    return hf


def conversations(seed: int) -> list[list[dict]]:
    """20-message conversations (a system turn, then user/assistant), 20 to 120 words per message."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(NUM_CONVERSATIONS):
        roles = ["system"] + ["user", "assistant"] * ((NUM_MESSAGES - 1) // 2) + ["user"]
        roles[-1] = "assistant"
        out.append(
            [{"role": r, "content": " ".join(rng.choice(WORDS, size=int(rng.integers(20, 120))))} for r in roles]
        )
    return out


def prefix_algorithm(messages, tok):
    """The previous tokenize_conversation mask (train_on="assistant"): render and tokenize every prefix."""

    def ids(msgs, gen=False):
        return list(tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=gen, return_dict=False))

    full = ids(messages)
    for k in range(1, len(messages)):
        assert full[: len(p := ids(messages[:k]))] == p, "prefix property"
    mask = [0.0] * len(full)
    for i in (i for i, m in enumerate(messages) if m["role"] == "assistant"):
        start = ids(messages[:i], gen=True)
        assert full[: len(start)] == start, "prefix property"
        end = len(ids(messages[: i + 1])) if i + 1 < len(messages) else len(full)
        while end > len(start) and tok.decode([full[end - 1]], skip_special_tokens=False).strip() == "":
            end -= 1
        mask[len(start) : end] = [1.0] * (end - len(start))
    mask[0] = 0.0
    return full, mask


def bench_chat() -> None:
    from rollouts.data import tokenize_conversation

    convs = conversations(0)
    print(
        f"\n== Chat tokenization: {NUM_CONVERSATIONS} conversations x {NUM_MESSAGES} messages; ms per "
        f"conversation, median of {REPEATS}"
    )
    print(f"{'template':22s} {'prefixes (old)':>15s} {'ours':>9s} {'speed-up':>9s}")
    for name, template in (("chatml (incremental)", CHATML), ("chatml {% generation %}", CHATML_GENERATION)):
        tok = chat_tokenizer(template)
        for m in convs:  # same masks, before timing anything
            s = tokenize_conversation(m, tok, max_length=1 << 20)
            assert (list(s.tokens), list(s.loss_mask)) == prefix_algorithm(m, tok)

        def per_conversation_ms(fn):
            t0 = time.perf_counter()
            for m in convs:
                fn(m)
            return 1e3 * (time.perf_counter() - t0) / len(convs)

        old = statistics.median(per_conversation_ms(lambda m: prefix_algorithm(m, tok)) for _ in range(REPEATS))
        new = statistics.median(
            per_conversation_ms(lambda m: tokenize_conversation(m, tok, max_length=1 << 20)) for _ in range(REPEATS)
        )
        print(f"{name:22s} {old:15.2f} {new:9.2f} {old / new:8.1f}x")
    print("target: >= 10x")


if __name__ == "__main__":
    bench_packing()
    bench_manager()
    bench_chat()
