"""`rollouts engine vllm`: start a vLLM server that the RL loop can drive, the way `trl vllm-serve`
does for TRL: dev-mode endpoints and the weight-receiving worker extension on, health waited for,
the URL printed, the server stopped on Ctrl-C or SIGTERM.

    rollouts engine vllm --model /models/qwen --python /opt/vllm/bin/python --port 8000
    # then, in the run file: [engine] kind = "vllm", urls = ["http://127.0.0.1:8000"], sync = "http"
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
import threading
from collections.abc import Mapping
from pathlib import Path

from rollouts.loops.app.config import ConfigError
from rollouts.sync.launch import VLLMServeOptions, check_port_free, free_port, launch_vllm_server

_CPU_KV_CACHE_MAX_GB = 4  # enough for the small models a CPU serves; vLLM's own default takes most of the host


def cpu_server_env(
    *, has_gpu: bool, environ: Mapping[str, str], memory_bytes: int, kv_cache_gb: int | None
) -> dict[str, str]:
    """The environment a vLLM server on a host without a GPU needs: a KV cache sized for the host
    (VLLM_CPU_KVCACHE_SPACE), unless the user set one; nothing on a GPU host."""
    if has_gpu or "VLLM_CPU_KVCACHE_SPACE" in environ:
        return {}
    if kv_cache_gb is not None and kv_cache_gb < 1:
        raise ValueError(f"--cpu-kv-cache-gb must be >= 1, got {kv_cache_gb}")
    gb = kv_cache_gb or max(1, min(_CPU_KV_CACHE_MAX_GB, memory_bytes // 4 // 2**30))
    return {"VLLM_CPU_KVCACHE_SPACE": str(gb)}


def _host_has_gpu() -> bool:
    return Path("/dev/nvidiactl").exists() or Path("/dev/kfd").exists()  # NVIDIA's or AMD's driver


def cmd_engine(args: argparse.Namespace) -> int:
    """Start the server, print 'engine ready: URL' once healthy, and serve until a signal."""
    if args.port:  # else "engine ready" would announce the server already there
        try:
            check_port_free(args.host, args.port)
        except ValueError as e:
            raise ConfigError(f"--port: {e}") from None
    port = args.port or free_port(args.host if args.host not in ("0.0.0.0", "") else "127.0.0.1")
    log = Path(args.log or f"vllm-{port}.log").absolute()
    extra = shlex.split(args.vllm_args)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"engine: starting vLLM for {Path(args.model).absolute()} (log {log})", file=sys.stderr, flush=True)
    options = VLLMServeOptions(
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        enforce_eager=args.enforce_eager,
        max_lora_rank=args.max_lora_rank,
        extra_args=extra,
    )
    env = cpu_server_env(
        has_gpu=_host_has_gpu(),
        environ=os.environ,
        memory_bytes=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
        kv_cache_gb=args.cpu_kv_cache_gb,
    )
    if env:
        print(f"engine: no GPU here: a {env['VLLM_CPU_KVCACHE_SPACE']} GiB KV cache in memory", file=sys.stderr)
    with launch_vllm_server(
        args.model,
        options=options,
        env=env,
        python=args.python,
        host=args.host,
        port=port,
        startup_timeout_s=args.startup_timeout_s,
        log_path=log,
    ) as server:
        print(f"engine ready: {server.url}", flush=True)
        print(
            f'engine: in the run file, [engine] kind = "vllm", urls = ["{server.url}"], sync = "http" '
            '(or "disk" where this server sees the trainer\'s files); Ctrl-C stops it',
            file=sys.stderr,
            flush=True,
        )
        while not stop.wait(timeout=1.0):
            pass
    print("engine: stopped", file=sys.stderr, flush=True)
    return 0
