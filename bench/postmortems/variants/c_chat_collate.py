"""Case c, another user's way: a `messages` dataset rendered through a chat template inside a custom
collate_fn that calls tokenizer(..., padding="max_length", max_length=2048) on every batch, in a
Trainer; the longest conversation has about 1,500 tokens. --fixed: padding=True, max_length=1536,
similar lengths grouped."""
import argparse

from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments

p = argparse.ArgumentParser()
p.add_argument("--model", required=True)
p.add_argument("--data", required=True)
p.add_argument("--out", required=True)
p.add_argument("--max-steps", type=int, default=200)
p.add_argument("--max-length", type=int, default=2048)
p.add_argument("--fixed-length", type=int, default=1536)
p.add_argument("--fixed", action="store_true")
args = p.parse_args()

tok = AutoTokenizer.from_pretrained(args.model)
tok.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}")
raw = load_dataset("json", data_files=args.data, split="train")
chats = raw.map(lambda r: {"messages": [{"role": "user", "content": "Tell me something."},
                                        {"role": "assistant", "content": r["text"]}]}, remove_columns=["text"])


def collate(rows):
    texts = [tok.apply_chat_template(r["messages"], tokenize=False) for r in rows]
    if args.fixed:
        batch = tok(texts, padding=True, truncation=True, max_length=args.fixed_length, return_tensors="pt")
    else:
        batch = tok(texts, padding="max_length", truncation=True, max_length=args.max_length, return_tensors="pt")
    batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    return batch


model = AutoModelForCausalLM.from_pretrained(args.model)
targs = TrainingArguments(output_dir=args.out, per_device_train_batch_size=2, gradient_accumulation_steps=4,
                          max_steps=args.max_steps, learning_rate=5e-4, logging_steps=10, save_strategy="no",
                          report_to="none", use_cpu=True, remove_unused_columns=False)
Trainer(model=model, args=targs, train_dataset=chats, data_collator=collate).train()
