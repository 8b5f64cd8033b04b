"""tokenpulse: run, watch and control model training.

The explicit reporting API for your own scripts (light: no torch, no pydantic at import):

    import tokenpulse
    tokenpulse.init(name="my-run", config={"lr": 1e-4})
    tokenpulse.phase("tokenizing", done=0, total=n)
    tokenpulse.log({"loss": loss}, step=step)
    tokenpulse.finish()

and `tokenpulse.integrations.TokenPulseCallback` for a transformers Trainer.
"""
from tokenpulse.run import alert, finish, init, log, phase

__all__ = ["init", "log", "phase", "alert", "finish"]
