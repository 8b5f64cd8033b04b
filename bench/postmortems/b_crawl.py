"""Case b, as the user wrote it: a TRL SFT script with packing, 32 rows x 1024 tokens a step, 8
DataLoader workers on a 2-core machine, the model forced to the CPU: minutes a step, and the script
logs every 10 steps. --fixed: 8 rows with 2 accumulation steps, 2 workers."""
import argparse

from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import SFTConfig, SFTTrainer

p = argparse.ArgumentParser()
p.add_argument("--model", required=True)
p.add_argument("--data", required=True)
p.add_argument("--out", required=True)
p.add_argument("--max-steps", type=int, default=2000)
p.add_argument("--max-length", type=int, default=1024)
p.add_argument("--batch", type=int, default=32)
p.add_argument("--workers", type=int, default=8)
p.add_argument("--fixed", action="store_true")
args = p.parse_args()

tok = AutoTokenizer.from_pretrained(args.model)
ds = load_dataset("json", data_files=args.data, split="train")
model = AutoModelForCausalLM.from_pretrained(args.model).to("cpu")
config = SFTConfig(
    output_dir=args.out, max_length=args.max_length, packing=True, max_steps=args.max_steps,
    per_device_train_batch_size=args.batch // 4 if args.fixed else args.batch,
    gradient_accumulation_steps=2 if args.fixed else 1,
    dataloader_num_workers=2 if args.fixed else args.workers,
    logging_steps=10, save_strategy="no", report_to=[], use_cpu=True, learning_rate=5e-4)
trainer = SFTTrainer(model=model, args=config, train_dataset=ds, processing_class=tok)
trainer.train()
