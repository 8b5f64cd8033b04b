"""Case d, another user's way: TRL's SFTTrainer on a `messages` dataset (texts turned into
conversations), with TRL's own tokenization through a chat template and its truncation at
max_length=1024, examples of 400-1400 tokens. --fixed: a max_length that keeps them."""
import argparse

from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import SFTConfig, SFTTrainer

p = argparse.ArgumentParser()
p.add_argument("--model", required=True)
p.add_argument("--data", required=True)
p.add_argument("--out", required=True)
p.add_argument("--max-steps", type=int, default=100)
p.add_argument("--max-length", type=int, default=1024)
p.add_argument("--fixed-length", type=int, default=1440)
p.add_argument("--fixed", action="store_true")
args = p.parse_args()

tok = AutoTokenizer.from_pretrained(args.model)
tok.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}")
ds = load_dataset("json", data_files=args.data, split="train")
ds = ds.map(lambda r: {"messages": [{"role": "user", "content": "Write."},
                                    {"role": "assistant", "content": r["text"]}]}, remove_columns=["text"])
model = AutoModelForCausalLM.from_pretrained(args.model)
cfg = SFTConfig(output_dir=args.out, max_length=args.fixed_length if args.fixed else args.max_length,
                per_device_train_batch_size=4, max_steps=args.max_steps, logging_steps=10, save_strategy="no",
                report_to="none", use_cpu=True, learning_rate=1e-3)
SFTTrainer(model=model, args=cfg, train_dataset=ds, processing_class=tok).train()
