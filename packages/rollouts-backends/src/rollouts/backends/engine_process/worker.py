"""The engine process behind ProcessEngine: `python -m rollouts.backends.engine_process.worker ...`.

It loads the model from a local HF directory (never a hub), says it is ready with the layout of
its weights (what the parent checks a shared-memory load against), then answers one request frame at a
time (rollouts.backends.engine_process.wire) until its request pipe closes or a "close" request comes:
"generate" runs the in-process sampler and answers the Samples (their responses decoded with
the tokenizer from `--tokenizer-dir`, if given) as rollouts.types.wire batch bytes; "update"
loads HF safetensors weights (or a LoRA adapter) from a directory and records the version;
"load_shared" copies weights the parent wrote into the shared file `--weights`; "load_cuda_ipc"
maps a bucket of the parent's GPU memory by its CUDA IPC handle and copies from it, device to
device (rollouts.backends.engine_process.cuda_ipc). A request that
fails answers its error's type and text, and the process goes on.

`serve(handlers, ...)` is that request loop, for any table of handlers: a process that serves
more requests (rollouts.loops' rollout worker) starts the same worker and adds its own to
`handlers_of(worker)`.

The abort flag is byte 0 of a small shared file (`--control`, mapped by both processes): the
parent sets it from any thread while a generate runs here, and the sampler checks it after each
token step. A weight update clears it, as InProcessEngine's does.
"""

from __future__ import annotations

import argparse
import dataclasses
import mmap
import os
import shutil
import signal
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers.utils import logging as hf_logging

from rollouts.backends.checkpoint.export import load_model_weights
from rollouts.backends.checkpoint.model_files import load_tokenizer
from rollouts.backends.engine_process.cuda_ipc import IpcTensor, ipc_tensors, mapped_views
from rollouts.backends.engine_process.shared_weights import DTYPES, shared_views, weight_layout
from rollouts.backends.engine_process.wire import ChildGone, encode_frame, next_request, write_frame
from rollouts.backends.sampling.engine import config_eos, load_weights_dir, sample_prompts
from rollouts.backends.train.components import load_hf_model
from rollouts.sync.fingerprint import fingerprint_torch, flip_bit_torch, sync_fault_target
from rollouts.sync.ipc_handles import IpcStorage
from rollouts.types import RolloutBatch, Sample, SamplingParams, from_dict
from rollouts.types.wire import batch_to_bytes

Handler = Callable[[dict[str, Any], bytes], tuple[dict[str, Any], bytes]]
"""One request op: its header and body -> (answer header, answer body)."""


@dataclasses.dataclass(slots=True)
class EngineWorker:
    """The engine process's model and what it serves: its requests' handlers (`handlers_of`)."""

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

    def generate(self, header: dict[str, Any], body: bytes) -> tuple[dict[str, Any], bytes]:
        samples = self.sample(header["prompts"], from_dict(SamplingParams, header["params"]), header.get("seeds"))
        return {"ok": True}, batch_to_bytes(RolloutBatch(samples=tuple(samples)))

    def load_shared(self, header: dict[str, Any], body: bytes) -> tuple[dict[str, Any], bytes]:
        """Weights the parent wrote into the shared file (`--weights`): [name, dtype, shape, offset]
        each, copied into the model."""
        size = os.path.getsize(self.weights_file)
        with open(self.weights_file, "rb") as f:
            shared = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) if size else None
        try:
            load_model_weights(self.model, shared_views(shared, header["tensors"], size))  # copied: no view outlives it
        finally:
            if shared is not None:
                try:
                    shared.close()
                except BufferError:  # a failed load's traceback still holds a view: closed when it goes
                    pass
        return self._serve(header["weight_version"], header.get("attest"))

    def load_cuda_ipc(self, header: dict[str, Any], body: bytes) -> tuple[dict[str, Any], bytes]:
        """One bucket of the parent's GPU memory (its IPC handle in `storage`, its tensors in
        `tensors`), copied device to device into the model; the load's version is served after the
        `last` bucket."""
        storage = IpcStorage.from_json(header.get("storage"))
        tensors = ipc_tensors(header, storage)
        own = self.model.state_dict()
        for t in tensors:
            if t.name not in own or tuple(own[t.name].shape) != t.shape:
                found = tuple(own[t.name].shape) if t.name in own else "no such weight"
                raise ValueError(f"CUDA IPC load: {t.name!r} of shape {t.shape} does not fit the model ({found})")
        _copy_mapped(own, storage, tensors)
        if not header.get("last"):
            return {"ok": True}, b""
        return self._serve(header["weight_version"], header.get("attest"))

    def update(self, header: dict[str, Any], body: bytes) -> tuple[dict[str, Any], bytes]:
        load_weights_dir(self.model, Path(header["path"]))
        return self._serve(header["weight_version"], header.get("attest"))

    def _serve(self, version: int, attest: list[str] | None = None) -> tuple[dict[str, Any], bytes]:
        """Sample as `version` from now on, to the end again (a weight update clears an abort); with
        `attest` (weight names), answer their checksums as the model now holds them."""
        self.weight_version = version
        self.control[0] = 0
        answer: dict[str, Any] = {"ok": True, "weight_version": version}
        if attest is not None:
            answer["checksums"] = loaded_checksums(self.model, attest)
        return answer, b""


def loaded_checksums(model: torch.nn.Module, names: Sequence[str]) -> dict[str, int]:
    """Checksums (rollouts.sync.fingerprint) of the model's weights named `names`, as it holds them;
    a name it lacks is left out. The fault ROLLOUTS_SYNC_FAULT asks for is injected first, into the
    model itself (a test hook)."""
    state = model.state_dict()
    target = sync_fault_target()
    if target is not None and target in state:
        flip_bit_torch(state[target])
    return fingerprint_torch({name: state[name] for name in names if name in state})


def _copy_mapped(own: dict[str, torch.Tensor], storage: IpcStorage, tensors: list[IpcTensor]) -> None:
    """Map `storage`, copy its `tensors` into `own` (the model's state dict) and wait for the copies:
    the parent may free or reuse the bucket once this returns, and the mapping ends with this call."""
    flat = storage.mapped()
    with torch.no_grad():
        for name, view in mapped_views(flat, tensors).items():
            own[name].copy_(view)
    torch.cuda.synchronize(flat.device)


def handlers_of(worker: EngineWorker) -> dict[str, Handler]:
    """The engine's request ops, by name."""
    return {
        "generate": worker.generate,
        "update": worker.update,
        "load_shared": worker.load_shared,
        "load_cuda_ipc": worker.load_cuda_ipc,
    }


def answer(handlers: Mapping[str, Handler], header: dict[str, Any], body: bytes) -> tuple[dict[str, Any], bytes]:
    """The answer to one request: its handler's, or the error it raised (the process serves on)."""
    try:
        handler = handlers.get(header.get("op", ""))
        if handler is None:
            raise ValueError(f"unknown engine request op {header.get('op')!r}; known: {sorted(handlers)}")
        return handler(header, body)
    except Exception as e:  # answered to the caller, who raises it
        return error_answer(e)


def error_answer(error: Exception) -> tuple[dict[str, Any], bytes]:
    """The answer that hands `error` (its type and text) to the caller, who raises it."""
    return {"ok": False, "error_type": type(error).__name__, "error": str(error)}, b""


def serve(handlers: Mapping[str, Handler], requests_fd: int, answers_fd: int) -> bool:
    """Answer requests with `handlers` (by op) until the pipe closes or a "close" request comes;
    whether the parent went away (closed its pipes) rather than asking to close."""
    while (request := next_request(requests_fd)) is not None:
        header, body = request
        if header.get("op") == "close":
            return False
        write_frame(answers_fd, encode_frame(*answer(handlers, header, body)), deadline=None)
    return True


def serve_swept(sweep: Sequence[str], run: Callable[[], bool]) -> None:
    """Run the request loop `run` (True: the parent went away); the parent's files of this process
    (`sweep`: its shared files, its stderr file, a model directory it owns) are removed here when
    the parent died first or a SIGTERM comes, since the parent can no longer reap them."""

    def terminated(signum: int, frame: object) -> None:
        _remove(sweep)
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, terminated)
    try:
        orphaned = run()
    except ChildGone:  # the parent closed its end while an answer was being written
        orphaned = True
    if orphaned:
        _remove(sweep)


def _remove(paths: Sequence[str]) -> None:
    for path in map(Path, paths):
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


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
    out.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    out.add_argument("--attn", default="sdpa")
    out.add_argument("--weight-version", type=int, default=None)
    out.add_argument("--eos", type=int, nargs="*", default=[])
    out.add_argument("--tokenizer-dir", default="")
    out.add_argument("--sweep", nargs="*", default=[])
    return out


def start_worker(args: argparse.Namespace) -> EngineWorker:
    """Load the model (and tokenizer) as `args` say and tell the parent it is ready, with the
    layout of its weights."""
    torch.set_num_threads(args.threads)
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # stderr keeps what explains a failure
    model = load_hf_model(args.model_dir, dtype=DTYPES[args.dtype], device=args.device, attn_implementation=args.attn)
    model.eval()
    with open(args.control, "r+b") as f:
        control = mmap.mmap(f.fileno(), 0)
    tokenizer = load_tokenizer(args.tokenizer_dir) if args.tokenizer_dir else None
    eos = tuple(args.eos) or config_eos(model)
    worker = EngineWorker(
        model=model,
        control=control,
        eos=eos,
        weight_version=args.weight_version,
        tokenizer=tokenizer,
        weights_file=args.weights,
    )
    device = str(next(model.parameters()).device)  # where the parent's CUDA IPC loads must come from
    ready = {"ok": True, "ready": True, "pid": os.getpid(), "weights": weight_layout(model), "device": device}
    write_frame(args.answers_fd, encode_frame(ready), deadline=None)
    return worker


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    serve_swept(args.sweep, lambda: serve(handlers_of(start_worker(args)), args.requests_fd, args.answers_fd))


if __name__ == "__main__":
    main()
