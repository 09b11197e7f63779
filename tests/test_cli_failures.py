"""A run that fails or is interrupted reports it in one paragraph: what failed, the user's own frame
when the failure is in their code, the last checkpoint and the command that resumes; the traceback
goes to the run directory's error.log, not the screen."""

import signal

from run_configs import rl_toml

from rollouts.loops.app.cli import main
from rollouts.loops.app.failures import paragraph, user_frame
from rollouts.loops.run.loggers import read_jsonl

_USER_CODE = """
import os
import signal
import threading

CALLS = []
LOCK = threading.Lock()  # rewards run in several threads at once: one of them must see call 17


def advantages(samples, config):
    raise ValueError("advantages need a critic here")


def interrupting_reward(sample, record):
    with LOCK:
        CALLS.append(1)
        seventeenth = len(CALLS) == 17
    if seventeenth:  # the first reward of the second step: Ctrl-C, as a user would press it
        os.kill(os.getpid(), signal.SIGINT)
    return 1.0 if sample.response.strip() == record["answer"] else 0.0
"""


def _config(tiny_run_inputs, tmp_path, name, extra):
    user = tmp_path / "user_code.py"
    user.write_text(_USER_CODE)
    return rl_toml(tiny_run_inputs, tmp_path / name, tiny_run_inputs / "model", extra=extra.format(user=user)), user


def test_a_failure_in_user_code_is_one_paragraph_naming_the_users_frame(tiny_run_inputs, tmp_path, capsys):
    config, user = _config(tiny_run_inputs, tmp_path, "adv", '[hooks]\nadvantages = "{user}:advantages"\n')
    assert main(["rl", "--config", str(config)]) == 1
    err = capsys.readouterr().err
    assert "rollouts rl failed: ValueError: advantages need a critic here" in err
    assert f"in your code at {user}:11, in advantages" in err
    assert "no checkpoint was written yet; run again with: rollouts rl --config" in err
    assert "Traceback (most recent call last)" not in err  # the traceback is in the log
    log = tmp_path / "adv" / "error.log"
    assert f"the traceback is in {log}" in err
    assert "Traceback (most recent call last)" in log.read_text() and "advantages need a critic" in log.read_text()


def test_ctrl_c_says_where_the_run_stopped_and_how_to_resume(tiny_run_inputs, tmp_path, capsys):
    extra = '[reward]\nfn = "{user}:interrupting_reward"\n[rl.checkpoint]\nevery_steps = 1\n'
    config, _ = _config(tiny_run_inputs, tmp_path, "int", extra)
    config.write_text(config.read_text().replace('[reward]\nfn = "exact_match"\n', ""))
    previous = signal.getsignal(signal.SIGINT)
    # as in a fresh `rollouts` process: trio takes Ctrl-C only over Python's default handler, which a
    # test earlier in the same session may have left replaced
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        assert main(["rl", "--config", str(config)]) == 130
    finally:
        signal.signal(signal.SIGINT, previous)
    err = capsys.readouterr().err
    out = tmp_path / "int"
    assert "rollouts rl: interrupted after step 1" in err
    assert f"last checkpoint {out / 'checkpoints' / 'step_1'}; resume with: rollouts rl --config {config}" in err
    assert "--resume must" in err and "Traceback" not in err
    assert [r["step"] for r in read_jsonl(out / "metrics_rl.jsonl")] == [1]


def test_the_users_frame_is_found_through_wrapped_causes(tmp_path):
    user = tmp_path / "plugin.py"
    user.write_text("def f():\n    raise KeyError('x')\n")
    namespace: dict = {}
    exec(compile(user.read_text(), str(user), "exec"), namespace)
    try:
        try:
            namespace["f"]()
        except KeyError as e:
            raise RuntimeError("wrapped") from e
    except RuntimeError as wrapped:
        frame = user_frame(wrapped)
        text = paragraph(wrapped, None, tmp_path / "log")
    assert frame is not None and frame.filename == str(user) and frame.lineno == 2
    assert text.startswith("rollouts run failed: RuntimeError: wrapped") and f"{user}:2, in f" in text
