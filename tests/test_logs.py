"""Issue 22 (4): logs without terminal control codes, kept whole up to the operator's bound, searched
and downloaded through the API, the CLI and the job page."""
from __future__ import annotations

from worker.agent.output import LineFolder, strip_control

TQDM_NESTED = (b"epoch 1\n\x1b[32mgreen\x1b[0m text\n 50%|##   | 5/10\r 100%|####| 10/10\n"
               b"\x1b[Aouter\x1b[A\x1b[2Kinner\n\x1b]0;title\x07done\x07\nend\x1b")


def test_control_codes_are_dropped_whatever_the_read_boundaries():
    for chunk in (1, 2, 3, 5, 1000):  # an escape sequence cut between two reads is still whole-dropped
        fold, out = LineFolder(), []
        for i in range(0, len(TQDM_NESTED), chunk):
            out += fold.feed(TQDM_NESTED[i:i + chunk], 0.0)
        out += fold.close()
        assert out == ["epoch 1", "green text", " 100%|####| 10/10", "outerinner", "done", "end"], chunk
        assert not any("[A" in line or "\x1b" in line for line in out)


def test_strip_control_keeps_text_and_tabs():
    assert strip_control("a\x1b[Ab\tc\x08\x07") == "ab\tc"
    assert strip_control("plain [A text") == "plain [A text"  # brackets a person typed stay
