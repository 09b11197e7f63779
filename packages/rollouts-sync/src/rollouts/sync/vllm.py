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

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import anyio
import httpx

from rollouts.sync._common import check_params, check_prompts, check_weight_version, is_adapter_dir, make_sample
from rollouts.sync._http import DEFAULT_HTTP, EngineError, HTTPEngineBase, HTTPOptions
from rollouts.sync.fingerprint import check_attestation, fingerprint, fingerprint_dir
from rollouts.sync.partial import PARTIAL
from rollouts.sync.tensor_rpc import (
    TensorUpload,
    merge_checksums,
    raise_on_rpc_error,
    raw_tensors,
    tensor_rpc_bodies,
    upload_of,
)
from rollouts.types import Sample, SamplingParams, Status

WORKER_EXTENSION_CLS = "rollouts.sync.worker_extension.SafetensorsWeightLoader"
"""Pass to vLLM as --worker-extension-cls so update_weights_from_tensors works without a shared disk."""

_TOKEN_ID_PREFIX = "token_id:"  # vLLM's spelling of tokens when return_tokens_as_token_ids is set
_DEFAULT_CHUNK_BYTES = 256 * 1024 * 1024  # one /collective_rpc body stays well below HTTP server limits


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
        `attest`: after each weight update, check the checksums the worker extension reports of the
        weights it received (rollouts.sync.fingerprint) against the sender's, and raise AttestationError
        naming the tensors that differ; a disk update asks for them with the `rollouts_fingerprint` rpc
        and reads the checkpoint here too (so the path must be readable by this process as well). Needs
        the server started with the worker extension; LoRA adapter loads are not attested."""
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
        rpc = {"method": "reload_weights", "kwargs": {"weights_path": path}}

        async def expected() -> dict[str, int]:  # read here once the engine has loaded the same files
            try:
                return await anyio.to_thread.run_sync(fingerprint_dir, path)
            except (OSError, ValueError) as e:
                raise ValueError(
                    f"{self.name}: attesting a disk sync reads the checkpoint here too, and {path!r} cannot be "
                    f"read here ({e}); pass attest=False (engine.attest = false) where only the server sees it"
                ) from e

        check = {"method": "rollouts_fingerprint", "kwargs": {"weights_path": path}}
        await self._paused_update([rpc], version, expected=expected if self.attest else None, fingerprint_rpc=check)

    async def _load_adapter(self, path: str, version: int) -> None:
        """Load the adapter at `path` as `<prefix>-v<version>`, route generation to it, drop the old one."""
        name, previous = f"{self.adapter_prefix}-v{version}", self._adapter
        await self.model_name()  # the base model's name, asked before adapters are listed beside it
        async with self._paused("/pause", "/resume", params={"mode": self.pause_mode}):
            body = {"lora_name": name, "lora_path": path, "load_inplace": name == previous}
            try:
                await self._call("POST", "/v1/load_lora_adapter", json=body)
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
        await self._check_version(version)

    async def update_weights_from_tensors(
        self, tensors: Mapping[str, Any], weight_version: int, *, chunk_bytes: int = _DEFAULT_CHUNK_BYTES
    ) -> TensorUpload:
        """Send `tensors` (HF checkpoint names; a subset updates only those) in the request body, each
        in its own dtype: numpy arrays, torch tensors of any dtype (bfloat16 included) or RawTensors.
        Returns (and keeps as `last_upload`) the bytes moved.

        Needs the server started with --worker-extension-cls WORKER_EXTENSION_CLS; no shared disk.
        """
        version = check_weight_version(weight_version)
        raw = raw_tensors(tensors)
        rpcs = tensor_rpc_bodies(raw, chunk_bytes=chunk_bytes)
        sent = await anyio.to_thread.run_sync(fingerprint, raw) if self.attest else {}

        async def expected() -> dict[str, int]:
            return sent

        await self._paused_update(rpcs, version, expected=expected if self.attest else None)
        self.last_upload = upload_of(raw, rpcs)
        return self.last_upload

    async def _paused_update(
        self,
        rpcs: list[dict[str, Any]],
        version: int,
        *,
        expected: Callable[[], Awaitable[dict[str, int]]] | None = None,
        fingerprint_rpc: dict[str, Any] | None = None,
    ) -> None:
        """Run `rpcs` paused; with `expected` (the sender's checksums, asked once they ran), compare the
        checksums each worker reported (those of `fingerprint_rpc`'s answer where given) with them."""
        # Pause so no request straddles two weight versions; resume even when the update fails,
        # so a failed sync leaves the engine serving (old weights) rather than stuck paused.
        async with self._paused("/pause", "/resume", params={"mode": self.pause_mode}):
            reported: list[dict[str, int]] = []
            for rpc in rpcs:
                reported = merge_checksums(reported, await self._rpc(rpc))
            if expected is not None:  # before the version is set: a failed check never claims it
                if fingerprint_rpc is not None:
                    reported = merge_checksums([], await self._fingerprint_rpc(fingerprint_rpc))
                sent = await expected()
                for worker in reported or [{}]:
                    check_attestation(sent, worker, engine=self.name, weight_version=version)
            await self.reset_prefix_cache()
            await self._call("POST", "/update_weight_version", json={"new_version": str(version)})
            self._adapter = None  # full weights: the base model serves again
        await self._check_version(version)

    async def _rpc(self, rpc: dict[str, Any]) -> dict[str, Any]:
        data = self._json_or_empty(await self._call("POST", "/collective_rpc", json=rpc))
        raise_on_rpc_error(data, engine=self.name, url=f"{self.name}/collective_rpc")
        return data

    async def _fingerprint_rpc(self, rpc: dict[str, Any]) -> dict[str, Any]:
        try:
            return await self._rpc(rpc)
        except EngineError as e:
            raise EngineError(
                f"{e} (attestation asks the worker extension for the checksums of what it loaded: start the "
                f"server with --worker-extension-cls {WORKER_EXTENSION_CLS}, as `rollouts engine vllm` does, "
                "or pass attest=False / set engine.attest = false)",
                engine=e.engine,
                url=e.url,
                status=e.status,
                text=e.text,
            ) from e

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


def parse_completion_response(
    data: Mapping[str, Any],
    prompts_P: list[list[int]],
    params: SamplingParams,
    *,
    weight_version: int | None,
    engine: str,
    logprobs_of: str | None = None,
    keep_partial: bool = False,
) -> list[Sample]:
    """[P * G] Samples from a /v1/completions response, ordered by choice index (prompt-major).
    With `keep_partial`, a choice with finish_reason "abort" is a partial Sample (status ABORTED,
    metadata["partial"] = True) holding the tokens and log-probs generated before the abort."""
    choices = sorted(data.get("choices") or [], key=lambda c: c["index"])
    expected = len(prompts_P) * params.n
    if len(choices) != expected:
        raise EngineError(
            f"{engine}: /v1/completions returned {len(choices)} choices, expected {len(prompts_P)} prompts x n={params.n}",
            engine=engine,
            url=f"{engine}/v1/completions",
            status=200,
            text=str(data)[:500],
        )
    samples = []
    for i, choice in enumerate(choices):
        finish = choice.get("finish_reason")
        partial = keep_partial and finish == "abort"
        if finish not in ("stop", "length") and not partial:  # "abort" (a pause in mode abort), "error", or none at all
            raise EngineError(
                f"{engine}: choice {i} ended with finish_reason={finish!r}, not 'stop' or 'length': "
                "a partial response, never to be scored as finished",
                engine=engine,
                url=f"{engine}/v1/completions",
                status=200,
                text=str(choice)[:500],
            )
        prompt = prompts_P[i // params.n]
        response_ids, logprobs_R = _choice_tokens(choice, want_logprobs=params.logprobs, engine=engine)
        samples.append(
            make_sample(
                prompt_ids=prompt,
                response_ids=response_ids,
                logprobs_R=logprobs_R,
                truncated=finish == "length",
                weight_version=weight_version,
                engine=engine,
                logprobs_of=logprobs_of,
            )
        )
        if partial:
            samples[-1] = replace(samples[-1], status=Status.ABORTED, metadata={**samples[-1].metadata, PARTIAL: True})
    return samples


def _choice_tokens(
    choice: Mapping[str, Any], *, want_logprobs: bool, engine: str
) -> tuple[list[int], list[float] | None]:
    logprobs = choice.get("logprobs")
    ids = choice.get("token_ids")
    if logprobs is not None and logprobs.get("tokens") is not None:
        from_logprobs = [_token_id(t, engine=engine) for t in logprobs["tokens"]]
        if ids is not None and list(ids) != from_logprobs:
            raise EngineError(
                f"{engine}: token_ids and logprobs.tokens disagree",
                engine=engine,
                url=f"{engine}/v1/completions",
                status=200,
                text=str(choice)[:500],
            )
        ids = from_logprobs
    if ids is None:
        raise EngineError(
            f"{engine}: a choice carries neither token_ids nor logprobs.tokens",
            engine=engine,
            url=f"{engine}/v1/completions",
            status=200,
            text=str(choice)[:500],
        )
    if not want_logprobs:
        return [int(t) for t in ids], None
    if logprobs is None:
        raise EngineError(
            f"{engine}: logprobs were asked for but the choice has none",
            engine=engine,
            url=f"{engine}/v1/completions",
            status=200,
            text=str(choice)[:500],
        )
    return [int(t) for t in ids], [float(x) for x in logprobs["token_logprobs"]]


def _token_id(token: str, *, engine: str) -> int:
    if not token.startswith(_TOKEN_ID_PREFIX):
        raise EngineError(
            f"{engine}: token {token!r} is not in 'token_id:N' form (return_tokens_as_token_ids ignored?)",
            engine=engine,
            url=f"{engine}/v1/completions",
            status=200,
            text=token,
        )
    return int(token[len(_TOKEN_ID_PREFIX) :])
