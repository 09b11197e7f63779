"""check_model_dir: a model directory is checked (headers only) before anything is loaded; a
truncated or damaged weights file is named, not reported from deep inside a loader."""

from __future__ import annotations

import json
import shutil

import pytest
from helpers import tiny_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollouts.backends import check_model_dir, load_hf_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("model") / "m"
    tiny_model().save_pretrained(str(path), safe_serialization=True)
    return path


def test_a_complete_directory_passes_and_loads(model_dir):
    check_model_dir(model_dir)
    assert load_hf_model(model_dir) is not None


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.floats(0.0, 0.9999))
def test_a_truncated_weights_file_is_named(model_dir, tmp_path_factory, fraction):
    copy = tmp_path_factory.mktemp("cut") / "m"
    shutil.copytree(model_dir, copy)
    weights = copy / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: int(len(data) * fraction)])
    with pytest.raises(ValueError, match="model.safetensors"):
        check_model_dir(copy)
    with pytest.raises(ValueError, match="model.safetensors"):  # the loader checks first
        load_hf_model(copy)


def test_missing_pieces_are_named(model_dir, tmp_path):
    copy = tmp_path / "m"
    shutil.copytree(model_dir, copy)
    with pytest.raises(ValueError, match="no tokenizer"):
        check_model_dir(copy, tokenizer=True)
    (copy / "model.safetensors").rename(copy / "other.bin")
    with pytest.raises(ValueError, match="no model.safetensors"):
        check_model_dir(copy)
    (copy / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json is not valid JSON"):
        check_model_dir(copy)


def test_a_shard_named_by_the_index_must_exist(model_dir, tmp_path):
    copy = tmp_path / "m"
    shutil.copytree(model_dir, copy)
    (copy / "model.safetensors").rename(copy / "model-00001-of-00002.safetensors")
    weight_map = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    (copy / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ValueError, match="model-00002-of-00002.safetensors is missing"):
        check_model_dir(copy)
