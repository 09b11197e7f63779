"""Model files: a hub id resolves (from the cache when offline) or fails naming itself; a saved
tokenizer loads as it was saved."""

import json
import shutil

import pytest
from helpers import tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st

from rollouts.backends import load_tokenizer, resolve_model_dir

CORPUS = ["self._cmd = cmd", "x = y + 1", "def f(a, b):\n    return a  # sum"] * 40


def _tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE(unk_token=None))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[^0-9A-Za-z]"), behavior="isolated")
    core.decoder = decoders.BPEDecoder()
    core.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=60, special_tokens=["<eos>"], show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eos>")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tokenizer with space tokens saved beside a Qwen2-family config, as a run's model directory is."""
    out = tmp_path_factory.mktemp("model")
    tiny_model(seed=0).save_pretrained(str(out))
    _tokenizer().save_pretrained(str(out))
    return out


@settings(max_examples=25, deadline=None)
@given(text=st.text(alphabet=" =._()+:#\nabcdefmrsuxy01", min_size=1, max_size=40))
def test_a_saved_tokenizer_gives_the_ids_it_gave_when_saved(model_dir, text):
    """transformers' AutoTokenizer loads it as Qwen2Tokenizer (from config.json), which drops the
    space tokens: "self._cmd = cmd" became 6 ids instead of 8."""
    original = _tokenizer()
    loaded = load_tokenizer(model_dir)
    assert loaded.encode(text, add_special_tokens=False) == original.encode(text, add_special_tokens=False)


def test_the_space_case_from_the_field(model_dir):
    ids = _tokenizer().encode("self._cmd = cmd", add_special_tokens=False)
    assert len(ids) == 8 and load_tokenizer(model_dir).encode("self._cmd = cmd", add_special_tokens=False) == ids


def test_a_local_directory_is_itself_and_a_bad_value_is_named(tmp_path):
    assert resolve_model_dir(tmp_path) == tmp_path
    with pytest.raises(ValueError, match="'not/a/hub/id' is not an existing directory"):
        resolve_model_dir("not/a/hub/id")


def test_a_hub_id_the_hub_cannot_provide_is_an_error_naming_it(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # no network in tests: the offline path
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    import huggingface_hub.constants as hub

    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ValueError, match="'rollouts-tests/no-such-model' is not a local directory, and the Hugging"):
        resolve_model_dir("rollouts-tests/no-such-model")


def test_a_hub_id_resolves_from_the_hub_cache_offline(model_dir, tmp_path, monkeypatch):
    """The success path without a network: the hub cache's layout (refs/main -> snapshots/<commit>)."""
    cache = tmp_path / "cache"
    commit = "0" * 40
    snapshot = cache / "models--rollouts-tests--tiny" / "snapshots" / commit
    shutil.copytree(model_dir, snapshot)
    (cache / "models--rollouts-tests--tiny" / "refs").mkdir(parents=True)
    (cache / "models--rollouts-tests--tiny" / "refs" / "main").write_text(commit)
    import huggingface_hub.constants as hub

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(cache))
    resolved = resolve_model_dir("rollouts-tests/tiny")
    assert resolved == snapshot
    assert json.loads((resolved / "config.json").read_text())["model_type"] == "qwen2"
