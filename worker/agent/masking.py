"""A command job's secret values (its `secret_env`) replaced by *** in everything its agent sends.

A script can print a secret in many shapes, so each value is masked in several forms: as itself,
base64-encoded (standard and URL-safe, at each of the three byte alignments it can take inside a
longer encoded text), and URL-encoded. And a piece of a form is masked too: any run of MIN_PIECE or
more characters of it, wherever it stands. That covers a value cut in two by a chunk boundary (a
long line split, a 64-char metric name, an 8 KiB field), half a token printed for "identification",
and a value glued to other text. Values shorter than MIN_VALUE characters are left alone (masking
every '1' would make logs unreadable and hide nothing); values of MIN_VALUE..MIN_PIECE-1
characters are masked whole only.

`SecretMask.data` masks a whole event's data, keys included (metric names are keys), so the agent
applies one mask at the one place events leave it (Outbox.add) and no field is missed.
"""
from __future__ import annotations

import base64
import re
from typing import Any, Iterable
from urllib.parse import quote, quote_plus

MIN_VALUE = 4
MIN_PIECE = 8
STARS = "***"


def _b64_cores(raw: bytes) -> list[str]:
    """The part of base64(prefix + raw + suffix) that depends only on `raw`, for each of the three
    alignments a prefix can give it: what any base64 text containing the value must contain."""
    out = []
    for k in range(3):
        enc = base64.b64encode(b"\0" * k + raw).decode().rstrip("=")
        start = -(-k * 8 // 6)  # characters holding any bit of the prefix
        end = (k + len(raw)) * 8 // 6  # characters wholly inside the value
        core = enc[start:end]
        if len(core) >= MIN_VALUE:
            out.append(core)
    return out


def forms(value: str) -> set[str]:
    """The shapes of one secret value that are masked (and their pieces, when long enough)."""
    raw = value.encode()
    found = {value, quote(value, safe=""), quote(value), quote_plus(value)}
    found |= {base64.b64encode(raw).decode(), base64.urlsafe_b64encode(raw).decode()}
    for core in _b64_cores(raw):
        found |= {core, core.replace("+", "-").replace("/", "_")}
    return {f for f in found if len(f) >= MIN_VALUE}


class SecretMask:
    def __init__(self, secrets: Iterable[str]):
        values = {v for v in secrets if v and len(v) >= MIN_VALUE}
        self._forms = sorted({f for v in values for f in forms(v)}, key=len, reverse=True)
        short = [f for f in self._forms if len(f) < MIN_PIECE]  # masked whole only
        self._short = re.compile("|".join(map(re.escape, short))) if short else None
        # Any piece of MIN_PIECE+ characters of a form holds one of its 4-grams at an index that is a
        # multiple of 4: those anchors are searched (str.find), and each hit extended along the form.
        self._anchors: dict[str, list[tuple[str, int]]] = {}
        for f in self._forms:
            if len(f) >= MIN_PIECE:
                for j in range(0, len(f) - 3, 4):
                    self._anchors.setdefault(f[j:j + 4], []).append((f, j))

    def __bool__(self) -> bool:
        return bool(self._forms)

    def spans(self, text: str) -> list[tuple[int, int]]:
        """Where pieces (MIN_PIECE+ characters) of a secret's forms stand in `text`, merged."""
        found = []
        for gram, places in self._anchors.items():
            p = text.find(gram)
            while p >= 0:
                for f, j in places:
                    s, e = p, p + 4
                    while s > 0 and j - (p - s) > 0 and text[s - 1] == f[j - (p - s) - 1]:
                        s -= 1
                    while e < len(text) and j + (e - p) < len(f) and text[e] == f[j + (e - p)]:
                        e += 1
                    if e - s >= MIN_PIECE:
                        found.append((s, e))
                p = text.find(gram, p + 1)
        found.sort()
        merged: list[tuple[int, int]] = []
        for s, e in found:
            if merged and s <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], e))
            else:
                merged.append((s, e))
        return merged

    def __call__(self, text: str) -> str:
        if not self._forms or not isinstance(text, str):
            return text
        spans = self.spans(text)
        if spans:
            out, at = [], 0
            for s, e in spans:
                out += [text[at:s], STARS]
                at = e
            out.append(text[at:])
            text = "".join(out)
        return self._short.sub(STARS, text) if self._short is not None else text

    def data(self, obj: Any) -> Any:
        """Every string in an event's data masked, dict keys (metric names) included."""
        if not self._forms:
            return obj
        if isinstance(obj, str):
            return self(obj)
        if isinstance(obj, dict):
            return {self(k) if isinstance(k, str) else k: self.data(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return [self.data(v) for v in obj]
        return obj

    def hold_back(self, text: str) -> int:
        """How many characters at the end of `text` could be the start of a secret still being
        written (a prefix of a form): a line cut at a chunk boundary keeps them for the next chunk,
        so the whole value is masked there instead of leaving its first characters in this one."""
        if not self._forms:
            return 0
        longest = 0
        for f in self._forms:
            for n in range(min(len(f) - 1, len(text)), longest, -1):
                if text.endswith(f[:n]):
                    longest = n
                    break
        return longest

