"""Overhead of the zero-code instrumentation on a Hugging Face Trainer script.

The same plain Trainer script (no tokenpulse import: a tiny Llama from config, the demo texts,
dynamic padding, logging every step so the callback does all its work every step) runs in fresh
processes, alternately without and with the instrumentation (the startup hook on PYTHONPATH and an
event pipe this benchmark drains, as an agent would), in ABBA order so drift on a shared machine
hits both alike. Speed is measured inside the script by its own callback over the steps after a
warm-up, so process start and model loading are left out of both: wall-clock steps/s (the goal),
and CPU seconds per step of the whole process (all its threads: what the instrumentation adds),
which a busy shared machine disturbs far less than wall time.

    .venv/bin/python bench/instrument_overhead.py [--repeats 3] [--steps 80] [--device cpu|cuda]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tokenpulse.instrument import hook_dir  # noqa: E402
from worker.training.runtime import configure  # noqa: E402

# OMP_WAIT_POLICY=PASSIVE for both variants (children inherit it): busy-waiting OpenMP threads on a
# shared machine make step times swing by 10x, which would swamp the difference measured here.
configure()

SCRIPT = textwrap.dedent('''
    import json, sys, time
    import torch
    from datasets import Dataset
    from transformers import (AutoTokenizer, DataCollatorForLanguageModeling, LlamaConfig, LlamaForCausalLM,
                              Trainer, TrainerCallback, TrainingArguments)
    demo, steps, warmup, device, hidden, layers, batch = sys.argv[1], *map(int, sys.argv[2:4]), sys.argv[4], *map(int, sys.argv[5:8])
    torch.set_num_threads(int(sys.argv[9]))
    tok = AutoTokenizer.from_pretrained(demo)
    texts = [json.loads(l)["text"] for l in open(demo + "/demo.jsonl")]
    ds = Dataset.from_dict({"text": texts}).map(lambda b: tok(b["text"], truncation=True, max_length=128),
                                                 batched=True, remove_columns=["text"])
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=hidden * 4,
                                         num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
                                         num_key_value_heads=max(1, hidden // 64), max_position_embeddings=256))

    class Clock(TrainerCallback):
        t0 = c0 = None
        def on_step_end(self, args, state, control, **kw):
            if state.global_step == warmup:
                if device == "cuda":
                    torch.cuda.synchronize()
                Clock.t0, Clock.c0 = time.perf_counter(), time.process_time()
        def on_train_end(self, args, state, control, **kw):
            if device == "cuda":
                torch.cuda.synchronize()
            n = state.global_step - warmup
            print("STEPS_PER_S", n / (time.perf_counter() - Clock.t0), (time.process_time() - Clock.c0) / n, flush=True)

    args = TrainingArguments(output_dir=sys.argv[8], max_steps=steps, per_device_train_batch_size=batch,
                             learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[],
                             use_cpu=device == "cpu", dataloader_num_workers=0, seed=0, disable_tqdm=True,
                             bf16=device == "cuda")
    Trainer(model=model, args=args, train_dataset=ds, data_collator=DataCollatorForLanguageModeling(tok, mlm=False),
            callbacks=[Clock()]).train()
''')


def run_once(script: Path, out: Path, instrumented: bool, a) -> tuple[float, float, int]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENPULSE_")}
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", HF_DATASETS_CACHE=str(out / "hf"))
    path = [str(ROOT)] + ([hook_dir()] if instrumented else [])
    env["PYTHONPATH"] = os.pathsep.join(reversed(path))
    events = [0]
    fds: tuple = ()
    if instrumented:
        r, w = os.pipe()
        env["TOKENPULSE_EVENT_FD"] = str(w)
        fds = (w,)

        def drain():
            with os.fdopen(r, "rb") as f:
                for _ in f:
                    events[0] += 1
        reader = threading.Thread(target=drain, daemon=True)
        reader.start()
    argv = [sys.executable, str(script), str(ROOT / "tokenpulse" / "demo"), str(a.steps), str(a.warmup), a.device,
            str(a.hidden), str(a.layers), str(a.batch), str(out / "trainer"), str(a.threads)]
    p = subprocess.run(argv, env=env, pass_fds=fds, capture_output=True, text=True)
    if instrumented:
        os.close(w)
        reader.join(30)
    if p.returncode != 0:
        raise SystemExit(f"script failed:\n{p.stderr[-3000:]}")
    line = next(x for x in p.stdout.splitlines() if x.startswith("STEPS_PER_S"))
    return float(line.split()[1]), float(line.split()[2]), events[0]


def callback_cost_us(steps: int = 2000) -> float:
    """CPU microseconds the instrumentation spends per training step, measured in this process
    (token counting of one micro-batch, on_step_end, a full on_log with its metrics and phase
    events written to /dev/null): a figure a busy machine barely disturbs."""
    import time

    import torch
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from tokenpulse.events import Emitter
    from tokenpulse.integrations import TokenPulseCallback
    with tempfile.TemporaryDirectory() as tmp:
        em = Emitter(fd=os.open(os.devnull, os.O_WRONLY), alive_every=0, from_env=False)
        cb = TokenPulseCallback(reporter=em)
        args = TrainingArguments(output_dir=tmp, report_to=[], use_cpu=True)
        state, control = TrainerState(), TrainerControl()
        state.max_steps, state.is_world_process_zero = 10 ** 6, True
        cb.on_train_begin(args, state, control)
        batch = {"input_ids": torch.ones(8, 128, dtype=torch.long), "attention_mask": torch.ones(8, 128, dtype=torch.long)}
        logs = {"loss": 1.0, "grad_norm": 0.5, "learning_rate": 1e-3, "epoch": 0.1}
        c0 = time.process_time()
        for i in range(steps):
            state.global_step = i + 1
            cb.count_batch(batch)
            cb.on_step_end(args, state, control)
            cb.on_log(args, state, control, logs=dict(logs))
        return (time.process_time() - c0) / steps * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3, help="pairs of runs (ABBA order)")
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a shared machine)")
    ap.add_argument("--json", help="also write the results here")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        script = tmp / "trainer_script.py"
        script.write_text(SCRIPT)
        runs: dict[bool, list[float]] = {False: [], True: []}
        cpu: dict[bool, list[float]] = {False: [], True: []}
        events = []
        for i in range(a.repeats):
            for instrumented in ((False, True) if i % 2 == 0 else (True, False)):
                sps, cps, n = run_once(script, tmp, instrumented, a)
                runs[instrumented].append(sps)
                cpu[instrumented].append(cps * 1000)
                if instrumented:
                    events.append(n)
                print(f"  pair {i + 1} {'with' if instrumented else 'without'} instrumentation: {sps:.2f} steps/s, "
                      f"{cps * 1000:.1f} CPU ms/step", flush=True)
    med = statistics.median
    ratio = med(runs[True]) / med(runs[False])
    cpu_ratio = med(cpu[True]) / med(cpu[False])
    fmt = lambda xs, f: ", ".join(f.format(x) for x in xs)  # noqa: E731
    print()
    print(f"Trainer script, tiny Llama (hidden {a.hidden}, {a.layers} layers), batch {a.batch}, {a.device}, "
          f"{a.threads} torch thread(s), {a.steps} steps ({a.warmup} warm-up), logging every step, "
          f"{a.repeats} interleaved pairs")
    print("| | steps/s (median) | CPU ms/step (median) | steps/s, all runs | CPU ms/step, all runs |")
    print("|---|---|---|---|---|")
    for k, label in ((False, "without instrumentation"), (True, "with instrumentation")):
        print(f"| {label} | {med(runs[k]):.2f} | {med(cpu[k]):.1f} | {fmt(runs[k], '{:.2f}')} | {fmt(cpu[k], '{:.1f}')} |")
    print(f"| with / without | {ratio:.3f} ({(1 - ratio) * 100:+.1f}% steps/s) | {cpu_ratio:.3f} "
          f"({(cpu_ratio - 1) * 100:+.1f}% CPU per step) | goal: at most 2% slower | |")
    print(f"events per instrumented run: {', '.join(map(str, events))}")
    cost = callback_cost_us()
    print(f"instrumentation CPU per step, measured in-process: {cost:.0f} us "
          f"({cost / 10 / med(cpu[False]):.2f}% of this script's {med(cpu[False]):.1f} ms step)")
    if a.json:
        Path(a.json).write_text(json.dumps({"without": runs[False], "with": runs[True], "ratio": ratio,
                                            "cpu_ms_without": cpu[False], "cpu_ms_with": cpu[True],
                                            "cpu_ratio": cpu_ratio, "callback_cpu_us_per_step": cost, "events": events, "args": vars(a)}, indent=1))


if __name__ == "__main__":
    main()
