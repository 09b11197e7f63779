"""Build a tiny random Qwen2 model + tokenizer, or compute a float32 reference forward pass.

Run with a Python that has torch + transformers + tokenizers (e.g. the vLLM venv); this file
imports nothing from rollouts, so rollouts-sync itself stays torch-free:

    python scripts/vllm_tiny_model.py build OUT_DIR [--seed S]
    python scripts/vllm_tiny_model.py greedy MODEL_DIR --prompt 1,2,3 --max-new-tokens 8
        -> JSON {"tokens": [...], "logprobs": [...]} greedy continuation, float32
"""

from __future__ import annotations

import argparse
import json

VOCAB_SIZE = 256
"""Model vocabulary (the trained tokenizer uses fewer ids; the rest are never produced by it)."""
INIT_STD = 0.3  # wide enough that logits have clear argmaxes (0.02 gives near-ties and flaky greedy)
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a tiny model for testing weight sync between trainer and engine",
    "numbers 0 1 2 3 4 5 6 7 8 9 and letters abcdefghijklmnopqrstuvwxyz",
] * 20


def build(out_dir: str, seed: int) -> None:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=200, special_tokens=["<unk>", "<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", eos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
    eos_id = fast.convert_tokens_to_ids("<|endoftext|>")
    config = Qwen2Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        initializer_range=INIT_STD,
        eos_token_id=eos_id,
        bos_token_id=eos_id,
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(torch.float32)
    with torch.no_grad():  # random biases too, so a partial update of a bias is visible
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, INIT_STD)
    model.save_pretrained(out_dir, safe_serialization=True)
    fast.save_pretrained(out_dir)


def greedy(model_dir: str, prompt: list[int], max_new_tokens: int) -> dict[str, list]:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokens, logprobs = list(prompt), []
    with torch.no_grad():
        for _ in range(max_new_tokens):  # full forward each step: no KV cache to get wrong
            logits = model(torch.tensor([tokens])).logits[0, -1].to(torch.float64)
            lp = torch.log_softmax(logits, dim=-1)
            t = int(lp.argmax())
            tokens.append(t)
            logprobs.append(float(lp[t]))
    return {"tokens": tokens[len(prompt) :], "logprobs": logprobs}


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("out_dir")
    b.add_argument("--seed", type=int, default=0)
    g = sub.add_parser("greedy")
    g.add_argument("model_dir")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-new-tokens", type=int, required=True)
    args = parser.parse_args()
    if args.cmd == "build":
        build(args.out_dir, args.seed)
    else:
        prompt = [int(x) for x in args.prompt.split(",")]
        print(json.dumps(greedy(args.model_dir, prompt, args.max_new_tokens)))


if __name__ == "__main__":
    main()
