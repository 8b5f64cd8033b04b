"""Case a, as the user wrote it: a Trainer script that tokenizes with padding="max_length" to 1024
on texts of at most 67 tokens ("stuck at Training started"). --fixed: the collator pads per batch,
similar lengths grouped (the fix tokenpulse names)."""
import argparse

from datasets import load_dataset
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DataCollatorForLanguageModeling,
    Trainer,
    TrainingArguments,
)

p = argparse.ArgumentParser()
p.add_argument("--model", required=True)
p.add_argument("--data", required=True)
p.add_argument("--out", required=True)
p.add_argument("--max-steps", type=int, default=300)
p.add_argument("--max-length", type=int, default=1024)
p.add_argument("--fixed", action="store_true")
args = p.parse_args()

tok = AutoTokenizer.from_pretrained(args.model)
ds = load_dataset("json", data_files=args.data, split="train")


def tokenize(batch):
    if args.fixed:  # the fix: no padding here; the collator pads each batch to its longest
        return tok(batch["text"], truncation=True, max_length=args.max_length)
    return tok(batch["text"], padding="max_length", truncation=True, max_length=args.max_length)


ds = ds.map(tokenize, batched=True, remove_columns=["text"])
model = AutoModelForCausalLM.from_pretrained(args.model)
training_args = TrainingArguments(
    output_dir=args.out, per_device_train_batch_size=8, max_steps=args.max_steps, learning_rate=5e-4,
    logging_steps=30, save_strategy="no", report_to=[], use_cpu=True,
    **({"train_sampling_strategy": "group_by_length"} if args.fixed else {}))
trainer = Trainer(model=model, args=training_args, train_dataset=ds,
                  data_collator=DataCollatorForLanguageModeling(tok, mlm=False))
print("Training started", flush=True)
trainer.train()
