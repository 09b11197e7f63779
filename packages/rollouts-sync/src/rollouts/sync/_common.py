"""What both engine clients share: prompt validation, Sample assembly, version parsing.

Legend: P prompts, G samples per prompt, R response tokens.
"""

from __future__ import annotations

import ipaddress
import math
import socket
from collections.abc import Sequence
from pathlib import Path

from rollouts.types import LogProbs, LossMask, Sample, SamplingParams, Status, TokenIds


def check_seconds(name: str, value: float) -> float:
    """A timeout or delay in seconds: a finite number > 0 (inf would never fire, NaN never compares)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number of seconds > 0, got {value!r}")
    return float(value)


def check_prompts(prompts: Sequence[Sequence[int]]) -> list[list[int]]:
    """[P][T_p] prompt token ids as plain int lists; raises on empty or non-int input."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise TypeError(f"prompts must be a sequence of token-id sequences, got {type(prompts).__name__}")
    if len(prompts) == 0:
        raise ValueError("prompts is empty: nothing to generate")
    out: list[list[int]] = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, (str, bytes)) or not isinstance(prompt, Sequence):
            raise TypeError(f"prompts[{i}] must be a sequence of token ids, got {type(prompt).__name__}")
        if len(prompt) == 0:
            raise ValueError(f"prompts[{i}] is empty: an engine needs at least one prompt token")
        ids = []
        for j, t in enumerate(prompt):
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(f"prompts[{i}][{j}] must be a token id (int >= 0), got {t!r}")
            ids.append(int(t))
        out.append(ids)
    return out


def check_params(params: SamplingParams) -> SamplingParams:
    """The params, after checking the type (a dict here would silently ignore every option)."""
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be a rollouts.types.SamplingParams, got {type(params).__name__}")
    return params


LOGPROBS_OF = "logprobs_of"
"""Sample.metadata key: which distribution the rollout log-probs describe ("sampling" or "model")."""


def make_sample(
    *,
    prompt_ids: Sequence[int],
    response_ids: Sequence[int],
    logprobs_R: Sequence[float] | None,
    truncated: bool,
    weight_version: int | None,
    engine: str,
    logprobs_of: str | None = None,
) -> Sample:
    """One Sample: tokens = prompt + response, loss mask 0 on the prompt and 1 on the response.

    `logprobs_of` goes to metadata["logprobs_of"]: which distribution rollout_logprobs describe,
    "sampling" (after temperature, top-k and top-p: what the tokens were drawn from) or "model"
    (the model's full softmax)."""
    if logprobs_R is not None:
        if len(logprobs_R) != len(response_ids):
            raise RuntimeError(
                f"{engine}: engine returned {len(logprobs_R)} logprobs for {len(response_ids)} response tokens"
            )
        try:
            logprobs = LogProbs(logprobs_R, what=f"{engine}: rollout log-probs")
        except (TypeError, ValueError) as e:
            raise RuntimeError(f"{engine}: engine returned a bad logprob: {e}") from e
    num_prompt = len(prompt_ids)
    return Sample(
        tokens=TokenIds([*prompt_ids, *response_ids], what=f"{engine}: token ids"),
        num_prompt_tokens=num_prompt,
        loss_mask=LossMask.prompt_response(num_prompt, len(response_ids)),
        rollout_logprobs=None if logprobs_R is None else logprobs,
        weight_version=weight_version,
        status=Status.TRUNCATED if truncated else Status.COMPLETED,
        metadata={} if logprobs_of is None or logprobs_R is None else {LOGPROBS_OF: logprobs_of},
    )


def parse_weight_version(value: object) -> int | None:
    """The engine's version string as an int; None where it never got one ("default", null)."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise RuntimeError(f"engine reported weight version {value!r}, expected an int-like string")
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        text = value.strip()
        if text.isdigit():
            return int(text)
        return None  # vLLM starts at "default", SGLang at "default": not a version we set
    raise RuntimeError(f"engine reported weight version {value!r} of type {type(value).__name__}")


def check_weight_version(weight_version: int) -> int:
    """The version after checking it is a non-negative int (engines store it as a string)."""
    if isinstance(weight_version, bool) or not isinstance(weight_version, int) or weight_version < 0:
        raise ValueError(f"weight_version must be an int >= 0, got {weight_version!r}")
    return weight_version


def is_adapter_dir(path: str) -> bool:
    """Whether `path` holds a LoRA adapter in PEFT's format (adapter_config.json, no config.json) rather
    than full HF weights. Engines load one as a runtime LoRA adapter instead of reloading weights."""
    directory = Path(path)
    return (directory / "adapter_config.json").is_file() and not (directory / "config.json").is_file()


def local_address_toward(host: str) -> str:
    """This machine's address on the route to `host` (no packet is sent: a UDP connect only routes).
    The worker extension keeps its own copy: it runs in vLLM's process, where rollouts is not installed."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 1))
        address: str = s.getsockname()[0]
        return address


def is_this_machine(host: str) -> bool:
    """Whether `host` (a name or an address) is this machine: a loopback address, or one this machine
    can bind (only its own interfaces' addresses can be bound). No packet is sent."""
    try:
        found = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (socket.gaierror, UnicodeError):
        return False
    for family, _, _, _, address in found:
        if ipaddress.ip_address(str(address[0]).split("%", 1)[0]).is_loopback:
            return True
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as probe:
                probe.bind((address[0], 0))
            return True
        except OSError:
            continue
    return False
