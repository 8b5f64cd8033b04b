"""A Hugging Face Trainer script with the user's own dataset, collator and callback."""
import os
import sys
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments
from userdata import EVAL_BASE, EVAL_EXTRA_S, VOCAB, Examples, after_step, collate, read_example, save_checkpoint

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 400
out = os.environ.get("OUT_DIR", ".")


class HeldOut(torch.utils.data.Dataset):
    def __len__(self):
        return 160

    def __getitem__(self, i):
        if i == 0:
            time.sleep(EVAL_EXTRA_S)  # the healthy run's slow evaluation
        return read_example(EVAL_BASE + i, 48)


class Bookkeeping(TrainerCallback):
    """The user's callback: per-step bookkeeping, and a copy of each checkpoint."""

    def on_step_end(self, args, state, control, model=None, **kw):
        after_step(state.global_step)

    def on_save(self, args, state, control, model=None, **kw):
        save_checkpoint(model, state.global_step, out)


torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128))
args = TrainingArguments(output_dir=os.path.join(out, "trainer"), max_steps=steps, per_device_train_batch_size=8,
                         per_device_eval_batch_size=8, learning_rate=1e-3, logging_steps=50, eval_strategy="steps",
                         eval_steps=20, save_strategy="steps", save_steps=25, save_total_limit=1, report_to=[],
                         dataloader_num_workers=int(os.environ.get("NUM_WORKERS", "0")), use_cpu=True,
                         disable_tqdm=False)
trainer = Trainer(model=model, args=args, train_dataset=Examples(), eval_dataset=HeldOut(), data_collator=collate,
                  callbacks=[Bookkeeping()])
trainer.train()
print("done", flush=True)
