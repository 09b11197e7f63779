"""The `rollouts` command: sft, rl, dpo, pipeline, plot, demo.

Configs are checked completely (file, keys, types, ranges, data files, model directory) before any
work starts; a bad one exits with status 2 and a message naming the file and the key.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
from collections.abc import Callable, Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from rollouts.loops.app.config import ConfigError, RLRun, SFTRun, load_run
from rollouts.loops.app.dpo_run import DPORun
from rollouts.loops.app.failures import RunFailed, print_failure, report
from rollouts.loops.app.toml_out import documented_toml
from rollouts.loops.errors import DamagedCheckpointError

_SECTIONS = {
    "sft": "[model] path, dtype, device, attn_implementation, gradient_checkpointing, compile, gather_once_per_step\n"
    "  [data] train_path (chat JSONL: messages)\n  [run] out_dir, resume\n"
    "  [log] wandb, tensorboard\n  [sft] num_steps, batch_size, max_length, ... [sft.optimizer] [sft.checkpoint]",
    "rl": "preset = grpo | drgrpo | dapo | ...\n  [model] path, ...\n  [data] train_path, eval_path, prompt_key, answer_key\n"
    "  [engine] kind (inprocess | process | vllm | sglang), urls, timeouts\n  [run] out_dir, resume\n"
    "  [reward] fn, batched, on_error, timeout_s\n  [hooks] rollout, filter, advantages, loss\n"
    "  [eval] every_steps, samples_per_prompt, temperature\n  [log] wandb, tensorboard, num_sample_completions\n"
    "  [rl] num_steps, overlap, ... [rl.rollout] [rl.rollout.sampling] [rl.algorithm] [rl.optimizer] [rl.checkpoint]\n"
    "  [rl.reference] update (frozen | ema | reset), ema_decay, reset_every_steps",
    "dpo": "[model] path, dtype, device, ...\n  [data] train_path, eval_path (JSONL: prompt, chosen, rejected), num_eval\n"
    "  [run] out_dir, resume\n  [log] wandb, tensorboard\n  [dpo] loss (sigmoid | robust | ipo | hinge | simpo | orpo | kto), "
    "beta, label_smoothing, num_steps, batch_size, ... [dpo.optimizer] [dpo.checkpoint]",
}
_RUNS: dict[str, type] = {"sft": SFTRun, "rl": RLRun, "dpo": DPORun}


def _version() -> str:
    try:
        return version("rollouts-loops")
    except PackageNotFoundError:
        return "unknown (not installed)"


def _add_engine_parser(sub: Any) -> None:
    p = sub.add_parser(
        "engine",
        help="start an inference server for RL (vLLM with weight sync), print its URL, serve until stopped",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Start a vLLM server that `rollouts rl` drives (dev-mode endpoints and the weight-receiving "
        "worker extension on), wait for its health, print its URL, and serve until Ctrl-C or SIGTERM. "
        'Then, in the run file: [engine] kind = "vllm", urls = ["http://HOST:PORT"], sync = "http".',
    )
    p.add_argument("kind", choices=("vllm",))
    p.add_argument("--model", required=True, help="HF-format model directory the server starts from")
    p.add_argument("--python", default=None, help="python of an environment with vLLM (default: this one)")
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on (0.0.0.0: every one)")
    p.add_argument("--port", type=int, default=None, help="port (default: a free one)")
    p.add_argument("--dtype", default="auto", help="vLLM --dtype (auto, bfloat16, float32, ...)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs / compilation")
    p.add_argument("--startup-timeout-s", type=float, default=900.0)
    p.add_argument("--log", default=None, help="server log file (default: vllm-<port>.log here)")
    p.add_argument(
        "--max-lora-rank",
        type=int,
        default=None,
        help="serve LoRA adapters up to this rank, loaded at run time (model.lora.sync = 'adapter')",
    )
    p.add_argument(
        "--cpu-kv-cache-gb",
        type=int,
        default=None,
        help="on a host without a GPU: GiB of memory for vLLM's KV cache "
        "(VLLM_CPU_KVCACHE_SPACE; default a quarter of the memory, at most 4)",
    )
    p.add_argument(
        "--vllm-args",
        default="",
        help="more vLLM server arguments, one quoted string (e.g. '--gpu-memory-utilization 0.8')",
    )


def _add_export_parser(sub: Any) -> None:
    p = sub.add_parser(
        "export",
        help="write a checkpoint as a loadable model (a LoRA one as its adapter, or merged with --merge)",
        description="A checkpoint as a model others load: full weights as an HF model; a LoRA checkpoint as "
        "its adapter (PEFT's format, for peft or vLLM's --lora-modules) or, with --merge, merged into the "
        "base model it records (or --base). Tokenizer files are copied too.",
    )
    p.add_argument("checkpoint", help="a checkpoint directory (step_<n>)")
    p.add_argument("out", help="directory to write (an earlier export there is replaced)")
    p.add_argument(
        "--force", action="store_true", help="replace OUT even if it holds other files (never a run directory)"
    )
    p.add_argument("--merge", action="store_true", help="LoRA: merge the adapter into the base weights")
    p.add_argument("--base", default=None, help="LoRA: the base model directory (default: the one recorded)")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rollouts",
        description="SFT and RL post-training for LLMs.",
        epilog="Every key of a run file, with its default and meaning: "
        "rollouts config show sft|rl|dpo. Examples: examples/*.toml.",
    )
    parser.add_argument("--version", action="version", version=f"rollouts {_version()}")
    parser.add_argument(
        "--log-level",
        default="INFO",
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        help="level of the library's log messages on stderr (default INFO)",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, what in (
        ("sft", "supervised fine-tuning"),
        ("rl", "reinforcement learning"),
        ("dpo", "offline preference optimization (DPO, IPO, SimPO, ORPO, KTO, ...)"),
    ):
        p = sub.add_parser(
            name,
            help=what,
            formatter_class=argparse.RawDescriptionHelpFormatter,
            epilog=f"run file sections:\n  {_SECTIONS[name]}\n\nall keys: rollouts config show {name}",
        )
        p.add_argument("--config", required=True, help="TOML run file")
        p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
        p.add_argument(
            "--resume",
            choices=("auto", "never", "must"),
            default=None,
            help="override run.resume: auto (if out_dir has a checkpoint), never, must",
        )
        p.add_argument(
            "--resume-from",
            default=None,
            metavar="CHECKPOINT",
            help="resume from this checkpoint (out_dir/checkpoints/step_N) instead of the newest",
        )
    p = sub.add_parser("config", help="print a run file with every key, its default and what it means")
    p.add_argument("action", choices=("show",))
    p.add_argument("kind", choices=tuple(_RUNS))
    p = sub.add_parser("eval", help="evaluate a saved model: mean reward, pass@1, pass@k, maj@k (JSON)")
    p.add_argument("--config", required=True, help="TOML RL run file ([data] eval_path, [reward], [eval])")
    p.add_argument("--checkpoint", required=True, help="HF-format model directory, e.g. a run's checkpoints/step_N")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    p = sub.add_parser("pipeline", help="SFT, then RL from SFT's last checkpoint")
    p.add_argument("--sft-config", required=True)
    p.add_argument("--rl-config", required=True)
    p.add_argument("--set-sft", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--set-rl", action="append", default=[], metavar="KEY=VALUE")
    p = sub.add_parser("plot", help="PNG of a run's metrics")
    p.add_argument("run_dir")
    p.add_argument("--out", default=None)
    _add_engine_parser(sub)
    _add_export_parser(sub)
    p = sub.add_parser("demo", help="tiny model: SFT then RL on addition, on CPU, in minutes")
    p.add_argument("--quick", action="store_true", help="a sub-minute variant (no accuracy targets)")
    p.add_argument("--out", default=None, help="run directory (default runs/demo-<time>)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a DemoConfig field (rl_steps=100) or the RL stage's LoRA (model.lora.rank=8)",
    )
    return parser


# Each command's module is imported only when that command runs: the training stack (torch,
# transformers) loads for a run, never for --help, --version, `config show` or a config error.
_COMMANDS = {
    "sft": "rollouts.loops.app.commands:cmd_sft",
    "rl": "rollouts.loops.app.commands:cmd_rl",
    "dpo": "rollouts.loops.app.dpo_cmd:cmd_dpo",
    "eval": "rollouts.loops.app.commands:cmd_eval",
    "pipeline": "rollouts.loops.app.commands:cmd_pipeline",
    "engine": "rollouts.loops.app.engine_cmd:cmd_engine",
    "export": "rollouts.loops.app.export_cmd:cmd_export",
    "plot": "rollouts.loops.app.plot:plot_run",
    "demo": "rollouts.loops.app.demo:cmd_demo",
    "close_distributed": "rollouts.loops.run.distributed:close_distributed",
}


def _command(name: str) -> Callable[..., Any]:
    module, function = _COMMANDS[name].split(":")
    found: Callable[..., Any] = getattr(importlib.import_module(module), function)
    return found


def _run_command(args: argparse.Namespace, sets: list[str]) -> int:
    """Dispatch one parsed command line; returns the exit status. Run files load (and a bad one is
    refused) before the command's module is imported."""
    if args.command == "sft":
        sft = load_run(SFTRun, args.config, sets)
        _command("sft")(sft, args.config)
    elif args.command == "rl":
        rl = load_run(RLRun, args.config, sets)
        _command("rl")(rl, args.config)
    elif args.command == "dpo":
        dpo = load_run(DPORun, args.config, sets)
        _command("dpo")(dpo, args.config)
    elif args.command == "config":
        print(documented_toml(_RUNS[args.kind]), end="")
    elif args.command == "eval":
        rl = load_run(RLRun, args.config, args.set)
        _command("eval")(rl, args.config, args.checkpoint)
    elif args.command == "pipeline":
        sft, rl = load_run(SFTRun, args.sft_config, args.set_sft), load_run(RLRun, args.rl_config, args.set_rl)
        _command("pipeline")(sft, args.sft_config, rl, args.rl_config)
    elif args.command in ("engine", "export", "demo"):
        status: int = _command(args.command)(args)
        return status
    elif args.command == "plot":
        print(_command("plot")(args.run_dir, out=args.out))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `rollouts` console script; returns the exit status."""
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    sets = [*getattr(args, "set", []), *([f"run.resume='{args.resume}'"] if getattr(args, "resume", None) else [])]
    if getattr(args, "resume_from", None):
        sets.append(f"run.resume_from={json.dumps(str(Path(args.resume_from).absolute()))}")
    clean = False
    try:
        status = _run_command(args, sets)
        clean = True
        return status
    except ConfigError as e:
        print(f"rollouts {args.command}: config error: {e}", file=sys.stderr)
        return 2
    except DamagedCheckpointError as e:
        print(f"rollouts {args.command}: {e}", file=sys.stderr)
        return 2
    except RunFailed as e:  # a run's failure or interrupt, already put in one paragraph with its run's state
        return print_failure(e)
    except (Exception, KeyboardInterrupt) as e:  # outside a run: the paragraph without a run directory
        return print_failure(report(e, None))
    finally:
        if "torch" in sys.modules:  # only a run that imported torch can have a process group
            _command("close_distributed")(clean=clean)


if __name__ == "__main__":
    sys.exit(main())
