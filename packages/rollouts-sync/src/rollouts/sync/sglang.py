"""Client for an SGLang server's native API: /generate with input_ids, weight reload from disk, health.

Shapes follow sglang/srt/entrypoints/http_server.py:
- POST /generate {"input_ids": [[...], ...], "sampling_params": {...}, "return_logprob": true}
  -> a list (one entry per input) of {"text", "output_ids", "meta_info": {"output_token_logprobs":
  [[logprob, token_id, text|null], ...], "finish_reason": {"type": "length"|"stop"|"abort", ...},
  "weight_version": str, ...}}
- POST /update_weights_from_disk {"model_path", "weight_version": str, "abort_all_requests"}
  -> {"success", "message", "num_paused_requests"} (400 with success=false on failure)
- POST /flush_cache, POST /pause_generation {"mode": "abort"|"retract"|"in_place"} (SGLang >= 0.5.8
  refuses it without a body), POST /continue_generation {}, GET /health_generate,
  GET /get_weight_version -> {"weight_version": str} (gone in 0.5.23: GET /model_info has it, and
  /get_model_info in the versions before)
Each prompt is sent G times (prompt-major) with n=1, so the response order is the Sample order.

Legend: P prompts, G samples per prompt, R response tokens.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rollouts.sync._common import (
    check_params,
    check_prompts,
    check_weight_version,
    is_adapter_dir,
    make_sample,
    parse_weight_version,
)
from rollouts.sync._http import DEFAULT_HTTP, EngineError, HTTPEngineBase, HTTPOptions
from rollouts.types import Sample, SamplingParams


class SGLangEngine(HTTPEngineBase):
    """One SGLang server reached over HTTP; implements rollouts.types.InferenceEngine."""

    WEIGHT_VERSION_PATH = "/get_weight_version"
    WEIGHT_VERSION_PATHS = ("/get_weight_version", "/model_info", "/get_model_info")
    """Where SGLang versions report the weight version: the first that exists is used from then on."""
    HEALTH_PATH = "/health_generate"  # generates one token: a server that cannot generate is unhealthy
    PAUSE_MODES = ("retract", "abort", "in_place")

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        http: HTTPOptions = DEFAULT_HTTP,
        pause_mode: str = "retract",
    ) -> None:
        """`http`: the per-attempt timeout, retries and connection pool. `pause_mode`: what a weight
        update does with generation in flight ("retract": back to the queue, finished on the new
        weights after the update, its sample's weight_version the one it finished under; "abort":
        cut short, which fails the /generate call that sent it; "in_place": held where it is, which
        SGLang's cache flush refuses while requests run)."""
        if pause_mode not in self.PAUSE_MODES:
            raise ValueError(f"pause_mode must be one of {self.PAUSE_MODES}, got {pause_mode!r}")
        super().__init__(base_url, api_key=api_key, http=http)
        self.pause_mode = pause_mode
        self._version_paths: tuple[str, ...] = self.WEIGHT_VERSION_PATHS
        self._broadcast_group = ""  # the weights-update group it was last asked to join (rollouts.sync.broadcast)

    def paused(self) -> Any:
        """Generation paused for the body of an `async with` (a weight update), resumed after it."""
        return self._paused("/pause_generation", "/continue_generation", bodies=({"mode": self.pause_mode}, {}))

    async def weight_version(self) -> int | None:
        """The version the server reports (None before the first update)."""
        for i, path in enumerate(self._version_paths):
            try:
                data = (await self._call("GET", path)).json()
            except EngineError as e:
                if e.status == 404 and i + 1 < len(self._version_paths):
                    continue  # an SGLang without this endpoint: the next
                raise
            self._version_paths = self._version_paths[i:]
            self._weight_version = parse_weight_version(data.get("weight_version"))
            return self._weight_version
        raise AssertionError("unreachable: the last path's error is raised")

    @staticmethod
    def generate_request(prompts_P: list[list[int]], params: SamplingParams) -> dict[str, Any]:
        """The /generate body: each prompt repeated G times, prompt-major (pure; exposed for tests)."""
        sampling: dict[str, Any] = {
            "max_new_tokens": params.max_new_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k,
            "stop_token_ids": list(params.stop_token_ids),
            "skip_special_tokens": False,
            "n": 1,
        }
        rows = [p for p in prompts_P for _ in range(params.n)]
        per_row: dict[str, Any] | list[dict[str, Any]] = sampling
        if params.seed is not None:
            # SGLang's seeded sampler draws from (seed, position): one seed for every copy of a
            # prompt would give G identical responses (a group with no signal). Each row gets its own.
            per_row = [{**sampling, "sampling_seed": (params.seed + i) % 2**63} for i in range(len(rows))]
        return {
            "input_ids": rows,
            "sampling_params": per_row,
            "return_logprob": params.logprobs,
            "logprob_start_len": -1,  # response logprobs only, no prompt logprobs
        }

    async def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Sample]:
        """[P * G] Samples in prompt-major order (all G of prompt 0, then prompt 1, ...)."""
        prompts_P = check_prompts(prompts)
        params = check_params(params)
        data = (await self._call("POST", "/generate", json=self.generate_request(prompts_P, params))).json()
        return parse_generate_response(data, prompts_P, params, engine=self.name, fallback_version=self._weight_version)

    async def update_weights_from_disk(self, path: str, weight_version: int) -> None:
        """Reload weights from checkpoint dir `path` (as the server sees it) and record `weight_version`."""
        if not isinstance(path, str) or not path:
            raise ValueError(f"path must be a non-empty str, got {path!r}")
        version = check_weight_version(weight_version)
        if is_adapter_dir(path):
            raise ValueError(
                f"{path!r} is a LoRA adapter; {self.name} (SGLang) takes full weights only here: "
                "set model.lora.sync = 'merged'"
            )
        async with self.paused():
            body = {"model_path": path, "weight_version": str(version), "abort_all_requests": False}
            data = (await self._call("POST", "/update_weights_from_disk", json=body)).json()
            if not data.get("success", False):
                raise EngineError(
                    f"{self.name}: update_weights_from_disk failed: {data.get('message')}",
                    engine=self.name,
                    url=f"{self.name}/update_weights_from_disk",
                    status=200,
                    text=str(data.get("message")),
                )
            await self._call("POST", "/flush_cache")
        got = await self.weight_version()
        if got != version:
            raise EngineError(
                f"{self.name}: weight version reads {got!r} after setting {version}",
                engine=self.name,
                url=f"{self.name}/get_weight_version",
                status=200,
                text=str(got),
            )


def parse_generate_response(
    data: Any, prompts_P: list[list[int]], params: SamplingParams, *, engine: str, fallback_version: int | None
) -> list[Sample]:
    """[P * G] Samples from a /generate response (a list for batched input_ids)."""
    outputs = data if isinstance(data, list) else [data]
    expected = len(prompts_P) * params.n
    if len(outputs) != expected:
        raise EngineError(
            f"{engine}: /generate returned {len(outputs)} outputs, expected {expected}",
            engine=engine,
            url=f"{engine}/generate",
            status=200,
            text=str(data)[:500],
        )
    samples = []
    for i, out in enumerate(outputs):
        meta: Mapping[str, Any] = out.get("meta_info") or {}
        finish = meta.get("finish_reason") or {}
        if finish.get("type") == "abort":
            raise EngineError(
                f"{engine}: generation aborted: {finish.get('message')}",
                engine=engine,
                url=f"{engine}/generate",
                status=200,
                text=str(finish),
            )
        logprob_entries = meta.get("output_token_logprobs")
        if params.logprobs:
            if logprob_entries is None:
                raise EngineError(
                    f"{engine}: return_logprob was set but meta_info has no output_token_logprobs",
                    engine=engine,
                    url=f"{engine}/generate",
                    status=200,
                    text=str(meta)[:500],
                )
            response_ids = [int(entry[1]) for entry in logprob_entries]
            logprobs_R: list[float] | None = [float(entry[0]) for entry in logprob_entries]
        else:
            response_ids = [int(t) for t in out["output_ids"]]
            logprobs_R = None
        version = parse_weight_version(meta.get("weight_version"))
        samples.append(
            make_sample(
                prompt_ids=prompts_P[i // params.n],
                response_ids=response_ids,
                logprobs_R=logprobs_R,
                truncated=finish.get("type") == "length",
                weight_version=version if version is not None else fallback_version,
                engine=engine,
            )
        )
    return samples
