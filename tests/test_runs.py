"""Run directories and resume: defaults that never collide, explicit resume, refused changed resumes."""

import tomllib

import pytest
from run_configs import rl_toml, sft_toml

from rollouts.loops import read_jsonl
from rollouts.loops.app.cli import main
from rollouts.loops.app.config import RLRun, SFTRun, build_run


def _sft_toml(inputs, path, *, out_dir="", steps=2):
    return sft_toml(inputs, path, out_dir=out_dir, steps=steps, batch_size=8)


def test_pipeline_with_default_directories_runs_each_stage_in_its_own(tiny_run_inputs, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    sft = _sft_toml(tiny_run_inputs, tmp_path / "sft.toml")
    rl = rl_toml(tiny_run_inputs, tmp_path / "unused", tiny_run_inputs / "model")
    assert main(["pipeline", "--sft-config", str(sft), "--rl-config", str(rl), "--set-rl", "run.out_dir=''"]) == 0
    (root,) = (tmp_path / "runs").iterdir()
    assert root.name.startswith("pipeline-") and {p.name for p in root.iterdir()} == {"sft", "rl"}
    resolved = tomllib.loads((root / "rl" / "resolved_config.toml").read_text())
    assert resolved["model"]["path"] == str(root / "sft" / "checkpoints" / "step_2")  # the SFT model just written
    assert [r["step"] for r in read_jsonl(root / "rl" / "metrics_rl.jsonl")] == [1, 2, 3]


def test_a_new_sft_run_gets_a_new_directory(tiny_run_inputs, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["sft", "--config", str(_sft_toml(tiny_run_inputs, tmp_path / "a.toml"))]) == 0
    assert f"sft: new run in {tmp_path / 'runs'}/sft-" in capsys.readouterr().err


def test_resume_is_announced_and_a_changed_config_is_refused_with_the_diff(tiny_run_inputs, tmp_path, capsys):
    out = tmp_path / "run"
    config = _sft_toml(tiny_run_inputs, tmp_path / "r.toml", out_dir=out, steps=2)
    assert main(["sft", "--config", str(config)]) == 0
    assert main(["sft", "--config", str(config), "--set", "sft.num_steps=3"]) == 0  # may change: continues
    assert f"sft: resuming the run in {out}" in capsys.readouterr().err
    assert [r["step"] for r in read_jsonl(out / "metrics_sft.jsonl")] == [1, 2, 3]
    assert main(["sft", "--config", str(config), "--set", "sft.optimizer.lr=0.5"]) == 2
    err = capsys.readouterr().err
    assert "was started with a different config" in err and "config.sft.optimizer.lr: 1e-05 -> 0.5" in err
    (tiny_run_inputs / "sft_changed.jsonl").write_text((tiny_run_inputs / "sft.jsonl").read_text().replace("1", "2"))
    assert (
        main(["sft", "--config", str(config), "--set", f"data.train_path='{tiny_run_inputs / 'sft_changed.jsonl'}'"])
        == 2
    )
    assert "inputs.train_data" in capsys.readouterr().err  # same count of records, other contents: refused


def test_resume_never_and_must(tiny_run_inputs, tmp_path, capsys):
    out = tmp_path / "run"
    config = _sft_toml(tiny_run_inputs, tmp_path / "r.toml", out_dir=out)
    assert main(["sft", "--config", str(config), "--resume", "must"]) == 2
    assert "resume is 'must' but" in capsys.readouterr().err
    assert main(["sft", "--config", str(config), "--resume", "never"]) == 0
    assert main(["sft", "--config", str(config), "--resume", "never"]) == 2
    assert "already holds a run's checkpoints and resume is 'never'" in capsys.readouterr().err


@pytest.mark.parametrize("kind, cls", [("sft", SFTRun), ("rl", RLRun)])
def test_config_show_prints_every_key_with_a_comment_and_reloads_as_the_defaults(kind, cls, capsys):
    assert main(["config", "show", kind]) == 0
    text = capsys.readouterr().out
    lines = [line for line in text.splitlines() if line and not line.startswith("[")]
    for comment, key in zip(lines[::2], lines[1::2], strict=True):
        assert comment.startswith("# ") and " = " in key, (comment, key)
    assert build_run(cls, tomllib.loads(text)) == cls()


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out.startswith("rollouts ")


def _hold(run_dir):
    """A process holding run_dir's lock (as a run would) until killed; returns it once it holds."""
    import subprocess
    import sys

    code = (
        "import sys\nfrom rollouts.loops.run.run_dir import acquire_run_dir\n"
        f"acquire_run_dir({str(run_dir)!r})\nprint('held', flush=True)\nsys.stdin.read()\n"
    )
    holder = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"  # an event, not a sleep
    return holder


def test_a_run_directory_in_use_is_refused_with_the_holders_pid_and_free_once_it_dies(
    tiny_run_inputs, tmp_path, capsys
):
    """Two runs on one out_dir interleaved metrics and one died in the background publisher."""
    from rollouts.loops.run.run_dir import RunDirInUse, lock_run_dir

    out = tmp_path / "run"
    config = _sft_toml(tiny_run_inputs, tmp_path / "r.toml", out_dir=out, steps=1)
    with lock_run_dir(out), lock_run_dir(out):  # reentrant in one process: the CLI holds it, then the loop
        pass
    holder = _hold(out)  # released above, so another process can take it
    try:
        with pytest.raises(RunDirInUse, match=f"pid {holder.pid}"), lock_run_dir(out):
            pass
        assert main(["sft", "--config", str(config)]) == 2
        err = capsys.readouterr().err
        assert f"{out} is in use by another run (pid {holder.pid} on" in err
        assert not (out / "resolved_config.toml").exists() and not (out / "checkpoints").exists()  # nothing touched
    finally:
        holder.kill()
        holder.wait(timeout=30)
    # The kernel drops a killed holder's lock: the directory is usable again at once.
    assert main(["sft", "--config", str(config)]) == 0
    assert [r["step"] for r in read_jsonl(out / "metrics_sft.jsonl")] == [1]


def test_gradient_checkpointing_is_honoured_in_one_process_with_the_same_gradients(tiny_run_inputs, tmp_path):
    """model.gradient_checkpointing was applied only under torchrun."""
    import torch

    from rollouts.backends import forward_backward
    from rollouts.data import pack_samples
    from rollouts.loops.app.run_setup import run_components as _components
    from rollouts.losses import sft_loss_fn
    from rollouts.types import OptimizerConfig, Sample

    grads = {}
    for on in (False, True):
        run = build_run(SFTRun, {"model": {"path": str(tiny_run_inputs / "model"), "gradient_checkpointing": on}})
        components = _components(run, OptimizerConfig(), 1)
        assert components.model.is_activation_checkpointing is on
        sample = Sample(tokens=[3 + i % 8 for i in range(12)], num_prompt_tokens=4, loss_mask=[0.0] * 4 + [1.0] * 8)
        micro_batches = pack_samples([sample], max_tokens=32)
        forward_backward(components, micro_batches, sft_loss_fn(), num_tokens=8, num_sequences=1)
        grads[on] = {n: p.grad.clone() for n, p in components.model.named_parameters() if p.grad is not None}
    assert grads[True].keys() == grads[False].keys() and grads[True]
    for name, grad in grads[False].items():  # recomputation gives the same gradients (float32 rounding)
        torch.testing.assert_close(grads[True][name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_model_compile_layers_compiles_each_decoder_layer(tiny_run_inputs):
    """The run file's switch reaches the model (that compiled layers give the eager gradients is
    rollouts-backends' test_compiled_layers_give_the_eager_loss_and_gradients)."""
    from rollouts.loops.app.run_setup import run_components as _components
    from rollouts.types import OptimizerConfig

    for mode in ("none", "layers"):
        run = build_run(SFTRun, {"model": {"path": str(tiny_run_inputs / "model"), "compile": mode}})
        layers = _components(run, OptimizerConfig(), 1).model.model.layers
        assert all((layer._compiled_call_impl is not None) is (mode == "layers") for layer in layers)


def test_a_hub_id_the_hub_cannot_provide_is_a_config_error_naming_it(tiny_run_inputs, tmp_path, monkeypatch, capsys):
    import huggingface_hub.constants as hub

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "cache"))
    config = _sft_toml(tiny_run_inputs, tmp_path / "r.toml", out_dir=tmp_path / "run")
    assert main(["sft", "--config", str(config), "--set", "model.path='rollouts-tests/no-such-model'"]) == 2
    err = capsys.readouterr().err
    assert "model.path: model path 'rollouts-tests/no-such-model' is not a local directory" in err, err
