"""Chat data: render a conversation with the tokenizer's own chat template and find which tokens are
the assistant's (its content and end-of-turn marker), so the loss can be taken on those only.

The mask is found by rendering prefix by prefix, which works with any template (few ship the
`{% generation %}` markers transformers' own assistant mask needs): the assistant's turn i spans from
the end of "messages before i + the generation prompt" to the end of "messages up to i". Token
offsets of the whole rendered text then say which tokens fall in those spans.
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

from tokenpulse.errors import SpecError

ASSISTANT = "assistant"


def require_template(tokenizer, model: str) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise SpecError("model",
                        f"the dataset holds chats (a messages column) but the tokenizer of {model} has no chat "
                        "template: use a model whose tokenizer_config.json has a chat_template (an instruct "
                        "or chat model), add one to its tokenizer (tokenizer.chat_template = ...; "
                        "save_pretrained), or name plain-text columns with text_field or "
                        "prompt_field/response_field")


def check_messages(messages: Any, field: str) -> list[dict]:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise SpecError("messages_field", f"column {field!r} must hold a non-empty list of {{role, content}} messages, "
                                          f"got {type(messages).__name__}")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
            raise SpecError("messages_field", f"column {field!r}: every message needs a 'role' string and a 'content' "
                                              f"(got {str(m)[:200]!r})")
    return [dict(m) for m in messages]


def _render(tokenizer, messages: list[dict], gen_prompt: bool = False) -> str:
    if not messages and not gen_prompt:
        return ""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen_prompt)


def assistant_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of its assistant turns."""
    try:
        full = _render(tokenizer, messages)
    except Exception as e:  # a template raising on these messages (e.g. roles out of order)
        raise SpecError("messages_field",
                        f"the chat template cannot render a conversation: {type(e).__name__}: {e}") from e
    spans, pos = [], 0
    for i, m in enumerate(messages):
        if m["role"] != ASSISTANT:
            continue
        span = _prefix_span(tokenizer, messages, i, full)
        if span is None:  # a template that renders earlier turns differently: find the content itself
            span = _content_span(tokenizer, full, m, pos)
        start, end = span
        while end > start and full[end - 1].isspace():  # the newline after the end marker is not a target
            end -= 1
        spans.append((start, end))
        pos = end
    return full, spans


def _prefix_span(tokenizer, messages, i, full) -> Optional[tuple[int, int]]:
    try:
        before = _render(tokenizer, messages[:i], gen_prompt=True)
        upto = _render(tokenizer, messages[:i + 1])
    except Exception:
        return None
    if upto.startswith(before) and full.startswith(upto) and len(upto) > len(before):
        return len(before), len(upto)
    return None


def _content_span(tokenizer, full: str, message: dict, pos: int) -> tuple[int, int]:
    content = message["content"] if isinstance(message["content"], str) else ""
    at = full.find(content, pos) if content else -1
    if at < 0:
        raise SpecError("messages_field",
                        "cannot find an assistant turn in the rendered chat: the chat template changes the "
                        "messages' text; use a template that keeps it, or prompt_field/response_field")
    end = at + len(content)
    eos = tokenizer.eos_token
    if eos and full.startswith(eos, end):
        end += len(eos)
    return at, end


def encode_chats(tokenizer, chats: list, field: str, mask_others: bool) -> tuple[list[list[int]], list[np.ndarray]]:
    """Token ids per conversation and a 0/1 loss mask per token (1: assistant content/end tokens;
    all ones when mask_others is False)."""
    texts, all_spans = [], []
    for c in chats:
        full, spans = assistant_spans(tokenizer, check_messages(c, field))
        texts.append(full)
        all_spans.append(spans)
    # The template writes the special tokens (BOS...) itself; tokenizing adds none.
    if getattr(tokenizer, "is_fast", False):
        enc = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
        ids_list, masks = enc["input_ids"], []
        for ids, offs, spans in zip(ids_list, enc["offset_mapping"], all_spans):
            starts = np.fromiter((o[0] for o in offs), np.int64, len(offs))
            m = np.zeros(len(ids), np.uint8)
            for a, b in spans:
                m[(starts >= a) & (starts < b)] = 1
            masks.append(m if mask_others else np.ones(len(ids), np.uint8))
        return [list(x) for x in ids_list], masks
    # Slow tokenizers have no offsets: tokenize the pieces between span edges one by one.
    ids_list, masks = [], []
    for text, spans in zip(texts, all_spans):
        ids, m, pos = [], [], 0
        for a, b in spans + [(len(text), len(text))]:
            for lo, hi, flag in ((pos, a, 0), (a, b, 1)):
                if hi > lo:
                    piece = tokenizer(text[lo:hi], add_special_tokens=False)["input_ids"]
                    ids += piece
                    m += [flag] * len(piece)
            pos = b
        ids_list.append(ids)
        masks.append(np.asarray(m, np.uint8) if mask_others else np.ones(len(ids), np.uint8))
    return ids_list, masks
