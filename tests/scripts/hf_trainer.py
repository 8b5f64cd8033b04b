"""A plain Hugging Face Trainer script, as a user would write it: no tokenpulse import.

The tests run it as a command job's process; the zero-code hook must make it report. Options only
make the tests' situations: a slow step (pause while training), a step that blocks forever.
"""
import argparse
import os
import time

from datasets import load_dataset
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DataCollatorForLanguageModeling,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

p = argparse.ArgumentParser()
p.add_argument("--model", required=True)
p.add_argument("--data", required=True)
p.add_argument("--out", required=True)
p.add_argument("--max-steps", type=int, default=12)
p.add_argument("--examples", type=int, default=200)
p.add_argument("--eval-steps", type=int, default=0)
p.add_argument("--save-steps", type=int, default=0)
p.add_argument("--step-sleep", type=float, default=0.0)
p.add_argument("--block-at-step", type=int, default=-1)
p.add_argument("--report-to", default="none", help="the Trainer's own reporting: tensorboard, wandb...")
p.add_argument("--collator-block-at", type=int, default=-1, help="the collator never returns from this call on")
args = p.parse_args()


class Pace(TrainerCallback):
    """Test-only pacing: slow steps, or one that never returns."""

    def on_step_end(self, a, state, control, **kw):
        if state.global_step == args.block_at_step:
            while True:
                time.sleep(3600)
        if args.step_sleep:
            time.sleep(args.step_sleep)


tok = AutoTokenizer.from_pretrained(args.model)
if tok.pad_token is None:
    tok.pad_token = tok.eos_token
ds = load_dataset("json", data_files=args.data, split="train").select(range(args.examples))
ds = ds.map(lambda b: tok(b["text"], truncation=True, max_length=64), batched=True, batch_size=20,
            remove_columns=["text"])
split = ds.train_test_split(test_size=0.1, seed=0)
model = AutoModelForCausalLM.from_pretrained(args.model)
training_args = TrainingArguments(
    output_dir=args.out, max_steps=args.max_steps, per_device_train_batch_size=8, learning_rate=1e-3,
    logging_steps=1, eval_strategy="steps" if args.eval_steps else "no", eval_steps=args.eval_steps or None,
    per_device_eval_batch_size=8, save_strategy="steps" if args.save_steps else "no",
    save_steps=args.save_steps or None, report_to=args.report_to, use_cpu=True, dataloader_num_workers=0, seed=0)
collate_lm = DataCollatorForLanguageModeling(tok, mlm=False)
collated = [0]


def deadlocking_collator(features):
    """The test's deadlock: from its Nth call on, the collator waits for something that never comes."""
    collated[0] += 1
    if args.collator_block_at >= 0 and collated[0] >= args.collator_block_at and os.environ.get("FAULT_MARK"):
        with open(os.environ["FAULT_MARK"], "w") as f:  # the benchmark's clock: when the deadlock began
            f.write(str(time.time()))
    while args.collator_block_at >= 0 and collated[0] >= args.collator_block_at:
        time.sleep(1)
    return collate_lm(features)


trainer = Trainer(model=model, args=training_args, train_dataset=split["train"], eval_dataset=split["test"],
                  data_collator=deadlocking_collator, callbacks=[Pace()])
trainer.train()
trainer.save_model(args.out + "/final")
print(f"finished at step {trainer.state.global_step}", flush=True)
