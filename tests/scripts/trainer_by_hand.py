"""A Trainer script that adds tokenpulse's callback itself and is started by hand (no agent)."""
import json
import sys

import torch
from datasets import Dataset
from transformers import (
                                            AutoTokenizer,
                                            DataCollatorForLanguageModeling,
                                            LlamaConfig,
                                            LlamaForCausalLM,
                                            Trainer,
                                            TrainingArguments,
)

from tokenpulse.integrations import TokenPulseCallback

demo, out = sys.argv[1], sys.argv[2]
tok = AutoTokenizer.from_pretrained(demo)
texts = [json.loads(line)["text"] for line in open(f"{demo}/demo.jsonl")][:160]
ds = Dataset.from_dict({"text": texts}).map(lambda b: tok(b["text"], truncation=True, max_length=64),
                                            batched=True, remove_columns=["text"])
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=2, num_key_value_heads=2))
args = TrainingArguments(output_dir=out, max_steps=5, per_device_train_batch_size=8, logging_steps=1,
                         save_strategy="no", report_to=[], use_cpu=True)
Trainer(model=model, args=args, train_dataset=ds, data_collator=DataCollatorForLanguageModeling(tok, mlm=False),
        callbacks=[TokenPulseCallback()]).train()
