#!/usr/bin/env python3
"""make_tiny_model.py OUT_DIR -- a tiny Llama-shaped model directory for the CPU vLLM.

Serve it with ``vllm serve OUT_DIR --load-format dummy`` (scripts/vllm-cpu/serve.sh does):
no weights are written, vLLM's dummy loader makes random ones, so the text is gibberish
but the API, scheduler, KV/prefix cache, streaming and metrics are vLLM's own.

What it writes, with no download and the same bytes on every run:
  tokenizer.json         byte-level BPE (vocab 2048) trained here on a synthetic corpus
                         drawn from a fixed-seed RNG; any UTF-8 text round-trips
  tokenizer_config.json  ChatML chat template; eos = <|im_end|>; no BOS is added
  chat_template.jinja    the same template (newer transformers read this file)
  special_tokens_map.json, generation_config.json
  config.json            LlamaForCausalLM: hidden 128, 2 layers, 2 heads (head_dim 64),
                         intermediate 256, vocab 2048, max positions 2048, float32

Needs only the ``tokenizers`` package (the vLLM venv has it); when ``transformers`` is
importable it also checks that the directory loads and the template renders.

Usage: VENV/bin/python make_tiny_model.py OUT_DIR [--vocab 2048] [--hidden 128] [--layers 2]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SEED = 20241129
ENDOFTEXT, IM_START, IM_END, PAD = "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END, PAD]  # ids 0..3

# ChatML. String content or a list of {"type": "text", "text": ...} parts; other part types
# (images, ...) are dropped. Ends with the assistant header when add_generation_prompt.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] -}}"
    "{%- elif message['content'] is not none -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

# Words the tests and demo are likely to send, so that they tokenize compactly.
COMMON = (
    "the a an of to in on at for with from by and or not is are was be been it this that you "
    "we they he she i my your our what which who how why when where there here yes no ok "
    "hello hi world please thanks say tell write count list explain story poem answer question "
    "one two three four five six seven eight nine ten hundred first last next time day year "
    "model server request response token tokens stream router gateway latency queue cache "
    "prefix health metrics chat completion completions assistant user system tool function "
    "python async await json http api key error retry timeout load warm cold gpu cpu vllm "
    "llama fleet route admit reject usage prompt message content role data done"
).split()
CONSONANTS = "b c d f g h j k l m n p r s t v w z ch sh th st tr pl gr".split()
VOWELS = "a e i o u ai ea ou io".split()


def synthetic_words(rng: random.Random, n: int) -> list[str]:
    """Pronounceable pseudo-words: enough distinct pairs for the BPE to fill its vocab."""
    words = set()
    while len(words) < n:
        syllables = rng.randint(1, 4)
        words.add("".join(rng.choice(CONSONANTS) + rng.choice(VOWELS) for _ in range(syllables)))
    return sorted(words)


def corpus(lines: int = 30000) -> list[str]:
    rng = random.Random(SEED)
    vocab = COMMON * 8 + synthetic_words(rng, 4000)
    out = []
    for i in range(lines):
        words = [rng.choice(vocab) for _ in range(rng.randint(3, 16))]
        if rng.random() < 0.25:
            words[0] = words[0].capitalize()
        line = " ".join(words) + rng.choice(".,?!:;")
        r = rng.random()
        if r < 0.10:
            line = json.dumps({"id": i, "text": line, "score": round(rng.random(), 3)})
        elif r < 0.20:
            line += f" {rng.randint(0, 10 ** rng.randint(1, 6))}"
        elif r < 0.25:
            line = "    " + line.replace(" ", "_")  # code-ish: indentation, identifiers
        out.append(line)
    out.append("".join(chr(c) for c in range(32, 127)))  # every printable ASCII character
    return out


def build_tokenizer(vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    return tok


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Write a tiny Llama-shaped model dir (no weights).")
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--max-positions", type=int, default=2048)
    ap.add_argument("--no-check", action="store_true", help="skip the transformers self-check")
    args = ap.parse_args(argv)
    out: Path = args.out_dir
    out.mkdir(parents=True, exist_ok=True)

    tok = build_tokenizer(args.vocab)
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    if tok.get_vocab_size() != args.vocab:
        print(
            f"warning: tokenizer has {tok.get_vocab_size()} tokens, asked for {args.vocab}",
            file=sys.stderr,
        )
    vocab_size = max(args.vocab, tok.get_vocab_size())
    tok.save(str(out / "tokenizer.json"), pretty=False)

    write_json(
        out / "config.json",
        {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": vocab_size,
            "hidden_size": args.hidden,
            "intermediate_size": 2 * args.hidden,
            "num_hidden_layers": args.layers,
            "num_attention_heads": args.heads,
            "num_key_value_heads": args.heads,
            "head_dim": args.hidden // args.heads,
            "hidden_act": "silu",
            "max_position_embeddings": args.max_positions,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": False,
            "initializer_range": 0.02,
            "bos_token_id": ids[ENDOFTEXT],
            "eos_token_id": [ids[IM_END], ids[ENDOFTEXT]],
            "pad_token_id": ids[PAD],
            "torch_dtype": "float32",
            "use_cache": True,
        },
    )
    write_json(
        out / "generation_config.json",
        {
            "bos_token_id": ids[ENDOFTEXT],
            "eos_token_id": [ids[IM_END], ids[ENDOFTEXT]],
            "pad_token_id": ids[PAD],
        },
    )
    write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": None,
            "eos_token": IM_END,
            "pad_token": PAD,
            "unk_token": None,
            "add_bos_token": False,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": args.max_positions,
            "chat_template": CHAT_TEMPLATE,
            "added_tokens_decoder": {
                str(ids[t]): {
                    "content": t,
                    "lstrip": False,
                    "normalized": False,
                    "rstrip": False,
                    "single_word": False,
                    "special": True,
                }
                for t in SPECIAL_TOKENS
            },
        },
    )
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
    write_json(out / "special_tokens_map.json", {"eos_token": IM_END, "pad_token": PAD})

    sample = 'Hello, world! naïve café 日本語 🚀 {"a": 1}'
    enc = tok.encode(sample)
    assert tok.decode(enc.ids) == sample, "tokenizer does not round-trip"
    print(
        f"wrote {out}: vocab={vocab_size} hidden={args.hidden} layers={args.layers} "
        f"heads={args.heads} ({len(enc.ids)} tokens for {sample!r})"
    )

    if not args.no_check:
        try:
            from transformers import AutoTokenizer
        except ImportError:
            return 0
        t = AutoTokenizer.from_pretrained(str(out))
        text = t.apply_chat_template(
            [{"role": "user", "content": "hello"}], tokenize=False, add_generation_prompt=True
        )
        assert text == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n", repr(text)
        assert t.eos_token_id == ids[IM_END]
        print(f"transformers check ok: chat template renders {text!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
