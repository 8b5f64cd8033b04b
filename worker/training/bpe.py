"""Train a byte-level BPE tokenizer from texts, with no download (demo assets and the benchmark).

`python -m worker.training.bpe` rebuilds tokenpulse/demo/ (demo.jsonl + tokenizer) from fortunes.jsonl.
"""
from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Iterable

EOS, PAD = "<|endoftext|>", "<|pad|>"


def train_bpe(texts: Iterable[str], vocab_size: int):
    """Byte-level BPE wrapped as a PreTrainedTokenizerFast with eos/pad tokens set."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS, PAD],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=PAD,
                                   bos_token=EOS, unk_token=None, model_max_length=4096)


def build_demo(src: Path, dest: Path, n: int = 1500, vocab_size: int = 2048, seed: int = 0) -> None:
    rows = [json.loads(line) for line in src.open()]
    rng = random.Random(seed)
    # Short texts keep the demo job fast; the long tail still shows up in the length histogram.
    pick = rng.sample([r for r in rows if len(r["text"]) <= 600], n)
    dest.mkdir(parents=True, exist_ok=True)
    with (dest / "demo.jsonl").open("w") as f:
        for r in pick:
            f.write(json.dumps({"text": r["text"]}) + "\n")
    train_bpe([r["text"] for r in pick], vocab_size).save_pretrained(dest)


if __name__ == "__main__":
    src = Path(sys.argv[1] if len(sys.argv) > 1 else "/work/shared/data/fortunes.jsonl")
    build_demo(src, Path(__file__).resolve().parents[2] / "tokenpulse" / "demo")
