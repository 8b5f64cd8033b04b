"""Case c, as the user wrote it: a Trainer script padding every example to 2048 when the longest has
1481 tokens, batch 2 x 4 accumulation, no DataLoader workers. --fixed: max_length=1488, padded per
batch, similar lengths grouped."""
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
p.add_argument("--max-steps", type=int, default=200)
p.add_argument("--max-length", type=int, default=2048)
p.add_argument("--fixed-length", type=int, default=1488)
p.add_argument("--fixed", action="store_true")
args = p.parse_args()

tok = AutoTokenizer.from_pretrained(args.model)
ds = load_dataset("json", data_files=args.data, split="train")


def tokenize(batch):
    if args.fixed:
        return tok(batch["text"], truncation=True, max_length=args.fixed_length)
    return tok(batch["text"], padding="max_length", truncation=True, max_length=args.max_length)


ds = ds.map(tokenize, batched=True, remove_columns=["text"])
model = AutoModelForCausalLM.from_pretrained(args.model)
training_args = TrainingArguments(
    output_dir=args.out, per_device_train_batch_size=2, gradient_accumulation_steps=4, max_steps=args.max_steps,
    learning_rate=5e-4, logging_steps=10, save_strategy="no", report_to=[], use_cpu=True, dataloader_num_workers=0,
    **({"train_sampling_strategy": "group_by_length"} if args.fixed else {}))
Trainer(model=model, args=training_args, train_dataset=ds,
        data_collator=DataCollatorForLanguageModeling(tok, mlm=False)).train()
