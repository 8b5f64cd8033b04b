"""A Hugging Face Trainer script whose TrainingArguments come from its command line (HfArgumentParser),
as many users write it; no tokenpulse import. Its collator is slow (--collate-sleep): the data wait a
`dataloader` verdict names, which DataLoader workers (--dataloader_num_workers) take off the step."""
import time
from dataclasses import dataclass

from datasets import load_dataset
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DataCollatorForLanguageModeling,
    HfArgumentParser,
    Trainer,
    TrainingArguments,
)


@dataclass
class ScriptArgs:
    model: str
    data: str
    examples: int = 400
    collate_sleep: float = 0.0


script, training_args = HfArgumentParser((ScriptArgs, TrainingArguments)).parse_args_into_dataclasses()
tok = AutoTokenizer.from_pretrained(script.model)
if tok.pad_token is None:
    tok.pad_token = tok.eos_token
ds = load_dataset("json", data_files=script.data, split="train").select(range(script.examples))
ds = ds.map(lambda b: tok(b["text"], truncation=True, max_length=64), batched=True, batch_size=50,
            remove_columns=["text"])
model = AutoModelForCausalLM.from_pretrained(script.model)
collate_lm = DataCollatorForLanguageModeling(tok, mlm=False)


def slow_collator(features):
    time.sleep(script.collate_sleep)  # the test's slow input: tokenizing or augmenting per batch
    return collate_lm(features)


Trainer(model=model, args=training_args, train_dataset=ds, data_collator=slow_collator).train()
