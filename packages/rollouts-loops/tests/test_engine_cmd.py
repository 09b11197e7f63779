"""`rollouts engine vllm` sizes vLLM's KV cache for a host without a GPU instead of letting vLLM
claim most of its memory."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rollouts.loops.app.engine_cmd import cpu_server_env

GIB = 2**30


def test_a_cpu_host_gets_a_bounded_kv_cache_and_a_gpu_host_nothing():
    assert cpu_server_env(has_gpu=False, environ={}, memory_bytes=24 * GIB, kv_cache_gb=None) == {
        "VLLM_CPU_KVCACHE_SPACE": "4"
    }
    assert cpu_server_env(has_gpu=False, environ={}, memory_bytes=8 * GIB, kv_cache_gb=None) == {
        "VLLM_CPU_KVCACHE_SPACE": "2"
    }
    assert cpu_server_env(has_gpu=True, environ={}, memory_bytes=24 * GIB, kv_cache_gb=None) == {}


def test_the_users_setting_wins():
    assert cpu_server_env(has_gpu=False, environ={"VLLM_CPU_KVCACHE_SPACE": "9"}, memory_bytes=GIB, kv_cache_gb=2) == {}
    assert cpu_server_env(has_gpu=False, environ={}, memory_bytes=GIB, kv_cache_gb=3) == {"VLLM_CPU_KVCACHE_SPACE": "3"}
    with pytest.raises(ValueError, match="--cpu-kv-cache-gb must be >= 1, got 0"):
        cpu_server_env(has_gpu=False, environ={}, memory_bytes=GIB, kv_cache_gb=0)


@given(st.integers(min_value=0, max_value=2**44))
def test_the_cache_is_at_least_one_gib_and_at_most_a_quarter_or_four(memory_bytes):
    gb = int(
        cpu_server_env(has_gpu=False, environ={}, memory_bytes=memory_bytes, kv_cache_gb=None)["VLLM_CPU_KVCACHE_SPACE"]
    )
    assert 1 <= gb <= 4 and (gb == 1 or gb * GIB <= memory_bytes // 4)


def test_a_port_another_server_holds_is_refused_before_anything_starts(tmp_path, capsys):
    import json
    import socket

    from rollouts.loops.app.cli import main

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        port = holder.getsockname()[1]
        code = main(
            ["engine", "vllm", "--model", str(tmp_path), "--port", str(port), "--python", "/nonexistent/python"]
        )
    err = capsys.readouterr()
    assert code == 2 and "engine ready" not in err.out
    assert f"port {port} on 127.0.0.1 is in use by another process" in err.err
