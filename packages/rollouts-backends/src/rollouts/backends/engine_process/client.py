"""ProcessEngine: the in-process sampler in a process of its own, behind the InferenceEngine protocol.

Beside training in one process the sampler's many small torch ops share the interpreter lock, so
an overlapped run serialises much of what it meant to overlap; in its own process it runs beside.

The engine process (rollouts.backends.engine_process.worker, started and reaped by
rollouts.backends.engine_process.process) loads the model from a local HF directory, and each call
is one request frame and one answer frame over a pair of pipes (rollouts.backends.engine_process.wire:
JSON headers, Samples as rollouts.types.wire batch bytes; never pickles). Weights are synced the
way the loops export them: the engine process reads the exported safetensors directory itself
(from the page cache, just written), so a sync moves no tensor through the pipe; `load_weights`
(the loops' direct sync, with no export) passes the tensors as CUDA IPC handles when they and the
engine share a GPU (rollouts.backends.engine_process.cuda_ipc), else through a file in shared
memory both processes map (rollouts.backends.engine_process.shared_weights). `abort()` sets a flag in a small
file both processes map, read by the sampler after each token step.

Every wait is bounded: a request that gets no answer within `timeout_s` kills the engine process
and raises EngineProcessError with its exit code and the tail of its stderr; so does an engine
process that exits. `close()` (or leaving a `with` block) always reaps it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import subprocess
import tempfile
import threading
import time
import weakref
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Self

import safetensors.torch
import torch

from rollouts.backends.checkpoint.export import model_tensors, read_weights
from rollouts.backends.engine_process.cuda_ipc import choose_transport, load_by_ipc
from rollouts.backends.engine_process.options import EngineProcessOptions
from rollouts.backends.engine_process.process import CLOSE_TIMEOUT_S, exit_status, start_process
from rollouts.backends.engine_process.shared_weights import DTYPE_NAMES, DTYPES, check_fits, shared_size, write_shared
from rollouts.backends.engine_process.wire import ChildGone, encode_frame, read_frame, write_frame
from rollouts.backends.sampling.engine import check_version_grows
from rollouts.backends.sampling.sampler import check_prompt_ids, prompt_limits
from rollouts.sync import is_adapter_dir
from rollouts.sync.fingerprint import AttestationError, check_attestation, fingerprint_torch
from rollouts.types import Sample, SamplingParams
from rollouts.types.wire import batch_from_bytes

__all__ = ["EngineProcessError", "EngineProcessOptions", "ProcessEngine"]

_DEFAULT_OPTIONS = EngineProcessOptions()  # frozen: one instance serves as every default
_STDERR_TAIL_BYTES = 2000  # enough for a Python traceback's last frames and its message
_ERROR_TYPES = {"ValueError": ValueError, "TypeError": TypeError}
"""The engine process's errors raised here as their own type (a bad request); others as RuntimeError."""


class EngineProcessError(RuntimeError):
    """The engine process exited, hung past its timeout or broke the protocol (the message names its
    exit code and the tail of its stderr); the engine cannot be used afterwards."""


class ProcessEngine:
    """The in-process sampler, run in an engine process of its own (one request at a time).

    `model_dir`: a local HF model directory (config.json + safetensors), loaded by the engine
    process as `options` say. The engine serves `weight_version` until the first weight update.
    Like InProcessEngine its core is synchronous (`sample`, which blocks the calling thread: wrap
    it in rollouts.loops' CoalescingEngine, which batches concurrent calls and runs them in a
    worker thread), `generate` wraps it for the InferenceEngine protocol, and `abort()` (any
    thread) ends generations in progress at their next token step as partial Samples, until
    `resume()` or the next weight update. With `tokenizer_dir` (a saved tokenizer), the engine
    process decodes the responses. Seeded calls give the Samples InProcessEngine gives for the
    same weights, tokenizer and seed. `from_model` starts one over a model in memory.

    A subclass serves more requests by naming, in `_worker_module`, a module whose engine process
    adds its own handlers to rollouts.backends.engine_process.worker's (`serve`), and sending them
    with `request`.
    """

    _worker_module = "rollouts.backends.engine_process.worker"
    """What the engine process runs (`python -m`); a subclass may serve more requests."""

    def __init__(
        self,
        model_dir: str | Path,
        options: EngineProcessOptions = _DEFAULT_OPTIONS,
        *,
        tokenizer_dir: str | Path | None = None,
        name: str = "process",
        weight_version: int | None = 0,
        eos_token_ids: Sequence[int] = (),
        _owned_dir: Path | None = None,
    ) -> None:
        if not (Path(model_dir) / "config.json").is_file():
            raise ValueError(f"model_dir {str(model_dir)!r} has no config.json: the engine loads a local HF model")
        if tokenizer_dir is not None and not Path(tokenizer_dir).is_dir():
            raise ValueError(f"tokenizer_dir {str(tokenizer_dir)!r} is not a directory holding a saved tokenizer")
        self._name, self._timeout_s = name, options.timeout_s
        self._limits = prompt_limits(Path(model_dir))  # what check_prompts checks against
        self._transport, self._bucket_bytes = options.weights_transport, options.ipc_bucket_bytes
        self._weight_version = weight_version
        self._attest, self._dtype = options.attest, DTYPES[options.dtype]
        self._lock = threading.Lock()  # one request at a time on the pipes
        self._error: EngineProcessError | None = None
        self._rejected: AttestationError | None = None  # the last sync's, until one passes: nothing is sampled
        args = [*options.args(), "--attn", options.attn_implementation]
        args += ["--eos", *map(str, eos_token_ids)] if eos_token_ids else []
        args += [] if weight_version is None else ["--weight-version", str(weight_version)]
        args += [] if tokenizer_dir is None else ["--tokenizer-dir", str(tokenizer_dir)]
        self._child = start_process(Path(model_dir), args, owned_dir=_owned_dir, module=self._worker_module)
        self._reaper = weakref.finalize(self, self._child.reap)  # at close, or when dropped unclosed
        try:
            answer, _ = read_frame(self._child.answers_fd, deadline=time.monotonic() + options.start_timeout_s)
            if not (answer.get("ready") and isinstance(answer.get("weights"), list)):
                raise ValueError(f"expected the ready frame with the weights' layout, got {answer!r:.200}")
            self._shapes = {name: tuple(shape) for name, shape, _ in answer["weights"]}
            self._storage = {name: group for name, _, group in answer["weights"]}
            self._device = torch.device(answer.get("device", options.device))
        except TimeoutError as e:
            raise self._broken(f"did not start within start_timeout_s={options.start_timeout_s}", kill=True) from e
        except ChildGone as e:
            raise self._broken(f"exited before it was ready ({e})") from e
        except ValueError as e:
            raise self._broken(f"did not start ({e})", kill=True) from e

    @classmethod
    def from_model(cls, model: torch.nn.Module, *, tokenizer: Any = None, **kwargs: Any) -> Self:
        """An engine over a copy of `model`'s current weights (a plain HF model) and `tokenizer` (a
        transformers tokenizer; responses are decoded with it), written to a temporary directory the
        engine deletes when closed. `kwargs`: EngineProcessOptions' fields (`dtype` and
        `attn_implementation` follow the model's unless given) and the constructor's keywords."""
        option_names = {field.name for field in dataclasses.fields(EngineProcessOptions)}
        chosen = {key: kwargs.pop(key) for key in list(kwargs) if key in option_names}
        directory = Path(tempfile.mkdtemp(prefix="rollouts-engine-model-"))
        try:
            if tokenizer is not None:
                tokenizer.save_pretrained(directory)
                kwargs["tokenizer_dir"] = directory
            model.config.save_pretrained(directory)  # type: ignore[union-attr,operator]
            safetensors.torch.save_file(
                model_tensors(model), directory / "model.safetensors", metadata={"format": "pt"}
            )
            chosen.setdefault("dtype", DTYPE_NAMES[next(model.parameters()).dtype])
            chosen.setdefault("attn_implementation", getattr(model.config, "_attn_implementation", None) or "sdpa")
            return cls(directory, EngineProcessOptions(**chosen), _owned_dir=directory, **kwargs)
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            raise

    # ------------------------------------------------------------ lifecycle

    @property
    def name(self) -> str:
        """Id for logs."""
        return self._name

    @property
    def pid(self) -> int:
        """The engine process's id."""
        return self._child.process.pid

    def close(self) -> None:
        """Stop and reap the engine process and delete its files; idempotent."""
        self._reaper()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def abort(self) -> None:
        """Cut generations in progress (and any started before `resume` or a weight update) short."""
        if self._reaper.alive:
            self._child.control[0] = 1

    def resume(self) -> None:
        """Let generations run to the end again."""
        if self._reaper.alive:
            self._child.control[0] = 0

    # ------------------------------------------------------------ the protocol

    def check_prompts(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> None:
        """ValueError naming the first prompt the engine process would refuse (empty, unknown ids, too
        long), checked here: a bad prompt fails its own caller before batching (CoalescingEngine)."""
        check_prompt_ids(prompts, **self._limits, max_new_tokens=params.max_new_tokens)

    def sample(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, seeds: Sequence[int | None] | None = None
    ) -> list[Sample]:
        """`params.n` Samples per prompt, prompt-major, with this engine's weight version, blocking
        the calling thread until the engine process answers. `seeds`: one per prompt
        (`params.seed` is then ignored), as InProcessEngine's. RuntimeError while the weights the
        engine process holds are those of a sync that failed attestation (until a sync passes)."""
        if self._rejected is not None:
            names = (self._rejected.mismatched + self._rejected.missing)[:3]
            raise RuntimeError(
                f"{self._name}: samples nothing until a weight sync passes attestation: the weights it holds "
                f"failed it at version {self._rejected.weight_version} ({', '.join(names)})"
            ) from self._rejected
        request = {
            "op": "generate",
            "prompts": [[int(t) for t in p] for p in prompts],
            "params": dataclasses.asdict(params),
            "seeds": None if seeds is None else list(seeds),
        }
        _, body = self.request(request)
        return list(batch_from_bytes(body).samples)

    async def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, *, seeds: Sequence[int | None] | None = None
    ) -> list[Sample]:
        """`sample`, for the InferenceEngine protocol (it blocks the event loop while it runs)."""
        return self.sample(prompts, params, seeds)

    async def generate_seeded(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, seeds: Sequence[int | None]
    ) -> list[Sample]:
        """`sample` with one seed per prompt, for the InferenceEngine protocol."""
        return self.sample(prompts, params, seeds)

    async def update_weights_from_disk(self, path: str, weight_version: int) -> None:
        """Load HF safetensors weights (or a LoRA adapter) from directory `path` in the engine
        process and serve them as `weight_version`; clears an abort."""
        check_version_grows(self._weight_version, weight_version)
        if not Path(path).is_dir():
            raise ValueError(f"weight path {path!r} is not a directory of HF safetensors weights")
        header = {"op": "update", "path": str(Path(path).resolve()), "weight_version": weight_version}
        expected = self._expected(read_weights(path)) if self._attest and not is_adapter_dir(path) else None
        answer, _ = self.request(header | ({} if expected is None else {"attest": sorted(expected)}))
        self._check(expected, answer, weight_version)
        self._weight_version = weight_version

    async def load_weights(self, tensors: Mapping[str, torch.Tensor], weight_version: int) -> None:
        """Load HF-named full weights (`tensors`, as `rollouts.backends.model_tensors` gives them; tied
        ones may be absent) and serve them as `weight_version`; clears an abort. Tensors on the
        engine's own CUDA device go as CUDA IPC handles (copied device to device, never through the
        host); others through a file in shared memory both processes map (one copy in, one copy
        out); `EngineProcessOptions.weights_transport` says which. Never through the disk: the
        direct sync of a trainer in the same machine.

        Returns once the engine process has copied them into its model (the caller may change them
        then). The names, shapes and dtypes are checked here first, against the model the engine
        process reported at start (ValueError or TypeError; nothing is sent). A load the engine
        process refuses all the same raises EngineProcessError here and breaks the engine (every
        later call raises it too): part of the weights may be in its model, so it would no longer
        serve any version it was given."""
        check_version_grows(self._weight_version, weight_version)
        check_fits(tensors, shapes=self._shapes, storages=self._storage, engine=self._name)
        transport = choose_transport(self._transport, (t.device for t in tensors.values()), self._device)
        expected = self._expected(tensors) if self._attest else None
        attest = {} if expected is None else {"attest": sorted(expected)}

        def exchange(request: dict[str, Any]) -> tuple[dict[str, Any], bytes]:
            # the last request of a load asks for the checksums of what the engine then holds
            return self._exchange(request | attest if request.get("last", True) else request)

        with self._held():  # the engine process reads the weights only while it answers this request
            if transport == "cuda_ipc":
                answer = load_by_ipc(tensors, weight_version, self._device, self._bucket_bytes, exchange)
            else:
                header, size = shared_size(tensors)
                write_shared(self._child.map_weights(max(size, 1)), tensors, header)
                answer, _ = exchange({"op": "load_shared", "tensors": header, "weight_version": weight_version})
            if not answer.get("ok"):
                raise self._broken(
                    f"refused the weight load of version {weight_version} ({answer.get('error_type')}: "
                    f"{answer.get('error')}), and part of it may be loaded",
                    kill=True,
                )
        self._check(expected, answer, weight_version)
        self._weight_version = weight_version

    def _expected(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, int]:
        """Checksums of `tensors` as the engine process's model holds them: cast to its dtype."""
        return fingerprint_torch(tensors, cast=lambda tensor: tensor.to(self._dtype))

    def _check(self, expected: Mapping[str, int] | None, answer: Mapping[str, Any], version: int) -> None:
        """AttestationError unless the checksums in `answer` equal `expected`; the engine then samples
        nothing (its model holds the weights that failed) until a later attested sync passes (a LoRA
        adapter's load, never attested, leaves that as it is)."""
        if expected is None:
            return
        try:
            check_attestation(expected, answer.get("checksums") or {}, engine=self._name, weight_version=version)
        except AttestationError as e:
            self._rejected = e
            raise
        self._rejected = None

    async def weight_version(self) -> int | None:
        """The version of the weights sampled from now."""
        return self._weight_version

    async def health(self) -> bool:
        """Whether the engine process is up and answering."""
        return self._reaper.alive and self._error is None and self._child.process.poll() is None

    # ------------------------------------------------------------ one request

    def request(self, header: dict[str, Any], body: bytes = b"") -> tuple[dict[str, Any], bytes]:
        """Send one request (`header["op"]` names its handler in the engine process; `body`, bytes
        beside it) and return the answer's header and body, blocking the calling thread (bounded by
        timeout_s). What a subclass sends its own requests with. The engine process's errors come
        back as ValueError or TypeError (a bad request) or RuntimeError, naming this engine; a dead
        or hung process as EngineProcessError."""
        with self._held():
            answer, body = self._exchange(header, body)
        if not answer.get("ok"):
            error_type = _ERROR_TYPES.get(str(answer.get("error_type")), RuntimeError)
            raise error_type(f"{self._name}: {answer.get('error_type')}: {answer.get('error')}")
        return answer, body

    def _exchange(self, request: dict[str, Any], body: bytes = b"") -> tuple[dict[str, Any], bytes]:
        """Write `request`, read its answer, within timeout_s (the caller holds the pipes)."""
        deadline = time.monotonic() + self._timeout_s
        with self._guard(request["op"]):
            write_frame(self._child.requests_fd, encode_frame(request, body), deadline=deadline)
            return read_frame(self._child.answers_fd, deadline=deadline)

    @contextlib.contextmanager
    def _held(self) -> Iterator[None]:
        """The pipes to this caller alone (waiting at most timeout_s for another's request)."""
        if self._error is not None:
            raise self._error
        if not self._reaper.alive:
            raise EngineProcessError(f"{self._name}: the engine is closed")
        if not self._lock.acquire(timeout=self._timeout_s):
            raise TimeoutError(f"{self._name}: another request held the engine for timeout_s={self._timeout_s}")
        try:
            yield
        finally:
            self._lock.release()

    @contextlib.contextmanager
    def _guard(self, op: str) -> Iterator[None]:
        """Pipe failures during `op` as the broken engine they mean (see `_broken`)."""
        try:
            yield
        except TimeoutError as e:
            raise self._broken(f"gave no answer to {op!r} within timeout_s={self._timeout_s}", kill=True) from e
        except ChildGone as e:
            raise self._broken(f"exited during {op!r} ({e})") from e
        except ValueError as e:
            raise self._broken(f"broke the protocol during {op!r} ({e})", kill=True) from e

    def _broken(self, what: str, *, kill: bool = False) -> EngineProcessError:
        """Reap the process (`kill`: a hung one, or one that broke the protocol) and remember why:
        every later call raises the same error."""
        process, stderr_path = self._child.process, self._child.files[0]
        if kill:
            process.kill()
        try:  # an exiting process has written all its stderr once it is gone
            process.wait(timeout=CLOSE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
        tail = stderr_path.read_bytes()[-_STDERR_TAIL_BYTES:] if stderr_path.exists() else b""
        if self._reaper.detach() is not None:
            self._child.reap(kill=True)
        text = tail.decode(errors="replace").strip()
        self._error = EngineProcessError(
            f"{self._name}: engine process {process.pid} {what}; "
            + ("killed" if kill else exit_status(process.returncode))
            + (f"; stderr tail:\n{text}" if text else "; no stderr")
        )
        return self._error
