"""Case 4 of bench/fixes.py, as a user writes it: a Trainer script whose dataset tokenizes each example
when it is read (a slow tokenizer: normalisation and a lookup, modelled by a fixed per-example delay),
with `--dataloader_num_workers 0`, so each step waits for its batch. Arguments are TrainingArguments'
own flags (HfArgumentParser), as many training scripts take them."""
import json
import time
from dataclasses import dataclass

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DataCollatorForLanguageModeling,
    HfArgumentParser,
    Trainer,
    TrainingArguments,
)


@dataclass
class Data:
    model: str
    data: str
    read_ms: float = 12.0  # per example: what makes this dataset slow to read


class TokenizeOnRead(torch.utils.data.Dataset):
    def __init__(self, path: str, tok, read_ms: float):
        with open(path) as f:
            self.texts = [json.loads(line)["text"] for line in f if line.strip()]
        self.tok, self.read_s = tok, read_ms / 1000

    def __len__(self):
        return len(self.texts)

    def __getitem__(self, i):
        time.sleep(self.read_s)
        return self.tok(self.texts[i], truncation=True, max_length=128)


d, args = HfArgumentParser((Data, TrainingArguments)).parse_args_into_dataclasses()
tok = AutoTokenizer.from_pretrained(d.model)
model = AutoModelForCausalLM.from_pretrained(d.model)
trainer = Trainer(model=model, args=args, train_dataset=TokenizeOnRead(d.data, tok, d.read_ms),
                  data_collator=DataCollatorForLanguageModeling(tok, mlm=False))
trainer.train()
print("done", flush=True)
