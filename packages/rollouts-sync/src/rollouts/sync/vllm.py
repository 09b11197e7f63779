"""Client for a vLLM OpenAI-compatible server: generate from token ids, reload weights, report health.

Weight updates use vLLM's development endpoints (server started with VLLM_SERVER_DEV_MODE=1):
POST /pause?mode=wait, POST /collective_rpc {"method": "reload_weights"}, POST /reset_prefix_cache,
POST /update_weight_version {"new_version"}, POST /resume, GET /weight_info. vLLM keeps the
weight version as a string; this client writes str(int) and reads it back as an int.

A LoRA adapter directory (PEFT's adapter_config.json + adapter_model.safetensors) given to
`update_weights_from_disk` is loaded with vLLM's runtime LoRA endpoints instead (server started
with --enable-lora --max-lora-rank R and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1): under the same pause,
POST /v1/load_lora_adapter {"lora_name": "<prefix>-v<version>", "lora_path"}, the prefix cache
reset and the version set; generation is then routed to that adapter (the completion's "model")
and the previous version's adapter is unloaded (POST /v1/unload_lora_adapter).

Legend: P prompts, G samples per prompt, R response tokens.
"""

from __future__ import annotations

import secrets
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any

import anyio
import httpx

from rollouts.sync._common import (
    check_params,
    check_prompts,
    check_weight_version,
    is_adapter_dir,
    is_this_machine,
    local_address_toward,
)
from rollouts.sync._http import DEFAULT_HTTP, EngineError, HTTPEngineBase, HTTPOptions, RetryPolicy
from rollouts.sync.fingerprint import check_attestation, fingerprint, fingerprint_dir
from rollouts.sync.raw import safetensors_header
from rollouts.sync.raw_server import serve_bytes
from rollouts.sync.tensor_rpc import (
    DEFAULT_CHUNK_BYTES,
    WORKER_EXTENSION_CLS,
    Background,
    TensorUpload,
    fetch_rpc_body,
    held_rpc_body,
    merge_checksums,
    raise_on_rpc_error,
    raw_tensors,
    tensor_rpc_bodies,
    upload_of,
    with_extension_hint,
)
from rollouts.sync.vllm_completions import parse_completion_response
from rollouts.types import Sample, SamplingParams

__all__ = ["WORKER_EXTENSION_CLS", "VLLMEngine", "parse_completion_response"]

_NO_RETRY = RetryPolicy(max_retries=0)
_DISCARD_TIMEOUT_S = 5.0  # dropping a held sync after a failure: it must not hold up the error for long


class VLLMEngine(HTTPEngineBase):
    """One vLLM server reached over HTTP; implements rollouts.types.InferenceEngine."""

    WEIGHT_VERSION_PATH = "/weight_info"
    HEALTH_PATH = "/health"

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        http: HTTPOptions = DEFAULT_HTTP,
        model: str | None = None,
        pause_mode: str = "wait",
        adapter_prefix: str = "rollouts",
        logprobs_mode: str = "processed_logprobs",
        keep_partial: bool = False,
        attest: bool = True,
        tensor_wire: str = "fetch",
    ) -> None:
        """`http`: the per-attempt timeout, retries and connection pool. `model`: the served model's
        name (None: asked from /v1/models once). `pause_mode`: how a weight update pauses generation
        ("wait" drains the requests in flight, "abort" cuts them short, "keep" holds them).
        `adapter_prefix`: LoRA adapters are loaded as "<prefix>-v<version>".
        `logprobs_mode`: the --logprobs-mode the server was started with (`rollouts engine vllm`
        and rollouts.sync.launch start it with "processed_logprobs"); samples record which
        distribution their log-probs describe from it (metadata["logprobs_of"]).
        `keep_partial`: a response cut short by an abort (finish_reason "abort", a pause in mode
        "abort") comes back as a partial Sample (status ABORTED, metadata["partial"]) to continue
        with rollouts.sync.partial.continue_partials, instead of failing the request.
        `attest`: in each weight update, check the checksums the worker extension reports of the
        weights it received (rollouts.sync.fingerprint) against the sender's before they are loaded,
        and raise AttestationError naming the tensors that differ (nothing loaded: the engine serves
        the weights it had); a disk update is then loaded by the extension's `rollouts_load_dir`
        rpc (the files read once, their checksums answered) and the checkpoint is read here too (so the
        path must be readable by this process as well). Needs the server started with the worker
        extension; LoRA adapter loads are not attested.
        `tensor_wire`: how `update_weights_from_tensors` moves the bytes: "fetch" (the server's workers
        GET the raw safetensors bytes from a one-off URL this process serves: the tensors' own bytes on
        the wire; needs a route from the server to this machine), "inline" (base64 in the JSON
        /collective_rpc bodies: a third more bytes, for a server that cannot reach this machine) or
        "ipc" (a server on this machine: its workers copy the weights out of this process's memory,
        bucket by bucket, by CUDA IPC handles for tensors on a GPU, else through files in /dev/shm;
        needs torch, rollouts.sync.ipc)."""
        if tensor_wire not in ("fetch", "inline", "ipc"):
            raise ValueError(f"tensor_wire must be 'fetch', 'inline' or 'ipc', got {tensor_wire!r}")
        host = httpx.URL(base_url).host
        if tensor_wire == "ipc" and not is_this_machine(host):
            raise ValueError(
                f"tensor_wire='ipc' has the server copy the weights out of this process's memory, so the server "
                f"must run on this machine, and {host!r} ({base_url}) is not one of its addresses: use 'fetch'"
            )
        self.tensor_wire = tensor_wire
        if pause_mode not in ("wait", "abort", "keep"):
            raise ValueError(f"pause_mode must be 'wait', 'abort' or 'keep', got {pause_mode!r}")
        if logprobs_mode not in ("processed_logprobs", "raw_logprobs"):
            raise ValueError(f"logprobs_mode must be 'processed_logprobs' or 'raw_logprobs', got {logprobs_mode!r}")
        self.logprobs_mode = logprobs_mode
        super().__init__(base_url, api_key=api_key, http=http)
        self.pause_mode = pause_mode
        self.keep_partial = keep_partial
        self._model = model
        self.adapter_prefix = adapter_prefix
        self._adapter: str | None = None  # the LoRA adapter generation is routed to, once one is loaded
        self.attest = attest
        self.last_upload: TensorUpload | None = None
        """What the last `update_weights_from_tensors` moved (None before the first)."""
        self._shm_buckets: Any = None  # the IPC wire's file in /dev/shm (rollouts.sync.ipc.ShmBuckets), once used

    async def aclose(self) -> None:
        """Close the HTTP connections and remove the IPC wire's file in /dev/shm, if any."""
        if self._shm_buckets is not None:
            self._shm_buckets.close()
        await super().aclose()

    @property
    def adapter(self) -> str | None:
        """Name of the LoRA adapter that serves generation (None: the base model's weights)."""
        return self._adapter

    async def model_name(self) -> str:
        """The served model name (asked once from /v1/models, then remembered)."""
        if self._model is None:
            data = (await self._call("GET", "/v1/models")).json()
            models = data.get("data") or []
            if not models:
                raise EngineError(f"{self.name}: /v1/models lists no model", engine=self.name, url=self.name)
            self._model = str(models[0]["id"])
        return self._model

    def completion_request(self, prompts_P: list[list[int]], params: SamplingParams, model: str) -> dict[str, Any]:
        """The /v1/completions body for token-id prompts (pure; exposed for tests)."""
        body: dict[str, Any] = {
            "model": model,
            "prompt": prompts_P,
            "n": params.n,
            "max_tokens": params.max_new_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k,
            "stop_token_ids": list(params.stop_token_ids),
            # logprobs=0: the sampled token's log-prob only, no top-k alternatives
            "logprobs": 0 if params.logprobs else None,
            # without it byte-level tokens come back as "" and cannot be mapped to ids
            "return_tokens_as_token_ids": True,
            "return_token_ids": True,
            "skip_special_tokens": False,
        }
        if params.seed is not None:
            body["seed"] = params.seed
        return body

    async def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Sample]:
        """[P * G] Samples in prompt-major order (all G of prompt 0, then prompt 1, ...)."""
        prompts_P = check_prompts(prompts)
        params = check_params(params)
        body = self.completion_request(prompts_P, params, self._adapter or await self.model_name())
        version = self._weight_version
        data = (await self._call("POST", "/v1/completions", json=body)).json()
        of = "sampling" if self.logprobs_mode == "processed_logprobs" and params.temperature > 0 else "model"
        return parse_completion_response(
            data,
            prompts_P,
            params,
            weight_version=version,
            engine=self.name,
            logprobs_of=of,
            keep_partial=self.keep_partial,
        )

    async def update_weights_from_disk(self, path: str, weight_version: int) -> None:
        """Reload weights from checkpoint dir `path` (as the server sees it) and record `weight_version`."""
        if not isinstance(path, str) or not path:
            raise ValueError(f"path must be a non-empty str, got {path!r}")
        version = check_weight_version(weight_version)
        if is_adapter_dir(path):
            await self._load_adapter(path, version)
            return
        if not self.attest:
            await self._paused_update([{"method": "reload_weights", "kwargs": {"weights_path": path}}], version)
            return
        # the worker reads the files once, answering their checksums; ours are read here meanwhile
        sent = Background(fingerprint_dir, path)

        async def expected() -> dict[str, int]:
            try:
                return await sent.result()
            except (OSError, ValueError) as e:
                raise ValueError(
                    f"{self.name}: attesting a disk sync reads the checkpoint here too, and {path!r} cannot be "
                    f"read here ({e}); pass attest=False (engine.attest = false) where only the server sees it"
                ) from e

        rpc = {"method": "rollouts_load_dir", "kwargs": {"weights_path": path}}
        await self._paused_update([rpc], version, expected=expected)

    async def _load_adapter(self, path: str, version: int) -> None:
        """Load the adapter at `path` as `<prefix>-v<version>`, route generation to it, drop the old one."""
        async with self._paused("/pause", "/resume", params={"mode": self.pause_mode}):
            await self.activate_adapter(path, version)
        await self._check_version(version)

    async def activate_adapter(self, path: str, version: int) -> None:
        """Under a pause: load the adapter at `path` (as the server sees it) as `<prefix>-v<version>`,
        reset the prefix cache, set the version, route generation to it and unload the previous one."""
        name, previous = f"{self.adapter_prefix}-v{version}", self._adapter
        await self.model_name()  # the base model's name, asked before adapters are listed beside it
        # in place whatever this client knows: a server that outlived a trainer resumed from an earlier
        # step may hold this version's name already (vLLM refuses a name it holds otherwise)
        body = {"lora_name": name, "lora_path": path, "load_inplace": True}
        try:  # never retried: a retry of a load that landed would be refused as loaded already
            await self._call("POST", "/v1/load_lora_adapter", json=body, retry=_NO_RETRY)
        except EngineError as e:
            raise EngineError(
                f"{e} (a LoRA adapter sync needs vLLM started with --enable-lora --max-lora-rank >= the "
                "adapter's rank and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1, e.g. `rollouts engine vllm "
                "--max-lora-rank R`; or set model.lora.sync = 'merged')",
                engine=e.engine,
                url=e.url,
                status=e.status,
                text=e.text,
            ) from e
        await self.reset_prefix_cache()
        await self._call("POST", "/update_weight_version", json={"new_version": str(version)})
        self._adapter = name
        if previous is not None and previous != name:
            await self._call("POST", "/v1/unload_lora_adapter", json={"lora_name": previous})

    async def update_weights_from_tensors(
        self,
        tensors: Mapping[str, Any],
        weight_version: int,
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        serve_host: str | None = None,
    ) -> TensorUpload:
        """Send `tensors` (HF checkpoint names; a subset updates only those), each in its own dtype:
        numpy arrays, torch tensors of any dtype (bfloat16 included) or RawTensors. Returns (and keeps
        as `last_upload`) the bytes moved.

        With tensor_wire "fetch" the workers GET them as one raw safetensors payload served here on
        `serve_host` (None: this machine's address on the route to the server); with "inline" they
        travel base64-encoded in /collective_rpc bodies of at most ~`chunk_bytes` tensor bytes each;
        with "ipc" the workers map buckets of at most ~`chunk_bytes` of this process's memory (torch
        tensors all on one device; on a GPU, CUDA IPC).
        Needs the server started with --worker-extension-cls WORKER_EXTENSION_CLS; no shared disk.
        """
        version = check_weight_version(weight_version)
        if self.tensor_wire == "ipc":
            return await self._update_by_ipc(tensors, version, chunk_bytes)
        raw = await anyio.to_thread.run_sync(raw_tensors, tensors)  # a GPU tensor's copy to the host waits here
        sent = Background(fingerprint, raw).result if self.attest else None
        if self.tensor_wire == "inline":
            rpcs = tensor_rpc_bodies(raw, chunk_bytes=chunk_bytes)
            # never retried: a worker drops what it staged when a chunk fails, so a retried chunk
            # would stage onto nothing and the last would load the update in part
            await self._paused_update(rpcs, version, expected=sent, retry=_NO_RETRY)
            self.last_upload = upload_of(raw, rpcs)
            return self.last_upload
        host = serve_host or local_address_toward(str(httpx.URL(self.name).host))
        parts = [safetensors_header(raw), *(t.data for t in raw.values())]
        async with serve_bytes(parts, host=host, timeout_s=self.timeout_s) as served:
            rpc = fetch_rpc_body(served.url, served.num_bytes, timeout_s=self.timeout_s, checksums=self.attest)
            # never retried (a retry would queue a second fetch and load behind the first), and bounded
            # by the worker's fetch plus as long again for its load (unattested; attested, the commit's load)
            await self._paused_update([rpc], version, expected=sent, retry=_NO_RETRY, rpc_timeout_s=2 * self.timeout_s)
        self.last_upload = upload_of(raw, [rpc], fetched_bytes=served.sent_bytes)
        return self.last_upload

    async def _update_by_ipc(self, tensors: Mapping[str, Any], version: int, bucket_bytes: int) -> TensorUpload:
        from rollouts.sync.ipc import IpcUpdate, ShmBuckets  # needs torch, as the tensors it shares do

        if self._shm_buckets is None:  # kept from sync to sync: its pages are allocated once
            self._shm_buckets = ShmBuckets()
        update = IpcUpdate(
            tensors, bucket_bytes=bucket_bytes, weight_version=version, checksums=self.attest, shm=self._shm_buckets
        )
        sent = Background(lambda _: update.expected(), None).result if self.attest else None
        rpcs = update.rpcs()
        try:  # a bucket is never sent twice: a worker that took it (or failed it) would refuse it out of turn
            await self._paused_update(rpcs, version, expected=sent, retry=_NO_RETRY)
        finally:
            rpcs.close()  # the bucket still shared, if the sync failed, is freed
        self.last_upload = update.upload()
        return self.last_upload

    async def _paused_update(
        self,
        rpcs: Iterable[dict[str, Any]],
        version: int,
        *,
        expected: Callable[[], Awaitable[dict[str, int]]] | None = None,
        retry: RetryPolicy | None = None,
        rpc_timeout_s: float | None = None,
    ) -> None:
        """Run `rpcs` paused, in order, each asked for once the one before it answered; with `expected`
        (the sender's checksums, asked once they ran), the workers hold what they received unloaded
        (hold=<a token of this sync>), and load it (rollouts_commit) only once the checksums each
        reported equal the sender's; on a mismatch or a failure they drop it unloaded (rollouts_discard;
        after a cancellation, a deadline's, nothing more is sent: the next receive drops it), and the
        engine goes on serving the version it had.
        `retry` and `rpc_timeout_s`: each rpc's and the commit's (None: the engine's policy and timeout)."""
        # Pause so no request straddles two weight versions; resume even when the update fails,
        # so a failed sync leaves the engine serving (old weights) rather than stuck paused.
        async with self._paused("/pause", "/resume", params={"mode": self.pause_mode}):
            token = secrets.token_hex(8) if expected is not None else "0"
            holding = False  # whether a worker may hold this sync's tensors
            try:
                reported: list[dict[str, int]] = []
                pending = iter(rpcs)  # each body made in a thread: staging an IPC bucket copies it there
                while (rpc := await anyio.to_thread.run_sync(next, pending, None)) is not None:
                    if expected is not None:
                        rpc, holding = {**rpc, "kwargs": {**rpc["kwargs"], "hold": token}}, True
                    reported = merge_checksums(reported, await self._rpc(rpc, retry=retry, timeout_s=rpc_timeout_s))
                if expected is not None:  # before the load and the version: a failed check loads nothing
                    sent = await expected()
                    for worker in reported or [{}]:
                        check_attestation(sent, worker, engine=self.name, weight_version=version)
                    await self._rpc(held_rpc_body("rollouts_commit", token), retry=_NO_RETRY, timeout_s=rpc_timeout_s)
            except BaseException as exc:
                if holding and not isinstance(exc, anyio.get_cancelled_exc_class()):
                    await self._discard_held(token)
                raise
            await self.reset_prefix_cache()
            await self._call("POST", "/update_weight_version", json={"new_version": str(version)})
            self._adapter = None  # full weights: the base model serves again
        await self._check_version(version)

    async def _discard_held(self, token: str) -> None:
        """Have the workers drop what sync `token` holds, unloaded, after the sync failed: best effort
        (the next receive drops it too), within `_DISCARD_TIMEOUT_S` and whatever is left of the
        caller's deadline (shielded, so the sync's own error is the one raised, never a timeout of this)."""
        left = min(_DISCARD_TIMEOUT_S, anyio.current_effective_deadline() - anyio.current_time())
        with anyio.CancelScope(shield=True), anyio.move_on_after(left):
            try:
                await self._rpc(held_rpc_body("rollouts_discard", token), retry=_NO_RETRY, timeout_s=max(left, 0.001))
            except EngineError:
                pass

    async def _rpc(
        self, rpc: dict[str, Any], *, retry: RetryPolicy | None = None, timeout_s: float | None = None
    ) -> dict[str, Any]:
        try:
            response = await self._call("POST", "/collective_rpc", json=rpc, retry=retry, timeout_s=timeout_s)
            data = self._json_or_empty(response)
            raise_on_rpc_error(data, engine=self.name, url=f"{self.name}/collective_rpc")
        except EngineError as e:
            raise with_extension_hint(e, rpc["method"]) from e
        return data

    async def _check_version(self, version: int) -> None:
        got = await self.weight_version()
        if got != version:
            raise EngineError(
                f"{self.name}: weight version reads {got!r} after setting {version}",
                engine=self.name,
                url=f"{self.name}/weight_info",
                status=200,
                text=str(got),
            )

    async def reset_prefix_cache(self) -> None:
        """Drop cached prefixes: without this they keep serving KV computed with the old weights."""
        data = self._json_or_empty(await self._call("POST", "/reset_prefix_cache"))
        if data.get("success") is False:
            raise EngineError(
                f"{self.name}: /reset_prefix_cache answered success=false (blocks still held by running requests)",
                engine=self.name,
                url=f"{self.name}/reset_prefix_cache",
                status=200,
                text=str(data),
            )

    @staticmethod
    def _json_or_empty(response: httpx.Response) -> dict[str, Any]:
        if not response.content:
            return {}
        data = response.json()
        return data if isinstance(data, dict) else {"results": data}
