"""Overhead of the zero-code instrumentation with everything on, on a plain PyTorch loop and on a
Hugging Face Trainer script, measured side by side in one run.

Two scripts that never import tokenpulse, each with a tiny Llama from config and the demo texts:
- `loop`: a plain PyTorch loop (a DataLoader whose collate function calls the tokenizer, a tqdm bar,
  AdamW): the startup hook's optimizer-step hook, the model's forward pre-hook (tokens, padding),
  the DataLoader's timed `__next__`, the tqdm patch and the tokenizer hooks (firststeps.py) all run;
- `trainer`: a Trainer with its tqdm bar and logging every step (the callback does all its work
  every step), tokenized with the tokenizer (the hooks see those calls too);
- `gpt`: a GPT-style loop (its own get_batch, the model called with positional ids `model(X, labels=Y)`,
  two accumulation micro-batches a step, no tokenizer): the loss read from its `.backward()` calls
  and the tokens from its positional ids (backward.py, patch_torch.py) are all it adds.
Each runs in fresh processes, alternately without and with the instrumentation (the startup hook on
PYTHONPATH and an event pipe this benchmark drains, as an agent would), in ABBA order so drift on a
shared machine hits both alike. Each script times its own steps after a warm-up (process start and
model loading are left out): the median step time is the figure (one descheduled step does not move
it), with the CPU seconds per step of the whole process (all its threads: what the instrumentation
adds). Then the instrumentation's own work per step, measured in-process on the same hooks with a
real model (a figure a busy machine barely disturbs).

    .venv/bin/python bench/instrument_overhead.py [--repeats 3] [--steps 80] [--scripts loop,trainer]
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

COMMON = '''
    import json, sys, time
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    demo, out, threads = sys.argv[1], sys.argv[7], int(sys.argv[8])
    steps, warmup, hidden, layers, batch = map(int, sys.argv[2:7])
    torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(demo)
    texts = [json.loads(l)["text"] for l in open(demo + "/demo.jsonl")]
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=hidden * 4,
                                         num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
                                         num_key_value_heads=max(1, hidden // 64), max_position_embeddings=256))
    ends = []  # each step's end (perf_counter), and the process's CPU time at the warm-up's end

    def done(step):
        ends.append(time.perf_counter())
        if step == warmup:
            done.c0 = time.process_time()

    def report():
        dts = [b - a for a, b in zip(ends[warmup - 1:], ends[warmup:])]
        print("STEPS", json.dumps({"step_s": dts, "cpu_s": (time.process_time() - done.c0) / len(dts)}), flush=True)
'''

SCRIPTS = {
    # a plain PyTorch loop: tokenizing collate, tqdm bar, AdamW, no Trainer, no tokenpulse
    "loop": COMMON + '''
    from torch.utils.data import DataLoader
    from tqdm import tqdm
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    tok.pad_token_id = pad

    def collate(xs):
        b = tok(xs, padding=True, truncation=True, max_length=128, return_tensors="pt")
        b["labels"] = b["input_ids"].masked_fill(b["attention_mask"] == 0, -100)
        return b
    loader = DataLoader(texts, batch_size=batch, shuffle=True, collate_fn=collate)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    it, step = iter(loader), 0
    for step in tqdm(range(1, steps + 1), desc="train"):
        try:
            b = next(it)
        except StopIteration:
            it = iter(loader)
            b = next(it)
        model(**b).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        done(step)
    report()
''',
    # a GPT-style loop: get_batch, positional ids, gradient accumulation; loss and tokens read by tokenpulse
    "gpt": COMMON + '''
    data = torch.tensor([t for x in texts for t in tok(x)["input_ids"]])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def get_batch():
        ix = torch.randint(len(data) - 65, (batch,))
        x = torch.stack([data[i:i + 64] for i in ix])
        return x, x.clone()
    for step in range(1, steps + 1):
        for micro in range(2):
            X, Y = get_batch()
            loss = model(X, labels=Y).loss / 2
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        done(step)
    report()
''',
    # a Trainer script: its tqdm bar, logging every step, dynamic padding
    "trainer": COMMON + '''
    from datasets import Dataset
    from transformers import DataCollatorForLanguageModeling, Trainer, TrainerCallback, TrainingArguments
    ds = Dataset.from_dict({"text": texts}).map(lambda b: tok(b["text"], truncation=True, max_length=128),
                                                 batched=True, remove_columns=["text"])

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            done(state.global_step)

        def on_train_end(self, args, state, control, **kw):
            report()

    args = TrainingArguments(output_dir=out, max_steps=steps, per_device_train_batch_size=batch,
                             learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[],
                             use_cpu=True, dataloader_num_workers=0, seed=0, disable_tqdm=False)
    Trainer(model=model, args=args, train_dataset=ds, data_collator=DataCollatorForLanguageModeling(tok, mlm=False),
            callbacks=[Clock()]).train()
''',
}


def run_once(script: Path, out: Path, instrumented: bool, a) -> tuple[float, float, int]:
    """(median step seconds, CPU seconds per step, events sent) of one fresh process."""
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
    argv = [sys.executable, str(script), str(ROOT / "tokenpulse" / "demo"), str(a.steps), str(a.warmup),
            str(a.hidden), str(a.layers), str(a.batch), str(out / "trainer"), str(a.threads)]
    p = subprocess.run(argv, env=env, pass_fds=fds, capture_output=True, text=True)
    if instrumented:
        os.close(w)
        reader.join(30)
    if p.returncode != 0:
        raise SystemExit(f"{script.name} failed:\n{p.stderr[-3000:]}")
    got = json.loads(next(x for x in p.stdout.splitlines() if x.startswith("STEPS"))[len("STEPS"):])
    return statistics.median(got["step_s"]), got["cpu_s"], events[0]


def hook_cost_us(steps: int = 300, hidden: int = 64) -> dict:
    """CPU microseconds per training step that the plain loop's hooks cost, in this process: the same
    loop (a DataLoader, a real tiny model's forward/backward, AdamW) timed without and then with
    patch_torch's hooks installed (timed __next__, the optimizer-step hook with its phase and anatomy
    events written to /dev/null, the model's forward pre-hook counting tokens), best of 5 rounds each,
    plus each hook alone timed on its own (what a bigger model's step leaves unchanged)."""
    import time

    import torch
    import torch._tensor as ttensor
    import torch.nn.modules.module as tmm
    import torch.optim.optimizer as topt
    import torch.utils.data.dataloader as tdl

    from tokenpulse import run
    from tokenpulse.events import Emitter
    from tokenpulse.instrument import backward as bw, patch_torch as pt

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(512, hidden), torch.nn.Linear(hidden, 512))

    class Wrap(torch.nn.Module):  # takes the batch dict as a Hugging Face model does
        def __init__(self):
            super().__init__()
            self.m = model

        def forward(self, input_ids, attention_mask=None):
            return self.m(input_ids).float().logsumexp(-1).mean()
    net = Wrap()
    data = [{"input_ids": torch.randint(0, 512, (32,)), "attention_mask": torch.ones(32, dtype=torch.long)}
            for _ in range(64)]
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)

    def loop(n: int) -> float:
        c0, k = time.process_time(), 0
        while k < n:
            for b in loader:
                net(**b).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                k += 1
                if k >= n:
                    break
        return (time.process_time() - c0) / n * 1e6

    loop(30)
    bare = min(loop(steps) for _ in range(5))
    saved = run._reporter
    run._reporter = Emitter(fd=os.open(os.devnull, os.O_WRONLY), alive_every=0, from_env=False)
    try:
        pt.install_dataloader(tdl)
        pt.install_optimizer(topt)
        pt.install_forward(tmm)
        bw.install_tensor(ttensor)
        loop(30)
        hooked = min(loop(steps) for _ in range(5))
        # each hook alone, many calls: the figure a bigger model's step does not change
        c0 = time.process_time()
        for _ in range(20000):
            pt.STATE.data_s += time.perf_counter() - time.perf_counter()  # what the timed __next__ adds
        nxt = (time.process_time() - c0) / 20000 * 1e6
        c0 = time.process_time()
        for _ in range(5000):
            pt._after_step(opt, (), {})
        step_hook = (time.process_time() - c0) / 5000 * 1e6
        b = data[0]
        c0 = time.process_time()
        for _ in range(5000):
            pt._model_forward(net, (), b)
        fwd = (time.process_time() - c0) / 5000 * 1e6
        # the loss capture of one step with two micro-batches, and its read once every 100 steps
        loss = net(**b)
        c0 = time.process_time()
        for i in range(5000):
            bw._seen(loss, (), {})
            bw._seen(loss, (), {})
            bw.step_done(i)
            if i % 100 == 99:
                bw.flush(run._reporter)
        loss_us = (time.process_time() - c0) / 5000 * 1e6
        ids = torch.randint(0, 512, (4, 32))
        c0 = time.process_time()
        for _ in range(5000):
            pt._model_forward(net, (ids, ids), {})  # positional ids: model(X, Y)
        pos = (time.process_time() - c0) / 5000 * 1e6
        pt.STATE.real.clear()
    finally:
        run._reporter = saved
    return {"bare_us": bare, "hooked_us": hooked, "next_us": nxt, "step_hook_us": step_hook, "forward_hook_us": fwd,
            "loss_us": loss_us, "positional_tokens_us": pos}


def callback_cost_us(steps: int = 2000) -> float:
    """CPU microseconds the Trainer callback spends per training step, measured in this process
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
        batch = {"input_ids": torch.ones(8, 128, dtype=torch.long),
                 "attention_mask": torch.ones(8, 128, dtype=torch.long)}
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
    ap.add_argument("--repeats", type=int, default=3, help="pairs of runs per script (ABBA order)")
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a shared machine)")
    ap.add_argument("--scripts", default="loop,trainer,gpt", help="which scripts: loop, trainer, gpt")
    ap.add_argument("--json", help="also write the results here")
    a = ap.parse_args()
    names = [n for n in a.scripts.split(",") if n]
    bad = [n for n in names if n not in SCRIPTS]
    if bad:
        raise SystemExit(f"--scripts: unknown script(s) {bad}; choose from {sorted(SCRIPTS)}")
    med = statistics.median
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        paths = {}
        for n in names:
            paths[n] = tmp / f"{n}_script.py"
            paths[n].write_text(textwrap.dedent(SCRIPTS[n]))
            results[n] = {"step_s": {False: [], True: []}, "cpu_s": {False: [], True: []}, "events": []}
        for i in range(a.repeats):  # the scripts interleaved too: drift hits every column alike
            for n in names:
                for instrumented in ((False, True) if i % 2 == 0 else (True, False)):
                    step_s, cpu_s, ev = run_once(paths[n], tmp, instrumented, a)
                    r = results[n]
                    r["step_s"][instrumented].append(step_s)
                    r["cpu_s"][instrumented].append(cpu_s)
                    if instrumented:
                        r["events"].append(ev)
                    print(f"  {n} pair {i + 1} {'with' if instrumented else 'without'}: median step "
                          f"{step_s * 1000:.1f} ms, {cpu_s * 1000:.1f} CPU ms/step", flush=True)
    fmt = lambda xs: ", ".join(f"{x * 1000:.1f}" for x in xs)  # noqa: E731
    print()
    print(f"tiny Llama (hidden {a.hidden}, {a.layers} layers), batch {a.batch}, cpu, {a.threads} torch thread(s), "
          f"{a.steps} steps ({a.warmup} warm-up), {a.repeats} interleaved pairs per script, everything on")
    print("| script | median step, without | median step, with | with / without | CPU ms/step without / with "
          "| step ms, all runs (without; with) | events per run |")
    print("|---|---|---|---|---|---|---|")
    for n in names:
        r = results[n]
        s0, s1 = med(r["step_s"][False]), med(r["step_s"][True])
        c0, c1 = med(r["cpu_s"][False]), med(r["cpu_s"][True])
        r["ratio"], r["cpu_ratio"] = s1 / s0, c1 / c0
        print(f"| {n} | {s0 * 1000:.1f} ms | {s1 * 1000:.1f} ms | {s1 / s0:.3f} ({(s1 / s0 - 1) * 100:+.1f}%) | "
              f"{c0 * 1000:.1f} / {c1 * 1000:.1f} ({(c1 / c0 - 1) * 100:+.1f}%) | {fmt(r['step_s'][False])}; "
              f"{fmt(r['step_s'][True])} | {', '.join(map(str, r['events']))} |")
    print("goal: at most 1% longer steps")
    base = {n: med(results[n]["cpu_s"][False]) * 1e6 for n in names}
    hk = hook_cost_us()
    added = hk["hooked_us"] - hk["bare_us"]
    print(f"plain-loop hooks in-process (timed DataLoader __next__, optimizer-step hook with its events, forward "
          f"pre-hook): {hk['bare_us']:.0f} -> {hk['hooked_us']:.0f} CPU us per step of a tiny model "
          f"({added:+.0f} us); alone: __next__ timing {hk['next_us']:.2f} us, step hook {hk['step_hook_us']:.1f} us, "
          f"forward hook {hk['forward_hook_us']:.1f} us"
          + (f" = {(hk['next_us'] + hk['step_hook_us'] + hk['forward_hook_us']) / base['loop'] * 100:.3f}% of the "
             f"loop script's {base['loop'] / 1000:.1f} ms step" if "loop" in base else ""))
    if "gpt" in base:
        both = 2 * hk["positional_tokens_us"] + hk["loss_us"] + hk["step_hook_us"]
        print(f"loss capture (2 micro-batches' .backward(), one read per 100 steps) {hk['loss_us']:.1f} us + token "
              f"counting from positional ids {hk['positional_tokens_us']:.1f} us x 2 + step hook "
              f"{hk['step_hook_us']:.1f} us = {both / base['gpt'] * 100:.3f}% of the gpt script's "
              f"{base['gpt'] / 1000:.1f} ms step (goal: at most 1%)")
    cost = callback_cost_us()
    print(f"Trainer callback in-process, logging every step: {cost:.0f} us per step"
          + (f" = {cost / base['trainer'] * 100:.2f}% of the Trainer script's {base['trainer'] / 1000:.1f} ms step"
             if "trainer" in base else ""))
    if a.json:
        out = {n: {"step_s_without": r["step_s"][False], "step_s_with": r["step_s"][True], "ratio": r["ratio"],
                   "cpu_s_without": r["cpu_s"][False], "cpu_s_with": r["cpu_s"][True], "cpu_ratio": r["cpu_ratio"],
                   "events": r["events"]} for n, r in results.items()}
        Path(a.json).write_text(json.dumps({"scripts": out, "hooks_us": hk, "callback_cpu_us_per_step": cost,
                                            "args": vars(a)}, indent=1))


if __name__ == "__main__":
    main()
