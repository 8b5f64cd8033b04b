"""Send an alert event, working around Emitter.emit(kind, **data) clashing with the alert's `kind` field.

Emitter.alert() calls self.emit("alert", kind=...), which raises TypeError ("multiple values for
argument 'kind'") as long as emit's first parameter is not positional-only. Reported; until emit.py
is fixed this writes the same validated line itself. Remove once Emitter.alert works.
"""
from __future__ import annotations

import json
import sys
import time

from tokenpulse.protocol import AlertData


def send_alert(em, kind: str, message: str, severity: str = "warning") -> None:
    try:
        em.alert(kind, message, severity=severity)
        return
    except TypeError:
        pass
    data = AlertData(kind=kind, message=message[:8192], severity=severity).model_dump(exclude_none=True, mode="json")
    line = json.dumps({"kind": "alert", "t": time.time(), "data": data}, allow_nan=False)
    with em._lock:
        out = getattr(em, "_out", None)
        if out is not None:
            try:
                out.write(line + "\n")
            except (BrokenPipeError, ValueError):
                pass
        else:
            print(f"[tokenpulse] alert: {json.dumps(data)}", file=sys.stderr, flush=True)
