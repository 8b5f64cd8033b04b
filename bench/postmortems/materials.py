"""What the five post-mortem scripts run on: a tiny Llama built from a config (save_pretrained into a
directory, with the demo tokenizer) and local text files of the shapes each case needs. Used by
bench/postmortems.py and tests/test_postmortems.py; nothing is downloaded."""
from __future__ import annotations

import json
import random
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "tokenpulse" / "demo"
FORTUNES = ROOT.parent / "shared" / "data" / "fortunes.jsonl"  # the bench's real text, when present


def build_model(out: Path, hidden: int = 32, layers: int = 2, heads: int = 2, max_positions: int = 4096) -> Path:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    tok = AutoTokenizer.from_pretrained(str(DEMO))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=hidden * 11 // 4 // 8 * 8,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                      max_position_embeddings=max_positions, tie_word_embeddings=True, use_cache=False,
                      pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    LlamaForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def _texts(source: Path) -> list[str]:
    return [json.loads(line)["text"] for line in source.read_text().splitlines() if line.strip()]


def source_texts() -> Path:
    return FORTUNES if FORTUNES.exists() else DEMO / "demo.jsonl"


def short_texts(out: Path, n: int, max_tokens: int = 67, source: Path | None = None) -> Path:
    """n texts of at most max_tokens tokens (case a)."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(DEMO))
    keep = [t for t in _texts(source or source_texts()) if len(tok(t)["input_ids"]) <= max_tokens]
    rows = [keep[i % len(keep)] for i in range(n)]
    out.write_text("".join(json.dumps({"text": t}) + "\n" for t in rows))
    return out


def long_texts(out: Path, n: int, lo: int, hi: int, seed: int = 0, source: Path | None = None,
               longest: int | None = None) -> Path:
    """n texts of lo..hi tokens (uniform), made of real texts joined; one of exactly `longest`
    tokens' worth when given (cases c, d)."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(DEMO))
    rng = random.Random(seed)
    pool = _texts(source or source_texts())
    ids = [i for t in pool for i in tok(t + "\n")["input_ids"]]
    rows, pos = [], 0
    for k in range(n):
        want = longest if (longest and k == 0) else rng.randint(lo, hi)
        if pos + want > len(ids):
            pos = 0
        rows.append(tok.decode(ids[pos:pos + want]))
        pos += want
    rng.shuffle(rows)
    out.write_text("".join(json.dumps({"text": t}) + "\n" for t in rows))
    return out
