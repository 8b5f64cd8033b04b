"""Case d, as the user wrote it: a TRL SFT script (LoRA) with max_length 1024 on examples of
400-1400 tokens: about 37% of them are cut, silently. --fixed: a max_length that keeps them."""
import argparse

from datasets import load_dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import SFTConfig, SFTTrainer

p = argparse.ArgumentParser()
p.add_argument("--model", required=True)
p.add_argument("--data", required=True)
p.add_argument("--out", required=True)
p.add_argument("--max-steps", type=int, default=100)
p.add_argument("--max-length", type=int, default=1024)
p.add_argument("--fixed-length", type=int, default=1408)
p.add_argument("--fixed", action="store_true")
args = p.parse_args()

tok = AutoTokenizer.from_pretrained(args.model)
ds = load_dataset("json", data_files=args.data, split="train")
model = AutoModelForCausalLM.from_pretrained(args.model)
config = SFTConfig(output_dir=args.out, max_length=args.fixed_length if args.fixed else args.max_length,
                   per_device_train_batch_size=4, max_steps=args.max_steps, logging_steps=10, save_strategy="no",
                   report_to=[], use_cpu=True, learning_rate=1e-3,
                   **({"train_sampling_strategy": "group_by_length"} if args.fixed else {}))
lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
SFTTrainer(model=model, args=config, train_dataset=ds, processing_class=tok, peft_config=lora).train()
