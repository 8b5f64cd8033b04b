"""Build or load the model and tokenizer; find out whether the model can train on packed rows."""
from __future__ import annotations

import inspect
from pathlib import Path
from typing import Optional

import torch

from tokenpulse.errors import SpecError
from tokenpulse.protocol import BUILTIN_MODEL, JobSpec

from .data import DEMO_DIR


def builtin_config(vocab_size: int, **overrides):
    from transformers import LlamaConfig
    # ~1M parameters: big enough to learn something from the demo data, small enough for 2 CPU cores.
    kw = dict(vocab_size=vocab_size, hidden_size=128, intermediate_size=352, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=2048,
              tie_word_embeddings=True, use_cache=False)
    kw.update(overrides)
    return LlamaConfig(**kw)


def load_tokenizer(spec: JobSpec):
    from transformers import AutoTokenizer
    src = DEMO_DIR if spec.model == BUILTIN_MODEL else model_dir(spec)
    try:
        tok = AutoTokenizer.from_pretrained(str(src), trust_remote_code=False)
    except Exception as e:
        raise SpecError("model", f"cannot load a tokenizer from {src}: {type(e).__name__}: {e}") from e
    if tok.pad_token is None:  # padding needs some id; it is never a loss target
        if tok.eos_token is None:
            raise SpecError("model", f"tokenizer in {src} has neither pad nor eos token")
        tok.pad_token = tok.eos_token
    return tok


class _Quiet:
    def phase(self, *a, **k):
        pass


def model_dir(spec: JobSpec, em=None) -> Path:
    """The model's local directory; a Hub model is downloaded into the shared cache first."""
    from . import hub
    snapshot = hub.fetch_model(spec, em or _Quiet())
    p = snapshot if snapshot is not None else Path(spec.model).expanduser()
    if not p.is_dir():
        raise SpecError("model", f"model must be {BUILTIN_MODEL}, a local Hugging Face model directory or a Hub id; "
                                 f"{spec.model} is none of these")
    if not (p / "config.json").is_file():
        raise SpecError("model", f"{spec.model} has no config.json: not a Hugging Face model directory")
    return p


def check_model(spec: JobSpec) -> None:
    """Submit-time check: config and tokenizer load and describe a causal LM (weights not read)."""
    if spec.model == BUILTIN_MODEL:
        return
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    try:
        cfg = AutoConfig.from_pretrained(str(model_dir(spec)), trust_remote_code=False)
    except SpecError:
        raise
    except Exception as e:
        raise SpecError("model", f"cannot read model config in {spec.model}: {type(e).__name__}: {e}") from e
    if cfg.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise SpecError("model", f"model type {cfg.model_type!r} is not a causal language model")
    load_tokenizer(spec)


def load_model(spec: JobSpec, tokenizer, device: torch.device, weights_from: Optional[Path] = None):
    """The model in fp32 master weights (autocast handles bf16), on `device`, LoRA-wrapped if asked.

    weights_from: a checkpoint's model directory (resume) instead of the spec's model.
    """
    from transformers import AutoModelForCausalLM, LlamaForCausalLM
    is_lora_ckpt = weights_from is not None and (weights_from / "adapter_config.json").exists()
    quant = _bnb_4bit(device) if spec.lora and spec.lora.load_in_4bit else None  # refuse early on CPU
    if quant is not None and spec.model == BUILTIN_MODEL:
        raise SpecError("lora", "lora.load_in_4bit needs a pretrained model directory, not the builtin model")
    try:
        if spec.model == BUILTIN_MODEL and (weights_from is None or is_lora_ckpt):
            torch.manual_seed(spec.seed)  # the builtin model's init is part of the run's reproducibility
            model = LlamaForCausalLM(builtin_config(len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                                                    eos_token_id=tokenizer.eos_token_id,
                                                    bos_token_id=tokenizer.bos_token_id))
        else:
            src = weights_from if weights_from is not None and not is_lora_ckpt else model_dir(spec)
            kw = {"quantization_config": quant} if quant is not None else {}
            model = AutoModelForCausalLM.from_pretrained(str(src), trust_remote_code=False,
                                                         dtype=torch.float32, **kw)
    except SpecError:
        raise
    except (OSError, ValueError) as e:
        raise SpecError("model", f"cannot load model {spec.model}: {type(e).__name__}: {e}") from e
    model.config.use_cache = False  # a KV cache in training also disables packed-sequence masking
    if spec.gradient_checkpointing:
        if hasattr(model, "activation_checkpointing_enable"):  # the transformers >= 5 name
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    if not (spec.lora and spec.lora.load_in_4bit):
        model.to(device)
    if spec.lora:
        model = _wrap_lora(spec, model, weights_from if is_lora_ckpt else None)
    return model


def _bnb_4bit(device: torch.device):
    if device.type != "cuda":
        raise SpecError("lora", "lora.load_in_4bit (QLoRA) needs a CUDA GPU; this worker has none. "
                                "Turn load_in_4bit off to train LoRA on full-precision weights.")
    try:
        import bitsandbytes  # noqa: F401 -- only checking it is installed
    except ImportError as e:
        raise SpecError("lora", "lora.load_in_4bit needs the bitsandbytes package on the worker") from e
    from transformers import BitsAndBytesConfig
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.bfloat16,
                              bnb_4bit_quant_type="nf4")


def _wrap_lora(spec: JobSpec, model, adapter_dir: Optional[Path]):
    from peft import LoraConfig, PeftModel, get_peft_model
    if adapter_dir is not None:
        return PeftModel.from_pretrained(model, str(adapter_dir), is_trainable=True)
    names = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
    missing = [t for t in spec.lora.target_modules if t not in names]
    if missing:
        raise SpecError("lora", f"LoRA target_modules {missing} not found in the model")
    cfg = LoraConfig(r=spec.lora.rank, lora_alpha=spec.lora.alpha, lora_dropout=spec.lora.dropout,
                     target_modules=list(spec.lora.target_modules), task_type="CAUSAL_LM")
    return get_peft_model(model, cfg)


@torch.no_grad()
def supports_packing(model, device: torch.device) -> tuple[bool, str]:
    """Packing is safe only if tokens never attend across example boundaries given position_ids.

    Checked, not assumed: run example B alone and packed after example A; B's logits must match.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if "position_ids" not in inspect.signature(base.forward).parameters:
        return False, f"{type(base).__name__}.forward takes no position_ids"
    was_training = model.training
    model.eval()
    try:
        g = torch.Generator().manual_seed(0)
        vocab = base.config.vocab_size
        a = torch.randint(0, vocab, (1, 7), generator=g).to(device)
        b = torch.randint(0, vocab, (1, 5), generator=g).to(device)
        alone = model(input_ids=b, position_ids=torch.arange(5, device=device)[None], use_cache=False).logits
        pos = torch.cat([torch.arange(7), torch.arange(5)]).to(device)[None]
        packed = model(input_ids=torch.cat([a, b], 1), position_ids=pos, use_cache=False).logits[:, 7:]
    except Exception as e:  # some architectures reject the call outright: dynamic padding is still fine
        return False, f"packed forward failed ({type(e).__name__}: {e})"
    finally:
        model.train(was_training)
    diff = (alone.float() - packed.float()).abs().max().item()
    if diff > 1e-3 * max(1.0, alone.float().abs().max().item()):
        return False, f"attention leaks across packed examples (logit diff {diff:.2g})"
    return True, "position_ids separate packed examples (checked: packed logits match unpacked)"


def count_params(model) -> tuple[int, int]:
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return total, trainable


def flops_per_token(model, cfg, mean_len: float) -> float:
    """Training FLOPs per token (MFU's numerator): 6N (2N forward, 4N backward; frozen LoRA weights
    skip their weight grads: ~4N) plus attention scores over the example's own context."""
    total_p, trainable = count_params(model)
    n_layers = getattr(cfg, "num_hidden_layers", 0) or 0
    hidden = getattr(cfg, "hidden_size", 0) or 0
    return (6 * total_p if trainable == total_p else 4 * total_p + 2 * trainable) + 6 * n_layers * hidden * mean_len
