"""A process's output as log lines: progress-bar redraws folded, secrets masked (before a long line
is cut), a traceback's last frame found. Pure logic over bytes and a clock passed in, so every rule
is testable without a process.

A progress bar (tqdm, a download meter) redraws its line with a carriage return, often thousands of
times before the newline that ends it. Stored as-is that is one enormous line; split on every `\\r`
it is a thousand lines. Folded, each newline-terminated line keeps only its final state (the text
after its last `\\r`), and a line that keeps redrawing without a newline is logged at most once per
`snapshot_s`, and only when its text changed: a long bar leaves a line every few seconds, not a
line per redraw.
"""
from __future__ import annotations

import codecs
import os
import re
from typing import Callable, Optional

from worker.agent.masking import SecretMask

MAX_LINE = 8192  # protocol.LogData.line

# Terminal control codes are dropped from every line (tokenpulse/terminal.py): a log is text.
from tokenpulse.terminal import ESCAPE, strip_control  # noqa: E402


class LineFolder:
    def __init__(self, snapshot_s: float = 10.0, max_line: int = MAX_LINE, mask: Optional[SecretMask] = None):
        self.snapshot_s, self.max_line = snapshot_s, max_line
        # Secrets are masked before a line is cut: a value straddling the cut would leave a piece
        # on each side, its first characters in one chunk and the rest in the next.
        self.mask: Callable[[str], str] = mask if mask else (lambda text: text)
        self._hold = mask.hold_back if mask else (lambda text: 0)
        self._decode = codecs.getincrementaldecoder("utf-8")(errors="replace").decode
        self._cur = ""  # the current line's text since its last \r
        self._drawn = ""  # its last complete non-blank redraw (the text before a \r)
        self._redrawing = False  # a \r was seen in the current line
        self._since: Optional[float] = None  # when its redraws started, or it was last snapshotted
        self._shown: Optional[str] = None  # the redraw state last logged as a snapshot
        self._esc = ""  # the start of an escape sequence cut by a read boundary

    def feed(self, data: bytes, now: float) -> list[str]:
        out: list[str] = []
        text = self._decode(data)
        # An escape sequence cut by a read boundary waits for its end (a few bytes at most).
        text = self._esc + text
        cut = text.rfind("\x1b")
        if cut >= 0 and len(text) - cut < 64 and not ESCAPE.match(text, cut):
            text, self._esc = text[:cut], text[cut:]
        else:
            self._esc = ""
        text = strip_control(text)
        while text:
            nl = text.find("\n")
            part, text = (text, "") if nl < 0 else (text[:nl], text[nl + 1:])
            self._add(part, now)
            if nl >= 0:
                self._end_line(out)
            else:
                if not self._redrawing and len(self._cur) >= self.max_line:
                    self._cur = self.mask(self._cur)
                while not self._redrawing and len(self._cur) >= self.max_line:  # no end in sight: cut it
                    # the start of a secret still being written waits for the rest (then masked whole)
                    cut = self.max_line - self._hold(self._cur[:self.max_line])
                    cut = cut if cut > 0 else self.max_line
                    out.append(self._cur[:cut])
                    self._cur = self._cur[cut:]
        # Data just arrived: the text after the last \r may be a redraw cut in half, so a snapshot
        # here takes the last complete one.
        out.extend(self._snapshot(now, self._drawn.rstrip()))
        return out

    def tick(self, now: float) -> list[str]:
        """The output has been quiet for a while: a line still redrawing (no newline yet) is logged
        in its current state, at most once per snapshot_s and only if it changed."""
        return self._snapshot(now, self._state())

    def _snapshot(self, now: float, state: str) -> list[str]:
        if not self._redrawing or self._since is None or now - self._since < self.snapshot_s:
            return []
        self._since = now
        if not state or state == self._shown:
            return []
        self._shown = state
        return [state]

    def close(self) -> list[str]:
        """End of output: whatever is pending is the last line."""
        out: list[str] = []
        self._add(strip_control(self._esc + self._decode(b"", final=True)), None)
        self._esc = ""
        if self._cur or self._redrawing:
            self._end_line(out)
        return out

    def _add(self, part: str, now: Optional[float]) -> None:
        if "\r" not in part:
            self._cur += part
            return
        pieces = part.split("\r")
        pieces[0] = self._cur + pieces[0]
        for p in pieces[:-1]:  # complete redraws
            if p.strip():
                self._drawn = p
        self._cur = pieces[-1]
        if not self._redrawing:
            self._redrawing, self._since = True, now
        if len(self._cur) > self.max_line:
            self._cur = self.mask(self._cur)[:self.max_line]

    def _state(self) -> str:
        return (self._cur if self._cur.strip() else self._drawn).rstrip()

    def _end_line(self, out: list[str]) -> None:
        if self._redrawing:
            line = self._state()
            # A bar cleared by its program (all blank) leaves nothing; a snapshot already logged
            # is not logged twice.
            if line and line != self._shown:
                out.append(self.mask(line)[:self.max_line])
        else:
            out.append(self.mask(self._cur)[:self.max_line])
        self._cur, self._drawn, self._redrawing, self._since, self._shown = "", "", False, None, None


# A job's secret values -> *** (every form and 8+ character piece: worker/agent/masking.py)
Masker = SecretMask


FRAME = re.compile(r'^\s*File "(?P<path>[^"]+)", line (?P<line>\d+), in (?P<func>.+?)\s*$')


def last_traceback_frame(lines: list[str], cwd: Optional[str] = None) -> Optional[str]:
    """The innermost frame of the last Python traceback in these stderr lines, with its exception:
    'train.py:42 in main: ValueError: bad learning rate'. None when there is no traceback."""
    last = None
    for i in range(len(lines) - 1, -1, -1):
        m = FRAME.match(lines[i])
        if m:
            last = (i, m)
            break
    if last is None:
        return None
    i, m = last
    exc = next((x.strip() for x in lines[i + 1:] if x.strip() and not x[:1].isspace()), None)
    path = m["path"]
    if cwd and os.path.isabs(path):
        try:
            rel = os.path.relpath(path, cwd)
            if not rel.startswith(".."):
                path = rel
        except ValueError:
            pass
    where = f"{path}:{m['line']} in {m['func']}"
    return f"{where}: {exc}" if exc else where
