"""Terminal control sequences out of text (stdlib only): the agent's output folding drops them from
every log line (worker/agent/output.py), and the server from lines stored before it did, when they are
shown or downloaded (server/api/logs.py). Colours, cursor moves (tqdm's nested bars write ESC[A,
"cursor up", between their lines: it leaked as "[A"), erase-line, window titles. \\r and \\n are the
folder's to interpret; \\t stays."""
from __future__ import annotations

import re

ESCAPE = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]"  # CSI: ESC [ params final (colours, cursor, erase)
                    r"|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)"  # OSC: ESC ] ... BEL or ESC \ (titles, links)
                    r"|\x1b[@-Z\\^_]"  # other two-byte escapes (not ESC [ or ESC ]: their sequences are above)
                    r"|\x9b[0-?]*[ -/]*[@-~]")  # the 8-bit CSI
C0 = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")  # other controls: bell, backspace, a lone ESC


def strip_control(text: str) -> str:
    """Text without terminal control sequences or other control characters (\\t, \\n, \\r kept)."""
    if "\x1b" in text or "\x9b" in text:
        text = ESCAPE.sub("", text)
    return C0.sub("", text)
