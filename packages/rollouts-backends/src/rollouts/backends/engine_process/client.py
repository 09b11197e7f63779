"""ProcessEngine: the in-process sampler in a process of its own, behind the InferenceEngine protocol.

The in-process sampler is many small torch ops driven from Python, so beside training in the same
process the two share one interpreter lock: an overlapped run (generate step n+1 while step n
trains) serialises much of the work it meant to overlap. In its own process the sampler runs
truly beside training, on its own core.

The engine process (rollouts.backends.engine_process.worker) loads the model from a local HF directory,
and each call is one request frame and one answer frame over a pair of pipes
(rollouts.backends.engine_process.wire: JSON headers, Samples as rollouts.types.wire batch bytes; never
pickles). Weights are synced the way the loops export them: the engine process reads the exported
safetensors directory itself (from the page cache, just written), so a sync moves no tensor
through the pipe; `load_weights` (the loops' direct sync, with no export) passes the tensors
through a file in shared memory both processes map, taken by the engine process at its next
request. `abort()` sets a flag in a small file both processes map, read by the sampler after each
token step.

Every wait is bounded: a request that gets no answer within `timeout_s` kills the engine process
and raises EngineProcessError with its exit code and the tail of its stderr; so does an engine
process that exits. `close()` (or leaving a `with` block) always reaps it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import mmap
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Self

import safetensors.torch
import torch

from rollouts.backends.checkpoint.export import model_tensors
from rollouts.backends.engine_process.wire import ChildGone, encode_frame, read_frame, write_frame
from rollouts.backends.sampling.engine import check_version_grows
from rollouts.types import Sample, SamplingParams
from rollouts.types.wire import batch_from_bytes

__all__ = ["EngineProcessError", "ProcessEngine"]

_CLOSE_TIMEOUT_S = 10.0  # a clean exit after "close" is instant; past this the process is killed
_REAP_TIMEOUT_S = 10.0  # after SIGKILL the kernel reaps at once; this only bounds the wait
_STDERR_TAIL_BYTES = 2000  # enough for a Python traceback's last frames and its message
_SHM_DIR = "/dev/shm"  # memory-backed where there is one: the abort flag never touches a disk
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_ALIGN = 64  # each tensor of a weight load starts on a cache line of the shared file


class EngineProcessError(RuntimeError):
    """The engine process exited, hung past its timeout or broke the protocol (the message names its
    exit code and the tail of its stderr); the engine cannot be used afterwards."""


@dataclasses.dataclass(slots=True)
class _Child:
    """What the engine process holds open on this side; `reap` releases all of it, once."""

    process: subprocess.Popen[bytes]
    requests_fd: int
    answers_fd: int
    control: mmap.mmap
    weights_file: Path
    """Shared memory for `load_weights`: the engine process maps it per load."""
    files: tuple[Path, ...]
    dirs: tuple[Path, ...]
    weights: mmap.mmap | None = None

    def map_weights(self, size: int) -> mmap.mmap:
        """The weights file mapped here, `size` bytes long (resized, and mapped again, when not)."""
        if self.weights is None or len(self.weights) != size:
            if self.weights is not None:
                self.weights.close()
                self.weights = None
            with open(self.weights_file, "r+b") as f:
                f.truncate(size)
                self.weights = mmap.mmap(f.fileno(), size)
        return self.weights

    def reap(self, *, kill: bool = False) -> int | None:
        """Stop the process (`kill`: at once; otherwise asked first), close and delete everything;
        its exit code."""
        if kill:
            self.process.kill()
        elif self.process.poll() is None and self.requests_fd >= 0:
            try:
                write_frame(self.requests_fd, encode_frame({"op": "close"}), deadline=time.monotonic() + 1.0)
            except (OSError, TimeoutError):  # ChildGone is an OSError
                pass  # killed below
        for fd in (self.requests_fd, self.answers_fd):
            if fd >= 0:
                os.close(fd)
        self.requests_fd = self.answers_fd = -1
        try:
            self.process.wait(timeout=_CLOSE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=_REAP_TIMEOUT_S)
        if not self.control.closed:
            self.control.close()
        if self.weights is not None:
            self.weights.close()
        for path in self.files:
            path.unlink(missing_ok=True)
        for path in self.dirs:
            shutil.rmtree(path, ignore_errors=True)
        return self.process.returncode


class ProcessEngine:
    """The in-process sampler, run in an engine process of its own (one request at a time).

    `model_dir`: a local HF model directory (config.json + safetensors), loaded by the engine
    process with `dtype`, `device` and `attn_implementation`; `num_threads` is its torch thread
    count. The engine serves `weight_version` until the first `update_weights_from_disk`.
    Like InProcessEngine, calls block the calling thread (wrap it in rollouts.loops'
    CoalescingEngine, which batches concurrent calls and runs them in a worker thread), and
    `abort()` (any thread) ends generations in progress at their next token step as partial
    Samples, until `resume()` or the next weight update. With `tokenizer_dir` (a saved tokenizer),
    the engine process decodes the responses. Seeded calls give the Samples InProcessEngine gives
    for the same weights, tokenizer and seed.
    """

    _worker_module = "rollouts.backends.engine_process.worker"
    """What the engine process runs (`python -m`); a subclass may serve more requests."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        tokenizer_dir: str | Path | None = None,
        name: str = "process",
        weight_version: int | None = 0,
        num_threads: int = 1,
        device: str = "cpu",
        dtype: str = "float32",
        attn_implementation: str = "sdpa",
        eos_token_ids: Sequence[int] = (),
        timeout_s: float = 600.0,
        start_timeout_s: float = 300.0,
        _owned_dir: Path | None = None,
    ) -> None:
        if not (Path(model_dir) / "config.json").is_file():
            raise ValueError(f"model_dir {str(model_dir)!r} has no config.json: the engine loads a local HF model")
        if num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        if dtype not in _DTYPE_NAMES.values():
            raise ValueError(f"dtype must be one of {sorted(_DTYPE_NAMES.values())}, got {dtype!r}")
        if not (timeout_s > 0 and start_timeout_s > 0):
            raise ValueError(f"timeout_s ({timeout_s}) and start_timeout_s ({start_timeout_s}) must be > 0")
        if tokenizer_dir is not None and not Path(tokenizer_dir).is_dir():
            raise ValueError(f"tokenizer_dir {str(tokenizer_dir)!r} is not a directory holding a saved tokenizer")
        self._name, self._timeout_s = name, timeout_s
        self._weight_version = weight_version
        self._lock = threading.Lock()  # one request at a time on the pipes
        self._pending_load: dict[str, Any] | None = None  # a load staged in shared memory, not yet sent
        self._error: EngineProcessError | None = None
        args = ["--threads", str(num_threads), "--device", device, "--dtype", dtype, "--attn", attn_implementation]
        args += ["--eos", *map(str, eos_token_ids)] if eos_token_ids else []
        args += [] if weight_version is None else ["--weight-version", str(weight_version)]
        args += [] if tokenizer_dir is None else ["--tokenizer-dir", str(tokenizer_dir)]
        self._child = _start(Path(model_dir), args, owned_dir=_owned_dir, module=self._worker_module)
        self._reaper = weakref.finalize(self, self._child.reap)  # at close, or when dropped unclosed
        try:
            answer, _ = read_frame(self._child.answers_fd, deadline=time.monotonic() + start_timeout_s)
            if not (answer.get("ready") and isinstance(answer.get("weights"), list)):
                raise ValueError(f"expected the ready frame with the weights' layout, got {answer!r:.200}")
            self._shapes = {name: tuple(shape) for name, shape, _ in answer["weights"]}
            self._storage = {name: group for name, _, group in answer["weights"]}
        except TimeoutError as e:
            raise self._broken(f"did not start within start_timeout_s={start_timeout_s}", kill=True) from e
        except ChildGone as e:
            raise self._broken(f"exited before it was ready ({e})") from e
        except ValueError as e:
            raise self._broken(f"did not start ({e})", kill=True) from e

    @classmethod
    def from_model(cls, model: torch.nn.Module, *, tokenizer: Any = None, **kwargs: Any) -> Self:
        """An engine over a copy of `model`'s current weights (a plain HF model) and `tokenizer` (a
        transformers tokenizer; responses are decoded with it), written to a temporary directory the
        engine deletes when closed; `dtype` and `attn_implementation` follow the model's. Other
        options as for the constructor."""
        directory = Path(tempfile.mkdtemp(prefix="rollouts-engine-model-"))
        try:
            if tokenizer is not None:
                tokenizer.save_pretrained(directory)
                kwargs["tokenizer_dir"] = directory
            model.config.save_pretrained(directory)  # type: ignore[union-attr,operator]
            safetensors.torch.save_file(
                model_tensors(model), directory / "model.safetensors", metadata={"format": "pt"}
            )
            kwargs.setdefault("dtype", _DTYPE_NAMES[next(model.parameters()).dtype])
            kwargs.setdefault("attn_implementation", getattr(model.config, "_attn_implementation", None) or "sdpa")
            return cls(directory, _owned_dir=directory, **kwargs)
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

    def __enter__(self) -> ProcessEngine:
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

    async def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, *, seeds: Sequence[int | None] | None = None
    ) -> list[Sample]:
        """`params.n` Samples per prompt, prompt-major, with this engine's weight version."""
        request = {
            "op": "generate",
            "prompts": [[int(t) for t in p] for p in prompts],
            "params": dataclasses.asdict(params),
            "seeds": None if seeds is None else list(seeds),
        }
        _, body = self._call(request)
        return list(batch_from_bytes(body).samples)

    async def generate_seeded(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, seeds: Sequence[int | None]
    ) -> list[Sample]:
        """`generate` with one seed per prompt (`params.seed` is ignored), as InProcessEngine's."""
        return await self.generate(prompts, params, seeds=seeds)

    async def update_weights_from_disk(self, path: str, weight_version: int) -> None:
        """Load HF safetensors weights (or a LoRA adapter) from directory `path` in the engine
        process and serve them as `weight_version`; clears an abort."""
        check_version_grows(self._weight_version, weight_version)
        if not Path(path).is_dir():
            raise ValueError(f"weight path {path!r} is not a directory of HF safetensors weights")
        self._call({"op": "update", "path": str(Path(path).resolve()), "weight_version": weight_version})
        self._weight_version = weight_version

    async def load_weights(self, tensors: Mapping[str, torch.Tensor], weight_version: int) -> None:
        """Load HF-named full weights (`tensors`, as `rollouts.backends.model_tensors` gives them; tied
        ones may be absent) and serve them as `weight_version`; clears an abort. They travel through
        a file in shared memory both processes map (one copy in, one copy out), not the disk: the
        direct sync of a trainer in the same machine.

        Returns once the tensors are copied into that file: the caller may change them at once, and
        the engine process is not woken. It copies them out first thing on the next request (a
        load not yet taken is replaced by a later one), so a trainer's next step starts at once
        instead of sharing its core with the load: a pipe write runs the woken reader on the
        writer's core. So the names, shapes and dtypes are checked here, against the model the
        engine process reported at start; a load it refuses all the same breaks the engine (that
        request and every later call raise EngineProcessError naming the refusal), since it would
        no longer serve the version it was given."""
        check_version_grows(self._weight_version, weight_version)
        layout, offset = [], 0
        for name, tensor in tensors.items():
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"load_weights: {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
            if tensor.dtype not in _DTYPE_NAMES:
                raise TypeError(
                    f"load_weights: {name!r} has dtype {tensor.dtype}; takes {sorted(_DTYPE_NAMES.values())}"
                )
            offset = -(-offset // _ALIGN) * _ALIGN
            layout.append((name, tensor, offset))
            offset += tensor.numel() * tensor.element_size()
        self._check_fits(tensors)
        with self._held(send_load=False):  # the engine process reads the file only while it holds the pipes
            shared = self._child.map_weights(max(offset, 1))
            for _, tensor, start in layout:
                if tensor.numel():
                    target = torch.frombuffer(shared, dtype=tensor.dtype, count=tensor.numel(), offset=start)
                    target.view(tensor.shape).copy_(tensor.detach().to("cpu"))
                    del target  # no view may outlive the mapping
            header = [[name, _DTYPE_NAMES[t.dtype], list(t.shape), start] for name, t, start in layout]
            self._pending_load = {"op": "load_shared", "tensors": header, "weight_version": weight_version}
        self._weight_version = weight_version

    def _check_fits(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Refuse weights the engine's model would not take: a name it lacks, a weight it has none
        of (tied weights share one: either name will do), a shape other than its own."""
        unexpected = [name for name in tensors if name not in self._shapes]
        covered = {self._storage[name] for name in tensors if name in self._storage}
        missing = [name for name, storage in self._storage.items() if storage not in covered]
        if unexpected or missing:
            raise ValueError(
                f"{self._name}: load_weights: the weights do not fit the model: missing {missing[:5]}, "
                f"unexpected {unexpected[:5]}"
            )
        for name, tensor in tensors.items():
            if tuple(tensor.shape) != self._shapes[name]:
                raise ValueError(
                    f"{self._name}: load_weights: {name!r} has shape {tuple(tensor.shape)}, the model's is "
                    f"{self._shapes[name]}"
                )

    async def weight_version(self) -> int | None:
        """The version of the weights sampled from now."""
        return self._weight_version

    async def health(self) -> bool:
        """Whether the engine process is up and answering."""
        return self._reaper.alive and self._error is None and self._child.process.poll() is None

    # ------------------------------------------------------------ one request

    def _call(self, request: dict[str, Any], body: bytes = b"") -> tuple[dict[str, Any], bytes]:
        """Send `request` (with `body`), return the answer; the engine's own errors come back as
        ValueError or TypeError (a bad request) or RuntimeError, a dead or hung process as
        EngineProcessError."""
        with self._held():
            answer, body = self._exchange(request, body)
        if not answer.get("ok"):
            error_type = {"ValueError": ValueError, "TypeError": TypeError}.get(
                str(answer.get("error_type")), RuntimeError
            )
            raise error_type(f"{self._name}: {answer.get('error_type')}: {answer.get('error')}")
        return answer, body

    def _exchange(self, request: dict[str, Any], body: bytes = b"") -> tuple[dict[str, Any], bytes]:
        """Write `request`, read its answer, within timeout_s (the caller holds the pipes)."""
        deadline = time.monotonic() + self._timeout_s
        with self._guard(request["op"]):
            write_frame(self._child.requests_fd, encode_frame(request, body), deadline=deadline)
            return read_frame(self._child.answers_fd, deadline=deadline)

    @contextlib.contextmanager
    def _held(self, *, send_load: bool = True) -> Iterator[None]:
        """The pipes to this caller alone (bounded by timeout_s); `send_load`: the staged weight
        load sent and answered first, so the engine process has taken every load before this."""
        if self._error is not None:
            raise self._error
        if not self._reaper.alive:
            raise EngineProcessError(f"{self._name}: the engine is closed")
        if not self._lock.acquire(timeout=self._timeout_s):
            raise TimeoutError(f"{self._name}: another request held the engine for timeout_s={self._timeout_s}")
        try:
            if send_load and self._pending_load is not None:
                load, self._pending_load = self._pending_load, None
                answer, _ = self._exchange(load)
                if not answer.get("ok"):
                    raise self._broken(
                        f"refused the weight load of version {load['weight_version']} after load_weights returned "
                        f"({answer.get('error_type')}: {answer.get('error')}), so it no longer serves the "
                        "version it was given",
                        kill=True,
                    )
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
            process.wait(timeout=_CLOSE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
        tail = stderr_path.read_bytes()[-_STDERR_TAIL_BYTES:] if stderr_path.exists() else b""
        if self._reaper.detach() is not None:
            self._child.reap(kill=True)
        text = tail.decode(errors="replace").strip()
        self._error = EngineProcessError(
            f"{self._name}: engine process {process.pid} {what}; "
            + ("killed" if kill else f"exit code {process.returncode}")
            + (f"; stderr tail:\n{text}" if text else "; no stderr")
        )
        return self._error


def _start(model_dir: Path, args: list[str], *, owned_dir: Path | None, module: str) -> _Child:
    """Start the engine process (`python -m module`): its pipes, its abort flag file and its stderr file."""
    shm = _SHM_DIR if os.access(_SHM_DIR, os.W_OK) else None
    fd, control_name = tempfile.mkstemp(prefix="rollouts-engine-control-", dir=shm)
    os.write(fd, b"\0" * mmap.PAGESIZE)
    control = mmap.mmap(fd, mmap.PAGESIZE)
    os.close(fd)
    weights_fd, weights_name = tempfile.mkstemp(prefix="rollouts-engine-weights-", dir=shm)
    os.close(weights_fd)
    fd, stderr_name = tempfile.mkstemp(prefix="rollouts-engine-stderr-")
    requests_r, requests_w = os.pipe()
    answers_r, answers_w = os.pipe()
    command = [sys.executable, "-m", module, "--model-dir", str(model_dir)]
    command += ["--requests-fd", str(requests_r), "--answers-fd", str(answers_w), "--control", control_name]
    command += ["--weights", weights_name, *args]
    try:
        process = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=fd, stderr=fd, pass_fds=(requests_r, answers_w)
        )
    except BaseException:
        for f in (requests_r, requests_w, answers_r, answers_w, fd):
            os.close(f)
        control.close()
        for name in (control_name, stderr_name, weights_name):
            os.unlink(name)
        raise
    for f in (requests_r, answers_w, fd):  # the child's ends: its exit closes the pipes
        os.close(f)
    os.set_blocking(requests_w, False)
    os.set_blocking(answers_r, False)
    return _Child(
        process=process,
        requests_fd=requests_w,
        answers_fd=answers_r,
        control=control,
        weights_file=Path(weights_name),
        files=(Path(stderr_name), Path(control_name), Path(weights_name)),
        dirs=() if owned_dir is None else (owned_dir,),
    )
