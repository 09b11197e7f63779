"""Settings that need the model's files but not its weights are refused before the run directory
is written: LoRA targets and rank, a critic of another vocabulary, an SFT tokenizer without a chat
template; a tokenizer with no EOS token is a warning."""

import json
import logging
import shutil

import pytest
from run_configs import rl_toml, sft_toml

from rollouts.loops.app.cli import main


def _rl(inputs, tmp_path, model, *sets):
    config = rl_toml(inputs, tmp_path / "run", model)
    return main(["rl", "--config", str(config), *(x for s in sets for x in ("--set", s))])


@pytest.mark.parametrize(
    "sets, message",
    [
        (["model.lora.rank=4096"], "model.lora: LoraConfig.rank = 4096 is larger than layer"),
        (["model.lora.rank=4", "model.lora.target_modules=['no_such_proj']"], "'no_such_proj' matches no linear layer"),
    ],
)
def test_bad_lora_settings_fail_before_the_run_directory(tiny_run_inputs, tmp_path, capsys, sets, message):
    assert _rl(tiny_run_inputs, tmp_path, tiny_run_inputs / "model", *sets) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_a_critic_of_another_vocabulary_fails_before_the_run_directory(tiny_run_inputs, tmp_path, capsys):
    critic = tmp_path / "critic"
    shutil.copytree(tiny_run_inputs / "model", critic)
    config = json.loads((critic / "config.json").read_text())
    (critic / "config.json").write_text(json.dumps({**config, "vocab_size": config["vocab_size"] + 7}))
    assert _rl(tiny_run_inputs, tmp_path, tiny_run_inputs / "model", "preset='ppo'", f"rl.critic.path='{critic}'") == 2
    err = capsys.readouterr().err
    assert f"has vocab_size {config['vocab_size'] + 7}, the policy" in err and f"{config['vocab_size']}" in err
    assert not (tmp_path / "run").exists()


def test_an_sft_tokenizer_without_a_chat_template_fails_before_the_run_directory(tiny_run_inputs, tmp_path, capsys):
    model = tmp_path / "model"
    shutil.copytree(tiny_run_inputs / "model", model)
    (model / "chat_template.jinja").unlink(missing_ok=True)
    tokenizer_config = json.loads((model / "tokenizer_config.json").read_text())
    tokenizer_config.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    config = sft_toml(tiny_run_inputs, tmp_path / "sft.toml", out_dir=tmp_path / "run", steps=1, batch_size=4)
    assert main(["sft", "--config", str(config), "--set", f"model.path='{model}'"]) == 2
    assert "has no chat template, and SFT masks conversations with it" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_a_tokenizer_without_eos_is_a_warning(tiny_run_inputs, tmp_path, caplog):
    from rollouts.loops.app.config import RLRun, load_run
    from rollouts.loops.app.run_setup import preflight

    model = tmp_path / "model"
    shutil.copytree(tiny_run_inputs / "model", model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "eos_token_id": None}))
    tokenizer_config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**tokenizer_config, "eos_token": None}))
    run = load_run(RLRun, rl_toml(tiny_run_inputs, tmp_path / "run", model))
    with caplog.at_level(logging.WARNING):
        preflight(run, "run.toml", "rl")
    assert "names an EOS token: responses never stop early" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        preflight(load_run(RLRun, rl_toml(tiny_run_inputs, tmp_path / "ok", tiny_run_inputs / "model")), "ok", "rl")
    assert "EOS" not in caplog.text
