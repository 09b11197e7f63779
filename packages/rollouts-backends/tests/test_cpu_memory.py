"""retain_freed_cpu_memory: glibc takes the thresholds; another C library is left alone; CPU components apply it."""

import platform
import resource

import pytest
import torch
from helpers import tiny_model

import rollouts.backends.train.components as components_module
from rollouts.backends import build_components, retain_freed_cpu_memory
from rollouts.backends.train import cpu_memory
from rollouts.types import OptimizerConfig

glibc = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's"
)


def _page_faults_of_a_step() -> int:
    """Minor page faults of allocating, touching and freeing 20 blocks of 4 MiB, like a step's activations."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    blocks = [torch.ones(2**20) for _ in range(20)]
    del blocks
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


@glibc
def test_glibc_takes_the_thresholds_and_freed_blocks_are_reused_without_page_faults():
    assert retain_freed_cpu_memory() is True
    assert retain_freed_cpu_memory() is True  # idempotent
    _page_faults_of_a_step()
    # Handed back to the kernel, the 80 MiB would fault in again: 20,480 pages of 4 KiB. Kept, the
    # later steps find them mapped (a few faults may remain where a block lands on fresh pages).
    faults = [_page_faults_of_a_step() for _ in range(4)]
    assert sum(faults) < 20_480


def test_other_c_libraries_are_left_alone(monkeypatch):
    monkeypatch.setattr(cpu_memory.platform, "libc_ver", lambda: ("musl", "1.2"))
    assert retain_freed_cpu_memory() is False


def test_build_components_applies_it_on_cpu_only(monkeypatch):
    calls = []
    monkeypatch.setattr(components_module, "retain_freed_cpu_memory", lambda: calls.append(1) or True)
    build_components(tiny_model(), OptimizerConfig(), num_training_steps=1)
    assert calls == [1]
    build_components(tiny_model(), OptimizerConfig(), num_training_steps=1, device="meta")
    assert calls == [1]
