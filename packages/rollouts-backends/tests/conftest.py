import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import torch

torch.set_num_threads(1)


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", help="also run multi-process tests (torchrun FSDP2)")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: multi-process tests (torchrun with 2 gloo ranks); need --run-slow")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--run-slow"):
        return
    skip = pytest.mark.skip(reason="multi-process test: pass --run-slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
