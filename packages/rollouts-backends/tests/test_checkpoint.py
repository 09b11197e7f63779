import json
import multiprocessing
import os
import random
import signal
import threading
import time
from pathlib import Path

import pytest
import safetensors.torch
import torch
from helpers import fresh_components, tiny_model, train_steps
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

from rollouts.backends import (
    CheckpointWriter,
    build_components,
    export_weights,
    has_optimizer_state,
    latest_checkpoint,
    load_checkpoint,
    read_weights,
    save_checkpoint,
    step_checkpoints,
    verify_checkpoint,
)
from rollouts.types import OptimizerConfig, TrainingState

_WORKER_LINE_TIMEOUT_S = 60.0
"""Bound on waiting for the crash-test worker's next progress line."""


def _weights(model):
    return {n: p.detach().clone() for n, p in model.state_dict().items()}


def _assert_bit_identical(a, b):
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_exact_resume_is_bit_identical(tmp_path):
    torch.manual_seed(7)
    straight = fresh_components()
    train_steps(straight, TrainingState(), 5)

    torch.manual_seed(7)
    first = fresh_components()
    state = train_steps(first, TrainingState(), 2)
    path = save_checkpoint(first, state, tmp_path, extra={"buffer": {"epoch": 1, "cursor": [3, 4]}})
    torch.manual_seed(999)  # a different RNG stream: load must restore the saved one
    resumed = fresh_components(seed=1)
    loaded_state, extra = load_checkpoint(resumed, path)
    assert loaded_state == state and extra == {"buffer": {"epoch": 1, "cursor": [3, 4]}}
    final = train_steps(resumed, loaded_state, 3)

    assert final.step == 5
    _assert_bit_identical(_weights(straight.model), _weights(resumed.model))
    for (_, sa), (_, sb) in zip(straight.optimizer.state.items(), resumed.optimizer.state.items(), strict=True):
        for key in sa:
            assert torch.equal(sa[key], sb[key]), key


def test_a_resumed_optimizer_keeps_this_runs_implementation(tmp_path):
    """A checkpoint saved by another AdamW implementation (the per-tensor loop, as older versions
    and other devices used) resumes into the one this run chose (the fused kernel on CPU), with its
    moments, and steps on."""
    import dataclasses

    from helpers import TRAIN_CONFIG_KW

    from rollouts.backends import build_scheduler

    config = OptimizerConfig(**TRAIN_CONFIG_KW)
    saver = fresh_components()
    groups = [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in saver.optimizer.param_groups]
    loop = torch.optim.AdamW(groups, lr=config.lr, betas=config.betas, eps=config.eps, foreach=False)
    saver = dataclasses.replace(saver, optimizer=loop, scheduler=build_scheduler(loop, config, num_training_steps=8))
    state = train_steps(saver, TrainingState(), 2)
    path = save_checkpoint(saver, state, tmp_path)
    resumed = fresh_components(seed=1)
    loaded_state, _ = load_checkpoint(resumed, path)
    for group in resumed.optimizer.param_groups:
        assert group["fused"] is True and group["foreach"] is None
    for (_, saved), (_, loaded) in zip(saver.optimizer.state.items(), resumed.optimizer.state.items(), strict=True):
        for key in saved:
            assert torch.equal(saved[key], loaded[key]), key
    assert train_steps(resumed, loaded_state, 1).step == 3


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_fused_cuda_optimizer_resumes_bit_identically(tmp_path):
    """The fused AdamW keeps its step counts on the GPU: saved and loaded, the next update with the
    same gradients gives the same bits (the gradients are set, not computed: CUDA's backward may
    reorder its sums from run to run)."""
    from helpers import TRAIN_CONFIG_KW

    from rollouts.backends import optim_step

    config = OptimizerConfig(**TRAIN_CONFIG_KW)
    first = build_components(tiny_model(), config, num_training_steps=8, device="cuda")
    assert first.optimizer.defaults["fused"] is True
    state = train_steps(first, TrainingState(), 2)
    path = save_checkpoint(first, state, tmp_path)
    resumed = build_components(tiny_model(seed=1), config, num_training_steps=8, device="cuda")
    loaded_state, _ = load_checkpoint(resumed, path)
    assert loaded_state == state
    assert all(group["fused"] is True for group in resumed.optimizer.param_groups)
    generator = torch.Generator().manual_seed(0)
    for p, q in zip(first.model.parameters(), resumed.model.parameters(), strict=True):
        p.grad = torch.randn(p.shape, generator=generator).to("cuda")
        q.grad = p.grad.clone()
    optim_step(first, state, config)
    optim_step(resumed, loaded_state, config)
    _assert_bit_identical(_weights(first.model), _weights(resumed.model))


def test_checkpoint_is_hf_loadable_and_complete(tmp_path):
    components = fresh_components()
    state = train_steps(components, TrainingState(), 1)
    path = save_checkpoint(components, state, tmp_path)
    assert path.name == "step_1" and latest_checkpoint(tmp_path) == path
    record = json.loads((path / "state.json").read_text())
    assert record["training_state"]["step"] == 1
    assert set(record["files"]) == {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "optimizer.safetensors",
    }
    hf = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True)
    _assert_bit_identical(_weights(hf), _weights(components.model))


def test_tied_embeddings_are_written_once_and_load_back(tmp_path):
    model = tiny_model(tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    components = build_components(model, OptimizerConfig(), num_training_steps=2)
    path = save_checkpoint(components, TrainingState(), tmp_path)
    names = set(safetensors.torch.load_file(str(path / "model.safetensors")))
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    other = build_components(tiny_model(seed=3, tie_word_embeddings=True), OptimizerConfig(), num_training_steps=2)
    load_checkpoint(other, path)
    _assert_bit_identical(_weights(other.model), _weights(model))


def test_retention_and_corruption_are_handled(tmp_path):
    components = fresh_components()
    state = TrainingState()
    for _ in range(4):
        state = train_steps(components, state, 1)
        save_checkpoint(components, state, tmp_path, keep_last=3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_2", "step_3", "step_4"]
    # A leftover temporary directory (a crash mid-save) is never chosen.
    (tmp_path / ".tmp-step_9-1").mkdir()
    assert latest_checkpoint(tmp_path) == tmp_path / "step_4"
    # Flip one byte of the newest weights: its CRC no longer matches, the previous one is used.
    weights = tmp_path / "step_4" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    assert latest_checkpoint(tmp_path) == tmp_path / "step_3"
    # Truncated optimizer file and a missing state.json are rejected too.
    opt = tmp_path / "step_3" / "optimizer.safetensors"
    opt.write_bytes(opt.read_bytes()[:-10])
    assert latest_checkpoint(tmp_path) == tmp_path / "step_2"
    (tmp_path / "step_2" / "state.json").unlink()
    assert latest_checkpoint(tmp_path) is None
    with pytest.raises(ValueError, match="not a checkpoint"):
        load_checkpoint(components, tmp_path / "step_2")
    # The next save clears the stale temporary directory. Retention deletes step_4 (whole, its damage
    # shows only in the CRC, which loading checks) but keeps step_2 and step_3, which fail the check
    # it makes (a missing record, a cut file): the user decides about those.
    save_checkpoint(components, state.after_step(num_tokens=1, num_samples=1), tmp_path, keep_last=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_2", "step_3", "step_5"]
    assert verify_checkpoint(tmp_path / "step_5") == []
    assert verify_checkpoint(tmp_path / "step_3") == [
        f"optimizer.safetensors is {opt.stat().st_size} bytes, recorded {opt.stat().st_size + 10}"
    ]


def test_non_json_extra_is_rejected_before_writing(tmp_path):
    components = fresh_components()
    with pytest.raises(TypeError):
        save_checkpoint(components, TrainingState(), tmp_path, extra={"bad": object()})
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


def test_export_weights_shards_and_manifest(tmp_path):
    components = fresh_components()
    directory, manifest = export_weights(components, tmp_path / "export", max_shard_bytes=60_000)
    files = sorted(p.name for p in directory.iterdir() if p.name.endswith(".safetensors"))
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert json.loads((directory / "manifest.json").read_text()) == manifest
    own = _weights(components.model)
    assert set(manifest["tensors"]) == set(own)
    for name, meta in manifest["tensors"].items():
        assert meta["shape"] == list(own[name].shape) and meta["dtype"] == "float32"
    _assert_bit_identical(read_weights(directory), own)
    hf = AutoModelForCausalLM.from_pretrained(str(directory), local_files_only=True)
    _assert_bit_identical(_weights(hf), own)
    # Re-exporting replaces the directory (one shard now) without leftovers.
    _, single = export_weights(components, tmp_path / "export")
    assert list(single["files"]) == ["model.safetensors"]
    assert not (directory / "model.safetensors.index.json").exists()


def _start_worker(root: Path, total: int, wait: bool):
    """Fork a process running crash_child.run; returns (process, connection receiving its lines)."""
    import crash_child

    receive, send = multiprocessing.get_context("fork").Pipe(duplex=False)
    ctx = multiprocessing.get_context("fork")
    process = ctx.Process(target=crash_child.run, args=(root, total, send.send, wait), daemon=True)
    process.start()
    send.close()
    return process, receive


@pytest.mark.parametrize("wait", [True, False], ids=["durable-on-return", "background-publish"])
def test_sigkill_at_random_moments_always_leaves_a_resumable_checkpoint(tmp_path, wait):
    total = 6
    rng = random.Random(0)
    # Kill points: the n-th line starting with a marker, plus a random delay; "SAVING" kills land
    # inside save_checkpoint (while files are written, fsynced or renamed).
    plans = [("SAVING", 2, 0.0), ("SAVING", 1, 0.002), ("SAVING", 1, 0.01), ("START", 1, 0.05), ("SAVED", 1, 0.0)]
    progress = []
    published_any = False
    for marker, nth, delay_s in plans:
        process, lines = _start_worker(tmp_path, total, wait)
        seen = 0
        saved_here = 0
        try:
            while lines.poll(_WORKER_LINE_TIMEOUT_S):
                line = lines.recv()
                saved_here += line.startswith("SAVED")
                # "SAVED" means published when durable on return; in the background mode only the
                # next save's return proves it, since a save first waits for the one in flight.
                published_any = published_any or saved_here >= (1 if wait else 2)
                seen += line.startswith(marker)
                if seen == nth or line == "DONE":
                    break
            time.sleep(delay_s * (0.5 + rng.random()))
            os.kill(process.pid, signal.SIGKILL)
        finally:
            process.join(timeout=_WORKER_LINE_TIMEOUT_S)
        assert process.exitcode == -signal.SIGKILL
        path = latest_checkpoint(tmp_path)
        if path is None:
            # Allowed only while no save is known to have been published.
            assert not published_any
            progress.append(0)
            continue
        published_any = True
        components = fresh_components(num_training_steps=total)
        state, extra = load_checkpoint(components, path)
        assert extra == {"step": state.step}
        progress.append(state.step)
    assert progress == sorted(progress) and progress[-1] < total
    process, lines = _start_worker(tmp_path, total, wait)
    process.join(timeout=120)
    assert process.exitcode == 0

    torch.manual_seed(1234)
    straight = fresh_components(num_training_steps=total)
    train_steps(straight, TrainingState(), total)
    final = fresh_components(num_training_steps=total)
    state, _ = load_checkpoint(final, latest_checkpoint(tmp_path))
    assert state.step == total
    _assert_bit_identical(_weights(final.model), _weights(straight.model))


def test_load_hf_model_and_build_components_from_a_checkpoint(tmp_path):
    from rollouts.backends import load_hf_model

    components = fresh_components()
    path = save_checkpoint(components, TrainingState(), tmp_path)
    loaded = load_hf_model(path, attn_implementation="eager")
    _assert_bit_identical(_weights(loaded), _weights(components.model))
    built = build_components(path, OptimizerConfig(), num_training_steps=3)
    _assert_bit_identical(_weights(built.model), _weights(components.model))
    with pytest.raises(ValueError, match="config.json"):
        load_hf_model(tmp_path / "missing")


@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(1, 9),
    cols=st.integers(1, 4),
    count=st.integers(1, 4),
    dim=st.integers(0, 1),
)
def test_optimizer_shards_join_back_to_the_full_tensor(tmp_path_factory, rows, cols, count, dim):
    from rollouts.backends.checkpoint.optimizer_state import join_shards

    directory = tmp_path_factory.mktemp("shards")
    full = torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols)
    pieces = list(torch.chunk(full, count, dim=dim))
    pieces += [full.narrow(dim, 0, 0)] * (count - len(pieces))  # FSDP2 ranks past the end hold empty shards
    files = []
    for index, piece in enumerate(pieces):
        layout = {"w::exp_avg": {"shape": [rows, cols], "dim": dim, "index": index, "count": count}}
        path = directory / f"rank{index}.safetensors"
        tensors = {"w::exp_avg": piece.contiguous(), "w::step": torch.tensor(3.0)}
        safetensors.torch.save_file(tensors, str(path), metadata={"layout": json.dumps(layout)})
        files.append(path)
    random.Random(rows).shuffle(files)  # file order does not matter: the recorded index does
    joined = join_shards(files)
    assert torch.equal(joined["w::exp_avg"], full)
    assert joined["w::step"].item() == 3.0
    if count > 1:
        with pytest.raises(ValueError, match=rf"shards .* found, {count} expected"):
            join_shards(files[1:])


def _held_fsync(monkeypatch):
    """Make the checkpoint's flush wait for the returned event: a background publish stays in flight
    until the test sets it (an event, not a sleep)."""
    import rollouts.backends.checkpoint.save_load as ck

    release, fsync = threading.Event(), ck.fsync_path

    def held(path):
        assert release.wait(_WORKER_LINE_TIMEOUT_S), "the test never released the flush"
        fsync(path)

    monkeypatch.setattr(ck, "fsync_path", held)
    return release


def test_a_background_save_returns_early_and_publishes_what_it_was_given(tmp_path, monkeypatch):
    components = fresh_components()
    state = train_steps(components, TrainingState(), 1)
    saved = _weights(components.model)
    release = _held_fsync(monkeypatch)
    with CheckpointWriter() as writer:
        path = save_checkpoint(components, state, tmp_path, extra={"k": 1}, writer=writer)
        with torch.no_grad():  # training goes on at once: the checkpoint keeps the bytes it was handed
            for param in components.model.parameters():
                param.add_(1.0)
        assert writer.busy and latest_checkpoint(tmp_path) is None  # invisible until published
        assert step_checkpoints(tmp_path) == []
        release.set()
        writer.wait()
        assert latest_checkpoint(tmp_path) == path and not writer.busy
    resumed = fresh_components(seed=3)
    loaded, extra = load_checkpoint(resumed, path)
    assert loaded == state and extra == {"k": 1}
    _assert_bit_identical(_weights(resumed.model), saved)


def test_a_failed_background_publish_is_reported_once_and_never_published(tmp_path, monkeypatch):
    import rollouts.backends.checkpoint.save_load as ck

    components = fresh_components()
    state = train_steps(components, TrainingState(), 1)

    def disk_full(path):
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr(ck, "fsync_path", disk_full)
    writer = CheckpointWriter()
    save_checkpoint(components, state, tmp_path, writer=writer)
    with pytest.raises(RuntimeError, match="No space left on device"):
        writer.wait()
    writer.wait()  # reported once
    assert latest_checkpoint(tmp_path) is None
    monkeypatch.undo()
    save_checkpoint(components, state, tmp_path, writer=writer)
    with pytest.raises(RuntimeError, match="No space left"):  # the error of a save surfaces on close too
        monkeypatch.setattr(ck, "fsync_path", disk_full)
        save_checkpoint(components, state.after_step(num_tokens=1, num_samples=1), tmp_path, writer=writer)
        writer.close()
    monkeypatch.undo()
    path = save_checkpoint(components, state, tmp_path)  # no writer: durable on return; clears leftovers
    assert latest_checkpoint(tmp_path) == path and [p.name for p in tmp_path.iterdir()] == ["step_1"]


def test_a_closed_writer_leaves_no_thread_and_refuses_new_work(tmp_path):
    components = fresh_components()
    before = {t.name for t in threading.enumerate()}
    with CheckpointWriter(name="test-writer") as writer:
        for step in (1, 2, 3):
            save_checkpoint(components, TrainingState(step=step), tmp_path, keep_last=2, writer=writer)
    assert {t.name for t in threading.enumerate()} == before
    assert [p.name for p in step_checkpoints(tmp_path)] == ["step_3", "step_2"]
    with pytest.raises(RuntimeError, match="closed"):
        save_checkpoint(components, TrainingState(step=4), tmp_path, writer=writer)
    writer.close()  # idempotent


def test_a_failing_loop_keeps_its_error_and_the_writer_still_finishes(tmp_path, monkeypatch):
    release = _held_fsync(monkeypatch)
    components = fresh_components()
    with pytest.raises(KeyError, match="the loop's own error"):
        with CheckpointWriter() as writer:
            save_checkpoint(components, TrainingState(step=1), tmp_path, writer=writer)
            release.set()
            raise KeyError("the loop's own error")
    assert latest_checkpoint(tmp_path) == tmp_path / "step_1"


def test_interpreter_exit_waits_for_a_background_publish(tmp_path):
    """A script whose last act is a background save, its writer never closed, still leaves that
    checkpoint: the writer's thread is not a daemon."""
    import subprocess
    import sys

    script = (
        f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "import rollouts.backends.checkpoint.save_load as ck\n"
        "from helpers import fresh_components\n"
        "from rollouts.backends import CheckpointWriter, save_checkpoint\n"
        "from rollouts.types import TrainingState\n"
        "slow_fsync = ck.fsync_path\n"
        "def fsync(path):\n"
        "    import time; time.sleep(0.2); slow_fsync(path)\n"
        "ck.fsync_path = fsync  # the publish is surely still running when the script ends\n"
        f"save_checkpoint(fresh_components(), TrainingState(step=3), {str(tmp_path)!r}, writer=CheckpointWriter())\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert latest_checkpoint(tmp_path) == tmp_path / "step_3"


def test_retention_never_deletes_the_checkpoint_just_written(tmp_path):
    """A rolled-back run saving step 15 beside a stale step 20 keeps step 15."""
    components = fresh_components()
    for step in (10, 20):
        save_checkpoint(components, TrainingState(step=step), tmp_path, keep_last=2)
    path = save_checkpoint(components, TrainingState(step=15), tmp_path, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_15", "step_20"]
    save_checkpoint(components, TrainingState(step=15), tmp_path, keep_last=1)
    assert [p.name for p in tmp_path.iterdir()] == ["step_15"] and path.is_dir()


def test_re_saving_a_step_swaps_directories_in_one_step(tmp_path, monkeypatch):
    import rollouts.backends.checkpoint.durable as durable

    components = fresh_components()
    save_checkpoint(components, TrainingState(step=1), tmp_path, extra={"v": 1})
    assert durable.ATOMIC_EXCHANGE  # Linux: the exchange is available, so nothing is renamed away first

    def never(path, root):
        raise AssertionError(f"{path} was renamed away before the new directory took its name")

    monkeypatch.setattr(durable, "to_trash", never)
    path = save_checkpoint(components, TrainingState(step=1), tmp_path, extra={"v": 2})
    assert load_checkpoint(fresh_components(), path)[1] == {"v": 2}
    assert [p.name for p in tmp_path.iterdir()] == ["step_1"]


def test_an_export_leaves_the_weights_the_last_one_replaced_to_the_writer(tmp_path, monkeypatch):
    # Exports back to back (a sync every step): the weights one export swaps out are deleted on the
    # writer's thread, which may still be at it when the next export starts; that export must not
    # touch them (it once reused their temporary name and deleted them under the writer's feet).
    import rollouts.backends.checkpoint.export as export_module

    release, published, seen = threading.Event(), [0], []
    delete_dirs, publish_dir = export_module.delete_dirs, export_module.publish_dir

    def slow_delete(dirs):  # the writer's deletion, held until the next export publishes
        if dirs:
            release.wait(10.0)
            seen.append(all((d / "handed-to-the-writer").exists() for d in dirs))
        delete_dirs(dirs)

    def publish(tmp, final):
        published[0] += 1
        if published[0] == 3:  # the third export has set up and written its own directory
            release.set()
        trash = publish_dir(tmp, final)
        for d in trash:  # marks the very directories handed to the writer
            (d / "handed-to-the-writer").touch()
        return trash

    monkeypatch.setattr(export_module, "delete_dirs", slow_delete)
    monkeypatch.setattr(export_module, "publish_dir", publish)
    components = fresh_components()
    writer = CheckpointWriter()
    try:
        for _ in range(4):
            export_weights(components, tmp_path / "weights", writer=writer)
        writer.wait(10.0)
    finally:
        release.set()
        writer.close(10.0)
    assert seen == [True, True, True]  # each replaced export was still there for the writer to delete
    assert sorted(p.name for p in tmp_path.iterdir()) == ["weights"]
    _assert_bit_identical(read_weights(tmp_path / "weights"), _weights(components.model))


def test_durable_and_page_cache_exports_write_the_same_files(tmp_path):
    components = fresh_components()
    _, fast = export_weights(components, tmp_path / "fast")
    _, durable = export_weights(components, tmp_path / "durable", durable=True)
    assert fast == durable
    for directory in ("fast", "durable"):
        _assert_bit_identical(read_weights(tmp_path / directory), _weights(components.model))


def _word_tokenizer():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    inner = Tokenizer(WordLevel({"[UNK]": 0, "a": 1, "b": 2}, unk_token="[UNK]"))
    inner.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=inner, unk_token="[UNK]")


@pytest.mark.parametrize("victim", ["model.safetensors", "optimizer.safetensors", "config.json", "tokenizer.json"])
def test_load_checkpoint_refuses_a_file_that_does_not_match_its_record(tmp_path, victim):
    components = fresh_components()
    path = save_checkpoint(
        components, train_steps(components, TrainingState(), 1), tmp_path, tokenizer=_word_tokenizer()
    )
    record = json.loads((path / "state.json").read_text())
    assert "tokenizer.json" in record["files"]  # tokenizer files are recorded like the others
    target = path / victim
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0x01
    target.write_bytes(bytes(data))
    assert latest_checkpoint(tmp_path) is None
    fresh = fresh_components()
    before = _weights(fresh.model)
    with pytest.raises(ValueError, match=rf"\['{victim}'\] do not match the size and CRC-32"):
        load_checkpoint(fresh, path)
    if victim != "optimizer.safetensors":  # refused before any weight is touched
        _assert_bit_identical(_weights(fresh.model), before)


def test_a_checkpoint_without_optimizer_state_loads_with_fresh_moments_and_the_schedule_position(tmp_path):
    components = fresh_components(num_training_steps=6)
    state = train_steps(components, TrainingState(), 3)
    path = save_checkpoint(components, state, tmp_path, save_optimizer=False)
    assert not has_optimizer_state(path) and has_optimizer_state(save_checkpoint(components, state, tmp_path / "full"))
    with pytest.raises(ValueError, match="holds no optimizer state"):
        load_checkpoint(fresh_components(num_training_steps=6), path)
    resumed = fresh_components(num_training_steps=6)
    loaded, _ = load_checkpoint(resumed, path, load_optimizer=False)
    assert loaded.step == 3 and not resumed.optimizer.state
    _assert_bit_identical(_weights(resumed.model), _weights(components.model))
    assert [g["lr"] for g in resumed.optimizer.param_groups] == [g["lr"] for g in components.optimizer.param_groups]
    assert resumed.scheduler.last_epoch == components.scheduler.last_epoch


def test_further_models_are_saved_checked_and_loaded_with_the_checkpoint(tmp_path):
    components = fresh_components()
    reference = tiny_model(seed=5)
    path = save_checkpoint(components, TrainingState(step=1), tmp_path, models={"reference": reference})
    assert "reference.safetensors" in json.loads((path / "state.json").read_text())["files"]
    into = tiny_model(seed=6)
    load_checkpoint(fresh_components(), path, models={"reference": into})
    _assert_bit_identical(_weights(into), _weights(reference))
    with pytest.raises(ValueError, match="critic"):
        load_checkpoint(fresh_components(), path, models={"critic": into})
    with pytest.raises(ValueError, match="must be lowercase"):
        save_checkpoint(components, TrainingState(step=2), tmp_path, models={"model": reference})
    data = bytearray((path / "reference.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (path / "reference.safetensors").write_bytes(bytes(data))
    assert verify_checkpoint(path) == ["reference.safetensors does not match its recorded CRC-32 (damaged)"]
