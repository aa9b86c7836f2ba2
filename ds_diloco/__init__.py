"""ds_diloco: Decoupled DiLoCo on DeepSpeed ZeRO-3 islands.

Data path: launcher -> island -> shard pseudo-gradient -> transport -> coordinator
-> merge -> outer optimizer -> checkpoint / export.

Public API for your own training loop: :class:`Learner` (a DeepSpeed ZeRO-3
engine joins a run) and :class:`DiLoCoCallback` (the same for the Hugging Face
Trainer). Both are imported on first use, so ``import ds_diloco`` stays light.
"""

import importlib
import importlib.util

__version__ = "0.1.0"
__all__ = ["DiLoCoCallback", "Diverged", "Learner", "LearnerError", "Superseded"]


def __getattr__(name: str):
    if name in ("Learner", "LearnerError"):
        from ds_diloco import learner

        return getattr(learner, name)
    if name == "Superseded":  # raised by Learner.step once a later launch of the island took over
        from ds_diloco.syncer import Superseded

        return Superseded
    if name == "Diverged":  # raised by Learner.step once the island's model is not finite
        from ds_diloco.syncer import Diverged

        return Diverged
    if name == "DiLoCoCallback":
        from ds_diloco.hf_callback import DiLoCoCallback

        return DiLoCoCallback
    # A module as the README names it after `import ds_diloco` (ds_diloco.zero.prepare_cpu_accelerate,
    # ds_diloco.stall_exit.StallExit): an AttributeError unless something had imported it.
    if importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'ds_diloco' has no attribute {name!r}")
