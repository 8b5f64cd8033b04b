"""Training throughput: tokenpulse's worker vs Hugging Face Trainer setups and a hand-written loop.

One tiny Llama (~7M params: hidden 256, 6 layers, byte-level BPE vocab 8192 trained on fortunes),
same initial weights, same data, same seed, same real (non-pad) tokens, 2 threads. Cases:
  a  HF Trainer, padding to max_length 1024, fp32   (a few steps only: it is that slow)
  b  HF Trainer, dynamic padding, fp32
  c  HF Trainer, DataCollatorWithFlattening (padding-free), bf16
  d  plain PyTorch loop over rows packed to 1024 tokens, bf16 autocast, no telemetry
  e  tokenpulse's worker (worker.session.Session, the code path of `python -m worker.training.train`),
     default settings, telemetry on (events serialized to /dev/null)
Each case runs in its own process (clean peak RSS). Speeds skip the first 2 optimizer steps (1 for a).
"final loss" is the mean token loss on 256 held-out examples after training (fp32).

    .venv/bin/python bench/train_throughput.py [--quick] [--cases abcde] [--examples N]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from worker.training.runtime import configure  # noqa: E402

# Every case gets the worker's CPU runtime defaults (OMP_WAIT_POLICY=PASSIVE), so the ratios measure
# the training code, not the environment; children inherit it.
RUNTIME = configure()
FORTUNES = Path("/work/shared/data/fortunes.jsonl")
MAXLEN = 1024
EX_PER_STEP = 32  # effective batch: 32 examples (or the same real tokens) per optimizer step
LR = 1e-3
SEED = int(os.environ.get("TP_BENCH_SEED", "0"))  # data order / Trainer seed (init weights fixed)


def setup(cache: Path, n_train: int) -> dict:
    """Tokenizer, initial model and data files, built once per (n_train) and shared by all cases."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from worker.training.bpe import train_bpe
    cache.mkdir(parents=True, exist_ok=True)
    meta_path = cache / f"meta-{n_train}.json"
    if meta_path.exists():
        return json.loads(meta_path.read_text())
    texts = [json.loads(line)["text"] for line in FORTUNES.open()]
    model_dir = cache / "model-init"
    if not (model_dir / "model.safetensors").exists():
        tok = train_bpe(texts, 8192)
        cfg = LlamaConfig(vocab_size=len(tok), hidden_size=256, intermediate_size=688, num_hidden_layers=6,
                          num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=2048,
                          tie_word_embeddings=True, use_cache=False,  # a KV cache would disable packed masking
                          pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                          bos_token_id=tok.eos_token_id)
        torch.manual_seed(0)
        LlamaForCausalLM(cfg).save_pretrained(model_dir)
        tok.save_pretrained(model_dir)
    rng = random.Random(0)  # the same train/held-out split whatever the seed
    rng.shuffle(texts)
    heldout, train = texts[:256], texts[256:256 + n_train]
    (cache / f"train-{n_train}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in train))
    (cache / "heldout.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in heldout))
    meta = {"model": str(model_dir), "train": str(cache / f"train-{n_train}.jsonl"),
            "heldout": str(cache / "heldout.jsonl"), "n_train": n_train}
    meta_path.write_text(json.dumps(meta))
    return meta


def encode(tok, path: str) -> list[list[int]]:
    """The worker's own tokenization (special tokens, then EOS), cut at 1024 for every case."""
    from worker.training.tokenization import encode_batch
    texts = [json.loads(line)["text"] for line in open(path)]
    t = encode_batch(tok, [("", x) for x in texts], is_pair=False, mask_prompt=False)
    return [t.tokens[t.offsets[i]:t.offsets[i + 1]][:MAXLEN].tolist() for i in range(t.n)]


def heldout_loss(model, tok, path: str) -> float:
    import torch
    import torch.nn.functional as F
    model = model.float().eval()
    tot, n = 0.0, 0
    with torch.no_grad():
        for ids in encode(tok, path):
            x = torch.tensor([ids])
            logits = model(input_ids=x, use_cache=False).logits[0, :-1]
            tot += F.cross_entropy(logits.float(), x[0, 1:], reduction="sum").item()
            n += len(ids) - 1
    return tot / n


# ---- HF Trainer cases ------------------------------------------------------------------------------

def run_trainer(case: str, meta: dict, quick: bool) -> dict:
    import torch
    from datasets import Dataset
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        DataCollatorWithFlattening,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )
    tok = AutoTokenizer.from_pretrained(meta["model"])
    model = AutoModelForCausalLM.from_pretrained(meta["model"], dtype=torch.float32)
    model.config.use_cache = False
    ids = encode(tok, meta["train"])
    ds = Dataset.from_dict({"input_ids": ids})
    real_per_micro: list[int] = []
    padded_per_micro: list[int] = []
    pad = tok.pad_token_id

    def pad_collate(feats, to=None):
        w = to or max(len(f["input_ids"]) for f in feats)
        x = torch.full((len(feats), w), pad)
        m = torch.zeros((len(feats), w), dtype=torch.long)
        for i, f in enumerate(feats):
            x[i, :len(f["input_ids"])] = torch.tensor(f["input_ids"])
            m[i, :len(f["input_ids"])] = 1
        labels = x.masked_fill(m == 0, -100)
        return {"input_ids": x, "attention_mask": m, "labels": labels}

    flat = DataCollatorWithFlattening(return_position_ids=True, separator_id=-100)

    def collate(feats):
        real_per_micro.append(sum(len(f["input_ids"]) for f in feats))
        out = pad_collate(feats, MAXLEN) if case == "a" else pad_collate(feats) if case == "b" else flat(feats)
        padded_per_micro.append(out["input_ids"].numel())
        return out

    micro, accum = (8, 4) if case == "a" else (EX_PER_STEP, 1)
    if case == "a" and quick:
        micro, accum = 4, 2
    max_steps = (3 if not quick else 2) if case == "a" else -1
    times: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter())

    args = TrainingArguments(output_dir=f"/tmp/tp-bench-{case}", per_device_train_batch_size=micro,
                             gradient_accumulation_steps=accum, learning_rate=LR, lr_scheduler_type="linear",
                             warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, num_train_epochs=1,
                             max_steps=max_steps, bf16=(case == "c"), use_cpu=True, seed=SEED,
                             data_seed=SEED, logging_steps=10 ** 9, save_strategy="no", report_to=[],
                             disable_tqdm=True, dataloader_num_workers=0, remove_unused_columns=False)
    trainer = Trainer(model=model, args=args, train_dataset=ds, data_collator=collate, callbacks=[Clock()])
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0
    skip = 1 if case == "a" else 2
    steps = len(times)
    real_steps = [sum(real_per_micro[k * accum:(k + 1) * accum]) for k in range(steps)]
    real = sum(real_steps[skip:])
    secs = times[-1] - times[skip - 1]
    out = {"real_tok_s": real / secs, "steps": steps, "real_tokens_total": sum(real_steps), "train_wall_s": wall,
           "padding_frac": 1 - sum(real_per_micro) / sum(padded_per_micro)}
    out["final_loss"] = heldout_loss(model, tok, meta["heldout"]) if case != "a" else None
    return out


# ---- plain PyTorch loop over packed rows -------------------------------------------------------------

def run_plain(meta: dict) -> dict:
    import numpy as np
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(meta["model"])
    model = AutoModelForCausalLM.from_pretrained(meta["model"], dtype=torch.float32)
    ids = encode(tok, meta["train"])
    rng = np.random.default_rng(SEED)
    order = rng.permutation(len(ids))
    # greedy packing into 1024-token rows, positions restart per example, no loss across boundaries
    rows, cur = [], []
    for i in order:
        if sum(len(ids[j]) for j in cur) + len(ids[i]) > MAXLEN:
            rows.append(cur)
            cur = []
        cur.append(i)
    rows.append(cur)
    mean = sum(map(len, ids)) / len(ids)
    rows_per_step = max(1, round(EX_PER_STEP * mean / MAXLEN))
    steps = len(rows) // rows_per_step

    def batch(rs):
        x = torch.full((len(rs), MAXLEN), tok.pad_token_id)
        pos = torch.arange(MAXLEN).repeat(len(rs), 1)
        y = torch.full((len(rs), MAXLEN), -100)
        real = 0
        for r, row in enumerate(rs):
            c = 0
            for j in row:
                s = torch.tensor(ids[j])
                n = len(s)
                x[r, c:c + n] = s
                pos[r, c:c + n] = torch.arange(n)
                y[r, c:c + n - 1] = s[1:]
                c += n
                real += n
            pos[r, c:] = torch.arange(pos[r, c - 1] + 1, pos[r, c - 1] + 1 + MAXLEN - c)
        return x, pos, y, real

    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0.0, (steps - s) / steps))
    model.train()
    real_total, t_start = 0, None
    t0 = time.perf_counter()
    for k in range(steps):
        x, pos, y, real = batch(rows[k * rows_per_step:(k + 1) * rows_per_step])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=x, position_ids=pos, use_cache=False).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1), ignore_index=-100)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if k == 1:
            t_start = time.perf_counter()
        elif k > 1:
            real_total += real
    secs = time.perf_counter() - t_start
    fill = sum(len(ids[j]) for r in rows[:steps * rows_per_step] for j in r) / (steps * rows_per_step * MAXLEN)
    return {"real_tok_s": real_total / secs, "steps": steps, "padding_frac": 1 - fill,
            "train_wall_s": time.perf_counter() - t0, "final_loss": heldout_loss(model, tok, meta["heldout"])}


# ---- tokenpulse worker ------------------------------------------------------------------------------

def run_worker(meta: dict, cache: Path, torch_compile: str = "auto") -> dict:
    from transformers import AutoTokenizer

    from tokenpulse.protocol import JobSpec
    from worker.training.controls import Controls
    from worker.training.emit import Emitter
    from worker.training.session import Session
    tok = AutoTokenizer.from_pretrained(meta["model"])
    ids = encode(tok, meta["train"])
    mean = sum(map(len, ids)) / len(ids)
    spec = JobSpec(model=meta["model"], dataset=meta["train"], epochs=1, learning_rate=LR, warmup_steps=0,
                   tokens_per_batch=int(round(EX_PER_STEP * mean)), max_seq_length=MAXLEN,
                   length_coverage=100, seed=SEED, log_every=1, torch_compile=torch_compile)
    infos = []

    class Tee(Emitter):  # the real emitter (to /dev/null), keeping the info events for the report
        def emit(self, kind, /, **data):
            if kind == "info":
                infos.append(data)
            super().emit(kind, **data)

    em = Tee(fd=os.open(os.devnull, os.O_WRONLY))
    t0 = time.perf_counter()
    s = Session(spec, cache / "worker-out", em, Controls(), cache_dir=cache / "tok-cache")
    code = s.run()
    wall = time.perf_counter() - t0
    assert code == 0, code
    r = s.result.timed
    chosen = {k: v for d in infos for k, v in d.items() if k in ("padding", "precision", "bf16_speedup", "batch_size",
                                                              "row_len", "grad_accum", "max_seq_length", "loss_head",
                                                              "compiled_loss_speedup")}
    reasons = [d["reason"] for d in infos if "loss_head" in d and "reason" in d]
    if reasons:
        chosen["loss_head_reason"] = reasons[-1]
    return {"real_tok_s": r["real"] / r["seconds"], "steps": s.result.step, "padding_frac": 1 - r["real"] / r["padded"],
            "train_wall_s": r["seconds"], "process_wall_s": wall, "chosen": chosen,
            "final_loss": heldout_loss(s.model, tok, meta["heldout"])}


def child(case: str, meta: dict, cache: Path, quick: bool, torch_compile: str) -> None:
    import torch
    torch.set_num_threads(2)
    if case in "abc":
        out = run_trainer(case, meta, quick)
    elif case == "d":
        out = run_plain(meta)
    else:
        out = run_worker(meta, cache, torch_compile)
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("RESULT " + json.dumps(out))


def table(results: dict) -> str:
    names = {"a": "HF Trainer, pad to 1024, fp32", "b": "HF Trainer, dynamic padding, fp32",
             "c": "HF Trainer, flattening, bf16", "d": "plain loop, packed 1024, bf16",
             "e": "tokenpulse worker (defaults)"}
    lines = [f"{'case':<36} {'real tok/s':>10} {'pad frac':>8} {'final loss':>10} {'peak RSS MB':>11} {'steps':>5}"]
    for c, r in results.items():
        pf = "-" if r.get("padding_frac") is None else f"{r['padding_frac']:.3f}"
        fl = "-" if r.get("final_loss") is None else f"{r['final_loss']:.4f}"
        lines.append(f"{c}) {names[c]:<33} {r['real_tok_s']:>10.0f} {pf:>8} {fl:>10} {r['peak_rss_mb']:>11.0f} "
                     f"{r['steps']:>5}")
    if "e" in results:
        e = results["e"]["real_tok_s"]
        ratios = "  ".join(f"e/{c} = {e / results[c]['real_tok_s']:.2f}" for c in "abcd" if c in results)
        lines.append("ratios: " + ratios)
        lines.append("worker choices: " + json.dumps(results["e"].get("chosen", {})))
        lines.append(f"worker whole session (load, tokenize, autotune, train, save): "
                     f"{results['e'].get('process_wall_s', 0):.1f} s")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="short run (fewer examples)")
    ap.add_argument("--cases", default="abcde")
    ap.add_argument("--examples", type=int, help="training examples (default 2048, quick 512)")
    ap.add_argument("--cache", type=Path, default=Path("/tmp/tokenpulse-bench"))
    ap.add_argument("--torch-compile", choices=("auto", "on", "off"), default="auto",
                    help="case e's torch_compile (default auto: the worker's own choice)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    n = args.examples or (512 if args.quick else 2048)
    meta = setup(args.cache, n)
    if args.child:
        child(args.child, meta, args.cache, args.quick, args.torch_compile)
        return
    results = {}
    for c in args.cases:
        t = time.perf_counter()
        p = subprocess.run([sys.executable, __file__, "--child", c, "--cache", str(args.cache), "--examples", str(n),
                            "--torch-compile", args.torch_compile]
                           + (["--quick"] if args.quick else []), capture_output=True, text=True, cwd=ROOT)
        line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
        if p.returncode != 0 or not line:
            print(f"case {c} failed:\n{p.stderr[-3000:]}", file=sys.stderr)
            continue
        results[c] = json.loads(line[-1][7:])
        print(f"case {c}: {results[c]['real_tok_s']:.0f} real tok/s ({time.perf_counter() - t:.0f} s)", flush=True)
    print(f"\n{n} training examples, {EX_PER_STEP} examples (or as many real tokens) per optimizer step, "
          f"lr {LR}, seed {SEED}, 2 threads, {RUNTIME}, load average {os.getloadavg()[0]:.1f}")
    print(table(results))


if __name__ == "__main__":
    main()
