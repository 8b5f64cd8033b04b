"""bf16 MFU and real tokens/s on one GPU: tokenpulse's own training against a plain hand-written loop.

One Hugging Face causal LM built from a config (no download): by default a Qwen2 shaped like
Qwen2.5-0.5B (hidden 896, 24 layers, 14 query / 2 key-value heads, MLP 4864, vocab 151,936: ~494M
parameters), random weights saved once as a model directory with the demo tokenizer. The same data
(variable-length examples, mean ~1/4 of the row length) and the same tokens per optimizer step in
every case:

  tokenpulse, packed    `python -m worker.training.train --spec S --out D`, the real training process
                        (padding=pack; its events read from TOKENPULSE_EVENT_PATH)
  tokenpulse, padded    the same, padding=dynamic (each micro-batch padded to its longest example)
  plain loop, packed    a hand-written loop in this process: examples packed into rows, position_ids
                        restarting per example (padding-free), bf16 autocast, fused AdamW
  plain loop, padded    the same loop over micro-batches padded to their longest example

Real tokens/s counts non-pad tokens only, after the warm-up steps. MFU = real tokens/s x FLOPs per
token (6N + attention over the example's own context, worker/training/modeling.flops_per_token, the
same for every row) / one peak for every row: the GPU's datasheet bf16 dense peak where known, else a
large bf16 matmul measured here. "tp's MFU" is what tokenpulse itself reports (against its own
measured peak).

    .venv/bin/python bench/gpu.py                 # a GPU: the 0.5B model, ~5 min on an H200
    .venv/bin/python bench/gpu.py --smoke         # CPU, a tiny model, fp32: that it runs (tests/test_gpu_bench.py)
    options: --steps N --seq L --work DIR --json OUT --cases tp-pack,tp-pad,plain-pack,plain-pad
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from worker.training.runtime import configure  # noqa: E402

configure()  # the worker's CPU runtime defaults, before torch loads (children inherit them)

DEMO = ROOT / "tokenpulse" / "demo"
CASES = ("tp-pack", "tp-pad", "plain-pack", "plain-pad")
# bf16 dense tensor-core peaks (FLOP/s) of the GPUs this is meant for (the datasheets' SXM figures)
DATASHEET_BF16 = {"H200": 989.4e12, "H100": 989.4e12, "A100": 312e12, "L40S": 362e12, "B200": 2250e12}
QWEN_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, tie_word_embeddings=True)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=2048, max_position_embeddings=1024, tie_word_embeddings=True)


def settings(smoke: bool, steps: int | None, seq: int | None) -> dict:
    """Sizes: rows of `seq` tokens, `rows` of them per micro-batch (packed), the same real tokens per
    step padded (`examples` per micro-batch); `warmup` steps not timed."""
    if smoke:
        s = dict(model=TINY, seq=seq or 128, rows=2, steps=steps or 6, warmup=2, precision="fp32", device="cpu")
    else:
        s = dict(model=QWEN_05B, seq=seq or 2048, rows=8, steps=steps or 40, warmup=8, precision="bf16",
                 device="cuda")
    s["mean_len"] = s["seq"] // 4  # examples of ~1/4 row on average: packing matters, padding wastes
    s["examples"] = s["rows"] * s["seq"] // s["mean_len"]  # per padded micro-batch: the same real tokens
    return s


# ---- the model and the data, built once per work dir --------------------------------------------

def build(work: Path, s: dict) -> dict:
    import numpy as np
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM
    tag = f"{s['model']['hidden_size']}x{s['model']['num_hidden_layers']}-{s['seq']}"
    model_dir, data = work / f"model-{tag}", work / f"data-{tag}.jsonl"
    tok = AutoTokenizer.from_pretrained(str(DEMO))
    if not (model_dir / "config.json").exists():
        cfg = Qwen2Config(**s["model"], use_cache=False, pad_token_id=tok.pad_token_id,
                          eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id)
        torch.manual_seed(0)
        Qwen2ForCausalLM(cfg).save_pretrained(model_dir)
        tok.save_pretrained(model_dir)
    if not data.exists():
        words = " ".join(json.loads(line)["text"] for line in (DEMO / "demo.jsonl").open()).split()
        rng, n_tokens, rows = random.Random(0), 0, []
        need = s["rows"] * s["seq"] * (s["steps"] + 4)  # every case's steps, with room to spare
        while n_tokens < need:
            # lengths spread like real text: lognormal around the mean, cut at the row length
            n = int(min(s["seq"], max(8, rng.lognormvariate(0, 0.6) * s["mean_len"] * 0.84)))
            start = rng.randrange(len(words) - n)
            text = " ".join(words[start:start + n])
            rows.append(text)
            n_tokens += n
        data.write_text("".join(json.dumps({"text": t}) + "\n" for t in rows))
    lengths = np.array([len(tok(json.loads(line)["text"])["input_ids"]) + 1 for line in data.open()])
    return {"model": str(model_dir), "data": str(data),
            "mean_len": float(np.minimum(lengths, s["seq"]).mean())}


def flops_per_token(model_dir: str, mean_len: float) -> tuple[float, int]:
    """FLOPs per trained token and the parameter count, from the model (on the meta device: no memory)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from worker.training.modeling import flops_per_token as fpt
    cfg = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    return fpt(model, cfg, mean_len), sum(p.numel() for p in model.parameters())


def peak(s: dict) -> tuple[float, str]:
    import torch
    if s["device"] == "cuda":
        name = torch.cuda.get_device_name(0)
        for key, value in DATASHEET_BF16.items():
            if key in name:
                return value, f"{name}: datasheet bf16 dense"
    from worker.training.precision import measure_peak_flops
    dtype = torch.bfloat16 if s["precision"] == "bf16" else torch.float32
    device = torch.device(s["device"])
    return measure_peak_flops(dtype, device), f"{s['device']}: a large {s['precision']} matmul measured here"


# ---- tokenpulse: the real training process ---------------------------------------------------------

def run_tokenpulse(case: str, built: dict, s: dict, work: Path) -> dict:
    from tokenpulse.protocol import JobSpec
    pack = case == "tp-pack"
    spec = JobSpec(model=built["model"], dataset=built["data"], max_seq_length=s["seq"], max_steps=s["steps"],
                   padding="pack" if pack else "dynamic", batch_size=s["rows"] if pack else s["examples"],
                   grad_accum=1, precision=s["precision"], device=s["device"], seed=0, log_every=1,
                   learning_rate=1e-4, checkpoint_every=None, name=f"bench-{case}")
    out = work / f"out-{case}"
    spec_path = work / f"spec-{case}.json"
    spec_path.write_text(spec.model_dump_json())
    events = work / f"events-{case}.jsonl"
    events.write_bytes(b"")  # its events by path, as a distributed job's ranks write theirs (a regular file here)
    env = {**os.environ, "TOKENPULSE_EVENT_PATH": str(events), "PYTHONPATH": str(ROOT)}
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "worker.training.train", "--spec", str(spec_path), "--out", str(out),
                        "--cache-dir", str(work / "cache")], env=env, capture_output=True, text=True, timeout=900)
    wall = time.perf_counter() - t0
    lines = [json.loads(x) for x in events.read_text().splitlines() if x.strip()]
    state = next((e["data"] for e in reversed(lines) if e["kind"] == "state"), {})
    if r.returncode != 0 or state.get("state") != "completed":
        raise RuntimeError(f"{case}: exit {r.returncode}, {state}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    metrics = [(e["data"]["step"], e["data"]["values"]) for e in lines if e["kind"] == "metrics"]
    timed = [v for step, v in metrics if step > s["warmup"] and "tokens_per_s" in v]
    info: dict = {}
    for e in lines:
        if e["kind"] == "info":
            info.update(e["data"])
    return {"tokens_per_s": statistics.median(v["tokens_per_s"] for v in timed),
            "padding_frac": statistics.median(v.get("padding_frac", 0.0) for v in timed),
            "own_mfu": statistics.median(v["mfu"] for v in timed) if all("mfu" in v for v in timed) else None,
            "peak_mb": max((v.get("cuda_peak_mb") or v.get("rss_mb") or 0) for _, v in metrics),
            "padding": info.get("padding"), "loss_head": info.get("loss_head"), "wall_s": wall}


# ---- the plain hand-written loop -----------------------------------------------------------------

def micro_batches(built: dict, s: dict, packed: bool, tok) -> list[dict]:
    """The plain loop's micro-batches: examples packed into full rows with restarting position_ids (the
    first token of each example is not a target: nothing is predicted across a boundary), or examples
    padded to the longest of their micro-batch."""
    import torch
    ids = [tok(json.loads(line)["text"])["input_ids"][:s["seq"] - 1] + [tok.eos_token_id]
           for line in open(built["data"])]
    out = []
    if packed:  # one stream of examples cut into full rows (an example may continue in the next row)
        stream = [(tid, k, -100 if k == 0 else tid) for x in ids for k, tid in enumerate(x)]
        per = s["rows"] * s["seq"]
        for i in range(0, len(stream) - per + 1, per):
            chunk = torch.tensor(stream[i:i + per]).view(s["rows"], s["seq"], 3)
            out.append({"input_ids": chunk[..., 0], "position_ids": chunk[..., 1], "labels": chunk[..., 2],
                        "real": per})
    else:
        for i in range(0, len(ids) - s["examples"] + 1, s["examples"]):
            chunk = ids[i:i + s["examples"]]
            width = max(len(x) for x in chunk)
            out.append({"input_ids": torch.tensor([x + [tok.pad_token_id] * (width - len(x)) for x in chunk]),
                        "attention_mask": torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in chunk]),
                        "labels": torch.tensor([x + [-100] * (width - len(x)) for x in chunk]),
                        "real": sum(len(x) for x in chunk)})
    return out


def run_plain(case: str, built: dict, s: dict) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    device = torch.device(s["device"])
    tok = AutoTokenizer.from_pretrained(built["model"])
    batches = micro_batches(built, s, case == "plain-pack", tok)
    if len(batches) < s["steps"]:
        raise RuntimeError(f"{case}: {len(batches)} micro-batches for {s['steps']} steps")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(built["model"], dtype=torch.float32,
                                                 attn_implementation="sdpa").to(device)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=s["precision"] == "bf16")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0, real, padded = 0.0, 0, 0
    for step, b in enumerate(batches[:s["steps"]]):
        if step == s["warmup"]:
            sync()
            t0, real, padded = time.perf_counter(), 0, 0
        feed = {k: v.to(device, non_blocking=True) for k, v in b.items() if k != "real"}
        with amp:
            loss = model(**feed, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        real, padded = real + b["real"], padded + b["input_ids"].numel()
    sync()
    dt = time.perf_counter() - t0
    result = {"tokens_per_s": real / dt, "padding_frac": 1 - real / padded, "own_mfu": None,
              "peak_mb": torch.cuda.max_memory_allocated() / 2 ** 20 if device.type == "cuda" else None,
              "padding": "pack" if case == "plain-pack" else "dynamic", "loss_head": "eager", "wall_s": dt}
    del model, opt
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


# ---- the table ------------------------------------------------------------------------------------

def table(rows: dict, fpt: float, params: int, peak_flops: float, peak_src: str, s: dict) -> str:
    base = rows.get("plain-pack") or next(iter(rows.values()))
    lines = [f"model: Qwen2 {params / 1e6:,.1f}M parameters, rows of {s['seq']} tokens, {s['precision']}, "
             f"{s['steps']} steps ({s['warmup']} untimed); {fpt:.3g} FLOP per token; "
             f"peak {peak_flops:.3g} FLOP/s ({peak_src})",
             f"{'case':<12} {'padding':<8} {'real tok/s':>12} {'vs plain-pack':>13} {'MFU':>7} {'tp MFU':>7} "
             f"{'pad %':>6} {'peak MiB':>9} {'loss head':>9}"]
    for case, r in rows.items():
        mfu = r["tokens_per_s"] * fpt / peak_flops
        own = f"{r['own_mfu']:.1%}" if r.get("own_mfu") is not None else "-"
        lines.append(f"{case:<12} {str(r['padding']):<8} {r['tokens_per_s']:>12,.0f} "
                     f"{r['tokens_per_s'] / base['tokens_per_s']:>12.2f}x {mfu:>7.1%} {own:>7} "
                     f"{r['padding_frac']:>6.1%} {r['peak_mb'] or 0:>9,.0f} {str(r['loss_head']):>9}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="CPU, a tiny model, fp32, a few steps")
    ap.add_argument("--steps", type=int)
    ap.add_argument("--seq", type=int)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--work", type=Path, help="model, data and outputs (default: a temporary directory)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args(argv)
    s = settings(args.smoke, args.steps, args.seq)
    cases = [c for c in args.cases.split(",") if c]
    unknown = set(cases) - set(CASES)
    if unknown:
        ap.error(f"--cases: unknown {sorted(unknown)}; choose from {', '.join(CASES)}")
    with tempfile.TemporaryDirectory(prefix="tp-gpu-bench-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        built = build(work, s)
        print(f"built the model and data in {time.perf_counter() - t0:.0f} s: {built['model']}", flush=True)
        rows = {}
        for case in cases:  # tokenpulse first: this process holds no GPU memory while they run
            t = time.perf_counter()
            rows[case] = run_tokenpulse(case, built, s, work) if case.startswith("tp-") else run_plain(case, built, s)
            print(f"{case}: {rows[case]['tokens_per_s']:,.0f} real tokens/s ({time.perf_counter() - t:.0f} s)",
                  flush=True)
        fpt, params = flops_per_token(built["model"], built["mean_len"])
        peak_flops, peak_src = peak(s)
    print(table(rows, fpt, params, peak_flops, peak_src, s))
    if args.json:
        args.json.write_text(json.dumps({"settings": s, "flops_per_token": fpt, "params": params,
                                         "peak_flops": peak_flops, "peak": peak_src, "cases": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
