"""InProcessEngine: the in-process sampler (`generate`) behind rollouts-types' InferenceEngine
protocol, for runs without an inference server and for tests."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch

from rollouts.backends.checkpoint.export import load_model_weights, read_weights
from rollouts.backends.checkpoint.lora_files import ADAPTER_CONFIG, load_adapter_dir
from rollouts.backends.sampling.sampler import check_prompts, generate
from rollouts.types import Sample, SamplingParams

__all__ = ["InProcessEngine"]


class InProcessEngine:
    """The in-process sampler behind rollouts-types' InferenceEngine protocol.

    With `shares_training_model` the engine samples from the very module being trained, so a
    weight update is a no-op that records the version; otherwise updates load HF safetensors
    from the checkpoint directory into the engine's own model. Its core is synchronous (`sample`,
    the SyncSampler protocol: rollouts.loops' CoalescingEngine runs it in a worker thread); the
    async `generate` runs it in the calling thread (it blocks the event loop for the call's
    duration). It is Abortable and a WeightLoader.

    `abort()` (from any thread) ends generations in progress at their next token step: the rows
    still generating come back as partial Samples (status ABORTED, metadata["partial"]) to be
    continued after the weight sync with rollouts.sync.partial.continue_partials. Generations
    abort at once until the abort is cleared by the next weight update or `resume()`.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        shares_training_model: bool = True,
        eos_token_ids: Sequence[int] = (),
        tokenizer: object | None = None,
        name: str = "in-process",
        weight_version: int | None = 0,
    ) -> None:
        self._model = model
        self._shares = shares_training_model
        self._eos = tuple(eos_token_ids) or config_eos(model)
        self._tokenizer = tokenizer
        self._name = name
        self._weight_version = weight_version
        self._abort = threading.Event()

    @property
    def model(self) -> torch.nn.Module:
        """The model this engine samples from."""
        return self._model

    @property
    def shares_training_model(self) -> bool:
        """Whether the model is the trained one (weight updates then only set the version)."""
        return self._shares

    def abort(self) -> None:
        """Cut generations in progress (and any started before `resume` or a weight update) short."""
        self._abort.set()

    def resume(self) -> None:
        """Let generations run to the end again."""
        self._abort.clear()

    @property
    def name(self) -> str:
        """Id for logs."""
        return self._name

    def sample(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, seeds: Sequence[int | None] | None = None
    ) -> list[Sample]:
        """`params.n` Samples per prompt, prompt-major, with this engine's weight version, in the
        calling thread (the SyncSampler core `generate` wraps). `seeds`: one per prompt
        (`params.seed` is then ignored): each prompt's samples are the ones
        `sample([prompt], params with seed=seeds[i])` gives, so callers may batch independently
        seeded requests together."""
        return sample_prompts(
            self._model,
            prompts,
            params,
            eos=self._eos,
            seeds=seeds,
            weight_version=self._weight_version,
            should_abort=self._abort.is_set,
            tokenizer=self._tokenizer,
        )

    def check_prompts(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> None:
        """Raise ValueError naming the first of `prompts` that `sample` would refuse (empty, ids
        outside the vocabulary, too long for the model's positions), without sampling: a batching
        caller (CoalescingEngine) checks each request's prompts on their own before batching them."""
        check_prompts(self._model, prompts, params.max_new_tokens)

    async def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, *, seeds: Sequence[int | None] | None = None
    ) -> list[Sample]:
        """`sample`, for the InferenceEngine protocol: it runs in the caller's thread, blocking the
        event loop (so it never samples from a model a training step is changing)."""
        return self.sample(prompts, params, seeds)

    async def generate_seeded(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, seeds: Sequence[int | None]
    ) -> list[Sample]:
        """`sample` with one seed per prompt, for the InferenceEngine protocol."""
        return self.sample(prompts, params, seeds)

    async def update_weights_from_disk(self, path: str, weight_version: int) -> None:
        """Record `weight_version`; load weights from `path` unless the model is the training one."""
        check_version_grows(self._weight_version, weight_version)
        if not self._shares:
            if not Path(path).is_dir():
                raise ValueError(f"weight path {path!r} is not a directory of HF safetensors weights")
            load_weights_dir(self._model, Path(path))
        self._serve(weight_version)

    async def load_weights(self, tensors: Mapping[str, torch.Tensor], weight_version: int) -> None:
        """Copy HF-named full weights (`tensors`, as `rollouts.backends.model_tensors` gives them;
        tied ones may be absent) into the engine's model and serve them as `weight_version`: the
        direct sync, with no export. The caller may change `tensors` afterwards."""
        check_version_grows(self._weight_version, weight_version)
        if not self._shares:
            load_model_weights(self._model, dict(tensors))
        self._serve(weight_version)

    def _serve(self, weight_version: int) -> None:
        """Sample as `weight_version` from now on, to the end again (a weight update clears an abort)."""
        self._weight_version = weight_version
        self._abort.clear()

    async def weight_version(self) -> int | None:
        """The version of the weights sampled from now."""
        return self._weight_version

    async def health(self) -> bool:
        """Always ready: the model lives in this process."""
        return True


def check_version_grows(current: int | None, new: int) -> None:
    """Refuse a weight update that would take an engine's version back."""
    if current is not None and new < current:
        raise ValueError(f"weight_version may only grow: {new} < current {current}")


def config_eos(model: torch.nn.Module) -> tuple[int, ...]:
    """The stop token ids of the model's config (none when it names no eos_token_id)."""
    eos = getattr(model.config, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)


def sample_prompts(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    *,
    eos: tuple[int, ...],
    seeds: Sequence[int | None] | None,
    weight_version: int | None,
    should_abort: Callable[[], bool],
    tokenizer: object = None,
) -> list[Sample]:
    """What an engine built on the in-process sampler answers (InProcessEngine here, the engine
    process behind ProcessEngine): `params.n` Samples per prompt, prompt-major, stopping at the
    params' stop ids and `eos`; log-probs dropped unless asked for; responses decoded with
    `tokenizer` where one is given."""
    stops = dataclasses.replace(params, stop_token_ids=tuple(params.stop_token_ids) + eos)
    samples = generate(
        model, prompts, params=stops, seeds=seeds, weight_version=weight_version, should_abort=should_abort
    )
    if not params.logprobs:
        samples = [s.replace(rollout_logprobs=None) for s in samples]
    if tokenizer is not None:
        decode = tokenizer.decode  # type: ignore[attr-defined]
        samples = [s.replace(response=decode(list(s.response_tokens), skip_special_tokens=True)) for s in samples]
    return samples


def load_weights_dir(model: torch.nn.Module, path: Path) -> None:
    """Load directory `path` into `model`: a LoRA adapter where it holds one (model.lora.sync =
    'adapter'), HF safetensors weights otherwise."""
    if (path / ADAPTER_CONFIG).is_file():
        load_adapter_dir(model, path)
    else:
        load_model_weights(model, read_weights(path))
