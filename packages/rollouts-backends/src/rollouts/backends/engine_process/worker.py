"""The engine process behind ProcessEngine: `python -m rollouts.backends.engine_process.worker ...`.

It loads the model from a local HF directory (never a hub), says it is ready with the layout of
its weights (what the parent checks a shared-memory load against), then answers one request frame at a
time (rollouts.backends.engine_process.wire) until its request pipe closes or a "close" request comes:
"generate" runs the in-process sampler and answers the Samples (their responses decoded with
the tokenizer from `--tokenizer-dir`, if given) as rollouts.types.wire batch bytes; "update" loads HF safetensors weights (or a LoRA adapter) from a directory and records the
version; "load_shared" copies weights the parent wrote into the shared file `--weights`. A request that fails answers its error's type and text, and the process goes on.

The abort flag is byte 0 of a small shared file (`--control`, mapped by both processes): the
parent sets it from any thread while a generate runs here, and the sampler checks it after each
token step. A weight update clears it, as InProcessEngine's does.
"""

from __future__ import annotations

import argparse
import dataclasses
import mmap
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from rollouts.backends.checkpoint.export import load_model_weights, storage_key
from rollouts.backends.checkpoint.model_files import load_tokenizer
from rollouts.backends.engine_process.wire import decode_frame, encode_frame
from rollouts.backends.sampling.engine import config_eos, load_weights_dir, sample_prompts
from rollouts.backends.train.components import load_hf_model
from rollouts.types import RolloutBatch, Sample, SamplingParams, from_dict
from rollouts.types.wire import batch_to_bytes

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclasses.dataclass(slots=True)
class _Worker:
    model: torch.nn.Module
    control: mmap.mmap
    eos: tuple[int, ...]
    weight_version: int | None
    tokenizer: Any
    weights_file: str

    def aborted(self) -> bool:
        return self.control[0] != 0

    def sample(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, seeds: Sequence[int | None] | None
    ) -> list[Sample]:
        """`params.n` Samples per prompt from this process's model, as the weight version it serves."""
        return sample_prompts(
            self.model,
            prompts,
            params,
            eos=self.eos,
            seeds=seeds,
            weight_version=self.weight_version,
            should_abort=self.aborted,
            tokenizer=self.tokenizer,  # decoded here: the trainer's process has enough to do
        )

    def generate(self, header: dict[str, Any]) -> tuple[dict[str, Any], bytes]:
        samples = self.sample(header["prompts"], from_dict(SamplingParams, header["params"]), header.get("seeds"))
        return {"ok": True}, batch_to_bytes(RolloutBatch(samples=tuple(samples)))

    def load_shared(self, header: dict[str, Any]) -> tuple[dict[str, Any], bytes]:
        """Weights the parent wrote into the shared file (`--weights`): [name, dtype, shape, offset]
        each, copied into the model."""
        size = os.path.getsize(self.weights_file)
        with open(self.weights_file, "rb") as f:
            shared = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) if size else None
        try:
            load_model_weights(self.model, _views(shared, header["tensors"], size))  # copied: no view outlives it
        finally:
            if shared is not None:
                try:
                    shared.close()
                except BufferError:  # a failed load's traceback still holds a view: closed when it goes
                    pass
        return self._serve(header["weight_version"])

    def update(self, header: dict[str, Any]) -> tuple[dict[str, Any], bytes]:
        load_weights_dir(self.model, Path(header["path"]))
        return self._serve(header["weight_version"])

    def _serve(self, version: int) -> tuple[dict[str, Any], bytes]:
        """Sample as `version` from now on, to the end again (a weight update clears an abort)."""
        self.weight_version = version
        self.control[0] = 0
        return {"ok": True, "weight_version": version}, b""


def weight_layout(model: torch.nn.Module) -> list[list[Any]]:
    """[name, shape, storage] of each of the model's weights; tied weights share a storage number
    (a load needs one name of each storage). What ProcessEngine checks a `load_weights` against."""
    storages: dict[tuple[int, int], int] = {}
    return [
        [name, list(t.shape), storages.setdefault(storage_key(t), len(storages))]
        for name, t in model.state_dict().items()
    ]


def _views(shared: mmap.mmap | None, layout: list[list[Any]], size: int) -> dict[str, torch.Tensor]:
    """The tensors [name, dtype, shape, offset] of `layout`, as views of the `size`-byte `shared`."""
    tensors = {}
    for name, dtype, shape, offset in layout:
        count = 1
        for dim in shape:
            count *= int(dim)
        end = offset + count * _DTYPES[dtype].itemsize
        if end > size or offset < 0:
            raise ValueError(f"tensor {name!r} spans bytes {offset}..{end}, outside the {size}-byte weights file")
        flat = (
            torch.frombuffer(shared, dtype=_DTYPES[dtype], count=count, offset=offset)
            if count and shared is not None
            else torch.empty(0, dtype=_DTYPES[dtype])
        )
        tensors[name] = flat.view(shape)
    return tensors


def _read_exact(fd: int, num_bytes: int) -> bytes | None:
    """`num_bytes` from blocking `fd`; None at a clean end of stream."""
    parts, got = [], 0
    while got < num_bytes:
        chunk = os.read(fd, num_bytes - got)
        if not chunk:
            if got:
                raise ValueError(f"request pipe closed mid-frame ({got} of {num_bytes} bytes)")
            return None
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def read_request(fd: int) -> tuple[dict[str, Any], bytes] | None:
    prefix = _read_exact(fd, 16)
    if prefix is None:
        return None
    rest = _read_exact(fd, int.from_bytes(prefix[4:8], "little") + int.from_bytes(prefix[8:16], "little"))
    return decode_frame(prefix + (rest or b""))


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


Handler = Callable[[dict[str, Any]], tuple[dict[str, Any], bytes]]
"""One request op: its header -> (answer header, answer body)."""


def handlers_of(worker: _Worker) -> dict[str, Handler]:
    """The engine's request ops, by name."""
    return {"generate": worker.generate, "update": worker.update, "load_shared": worker.load_shared}


def answer(handlers: Mapping[str, Handler], header: dict[str, Any]) -> tuple[dict[str, Any], bytes]:
    """The answer to one request: its handler's, or the error it raised (the process serves on)."""
    try:
        handler = handlers.get(header.get("op", ""))
        if handler is None:
            raise ValueError(f"unknown engine request op {header.get('op')!r}; known: {sorted(handlers)}")
        return handler(header)
    except Exception as e:  # answered to the caller, who raises it
        return error_answer(e)


def error_answer(error: Exception) -> tuple[dict[str, Any], bytes]:
    """The answer that hands `error` (its type and text) to the caller, who raises it."""
    return {"ok": False, "error_type": type(error).__name__, "error": str(error)}, b""


def serve(worker: _Worker, requests_fd: int, answers_fd: int) -> None:
    """Answer requests until the pipe closes or a "close" request comes."""
    handlers = handlers_of(worker)
    while (request := read_request(requests_fd)) is not None:
        header, _ = request
        if header.get("op") == "close":
            return
        write_all(answers_fd, encode_frame(*answer(handlers, header)))


def parser() -> argparse.ArgumentParser:
    """The engine process's command line (ProcessEngine builds it)."""
    out = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    out.add_argument("--model-dir", required=True)
    out.add_argument("--requests-fd", type=int, required=True)
    out.add_argument("--answers-fd", type=int, required=True)
    out.add_argument("--control", required=True)
    out.add_argument("--weights", required=True)
    out.add_argument("--threads", type=int, default=1)
    out.add_argument("--device", default="cpu")
    out.add_argument("--dtype", choices=sorted(_DTYPES), default="float32")
    out.add_argument("--attn", default="sdpa")
    out.add_argument("--weight-version", type=int, default=None)
    out.add_argument("--eos", type=int, nargs="*", default=[])
    out.add_argument("--tokenizer-dir", default="")
    return out


def start_worker(args: argparse.Namespace) -> _Worker:
    """Load the model (and tokenizer) as `args` say and tell the parent it is ready, with the
    layout of its weights."""
    torch.set_num_threads(args.threads)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # stderr keeps what explains a failure
    model = load_hf_model(args.model_dir, dtype=_DTYPES[args.dtype], device=args.device, attn_implementation=args.attn)
    model.eval()
    with open(args.control, "r+b") as f:
        control = mmap.mmap(f.fileno(), 0)
    tokenizer = load_tokenizer(args.tokenizer_dir) if args.tokenizer_dir else None
    eos = tuple(args.eos) or config_eos(model)
    worker = _Worker(
        model=model,
        control=control,
        eos=eos,
        weight_version=args.weight_version,
        tokenizer=tokenizer,
        weights_file=args.weights,
    )
    ready = {"ok": True, "ready": True, "pid": os.getpid(), "weights": weight_layout(model)}
    write_all(args.answers_fd, encode_frame(ready))
    return worker


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    serve(start_worker(args), args.requests_fd, args.answers_fd)


if __name__ == "__main__":
    main()
