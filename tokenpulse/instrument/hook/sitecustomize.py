"""tokenpulse's startup hook for command jobs (see tokenpulse/instrument/__init__.py).

Runs at interpreter start because the agent put this directory first on PYTHONPATH. It must never
break the user's program: any failure here is reported on stderr and ignored.
"""
import os
import sys


def _start_tokenpulse() -> None:
    if not os.environ.get("TOKENPULSE_EVENT_FD"):
        return
    if os.environ.get("TOKENPULSE_INSTRUMENT", "1").strip().lower() in ("0", "false", "no", "off"):
        return
    try:
        import tokenpulse.instrument.boot as boot
    except ImportError:
        # The job's interpreter is not the agent's: find tokenpulse beside this file, appended last
        # so the job's own packages always win.
        here = os.path.dirname(os.path.abspath(__file__))
        sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(here))))
        import tokenpulse.instrument.boot as boot
    boot.start()


def _chain() -> None:
    """Run the sitecustomize this one shadows (a distribution's or a venv's), if there is one."""
    import importlib.machinery
    import importlib.util
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


try:
    _start_tokenpulse()
except Exception as e:  # never take the user's program down
    sys.stderr.write(f"tokenpulse: instrumentation disabled ({type(e).__name__}: {e})\n")
_chain()
