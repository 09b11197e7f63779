"""The `rollouts dpo` command: a checked run file in, a finished preference-optimization run out."""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rollouts.data import PreferencePair, load_preference_pairs, tokenize_preference_pair
from rollouts.loops.app.config import ConfigError
from rollouts.loops.app.dpo_run import DPORun
from rollouts.loops.app.run_setup import (
    check_paths,
    load_data,
    local_model,
    preflight,
    prepare_run,
    raise_reported,
    release_run,
    run_components,
    run_loggers,
)
from rollouts.loops.dpo.batches import Pair
from rollouts.loops.dpo.loop import PreferenceData, run_dpo_training
from rollouts.loops.run.distributed import init_distributed
from rollouts.loops.run.run_dir import CHECKPOINTS_DIR

log = logging.getLogger(__name__)


def tokenize_pairs(pairs: Sequence[PreferencePair], tokenizer: Any, *, max_length: int, what: str) -> tuple[Pair, ...]:
    """Tokenized pairs, leaving out (with a warning) those where a completion has no token within
    max_length: such a pair compares nothing. None left is an error."""
    out = []
    dropped = []
    for i, pair in enumerate(pairs):
        chosen, rejected = tokenize_preference_pair(pair, tokenizer, max_length=max_length)
        if chosen.has_loss_tokens and rejected.has_loss_tokens:
            out.append((chosen, rejected))
        else:
            dropped.append(i)
    if not out:
        raise ConfigError(
            f"none of the {len(pairs)} {what} pairs has both completions within dpo.max_length={max_length} "
            "tokens: raise dpo.max_length"
        )
    if dropped:
        log.warning(
            "%d of %d %s pairs have a completion cut away entirely at dpo.max_length=%d (e.g. pair %d): left out",
            len(dropped),
            len(pairs),
            what,
            max_length,
            dropped[0],
        )
    return tuple(out)


def cmd_dpo(run: DPORun, source: str) -> Path:
    """Tokenize preference pairs with the model's chat template and train; returns the checkpoint root."""
    run = local_model(run, source)
    check_paths(run, source)
    rank, _ = init_distributed()
    train = load_data(load_preference_pairs, run.data.train_path)  # bad data refused before the run dir is touched
    held_out = load_data(load_preference_pairs, run.data.eval_path)[: run.data.num_eval] if run.data.eval_path else []
    tokenizer = preflight(run, source, "dpo")
    run, resume = prepare_run(run, "dpo", source)
    out = Path(run.run.out_dir)
    try:
        max_length = run.dpo.max_length
        data = PreferenceData(
            train=tokenize_pairs(train, tokenizer, max_length=max_length, what="training"),
            eval=tokenize_pairs(held_out, tokenizer, max_length=max_length, what="held-out") if held_out else (),
        )
        components = run_components(run, run.dpo.optimizer, run.dpo.num_steps)
        logger = run_loggers(run, out, "dpo", run.dpo.num_steps, rank=rank)
        try:
            state, _ = run_dpo_training(
                components,
                data,
                run.dpo,
                logger=logger,
                run_dir=out,
                resume=resume,
                resume_from=run.run.resume_from or None,
                tokenizer=tokenizer,
            )
        finally:
            logger.close()
    except (Exception, KeyboardInterrupt) as e:
        raise_reported(e, "dpo", source, out)
    finally:
        release_run(out, rank)
    print(f"dpo: finished at step {state.step}; checkpoints in {out / CHECKPOINTS_DIR}", file=sys.stderr)
    return out / CHECKPOINTS_DIR
