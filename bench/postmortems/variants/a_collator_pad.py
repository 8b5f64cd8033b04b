"""Case a, another user's way: the texts are tokenized without padding, and the data collator pads
every batch to max_length (DataCollatorWithPadding(padding="max_length", max_length=1024)) on texts
of at most 67 tokens. --fixed: the collator pads each batch to its longest."""
import argparse

from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorWithPadding, Trainer, TrainingArguments

p = argparse.ArgumentParser()
p.add_argument("--model", required=True)
p.add_argument("--data", required=True)
p.add_argument("--out", required=True)
p.add_argument("--max-steps", type=int, default=300)
p.add_argument("--max-length", type=int, default=1024)
p.add_argument("--fixed", action="store_true")
args = p.parse_args()

tok = AutoTokenizer.from_pretrained(args.model)
data = load_dataset("json", data_files=args.data)["train"]
data = data.map(lambda b: tok(b["text"], truncation=True, max_length=args.max_length), batched=True,
                remove_columns=["text"])
data = data.map(lambda b: {"labels": b["input_ids"]}, batched=True)
if args.fixed:
    collator = DataCollatorWithPadding(tok)
else:
    collator = DataCollatorWithPadding(tok, padding="max_length", max_length=args.max_length)


def collate(features):
    batch = collator([{k: f[k] for k in ("input_ids", "attention_mask")} for f in features])
    labels = batch["input_ids"].clone()
    labels[batch["attention_mask"] == 0] = -100
    batch["labels"] = labels
    return batch


model = AutoModelForCausalLM.from_pretrained(args.model)
trainer = Trainer(model=model, train_dataset=data, data_collator=collate,
                  args=TrainingArguments(output_dir=args.out, per_device_train_batch_size=8, max_steps=args.max_steps,
                                         learning_rate=5e-4, logging_steps=25, save_strategy="no", report_to="none",
                                         use_cpu=True, remove_unused_columns=False))
trainer.train()
