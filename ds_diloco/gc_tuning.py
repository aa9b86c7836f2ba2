"""Python's garbage collector in our long-lived processes: island ranks and the coordinator.

Importing torch, DeepSpeed and transformers and building an engine leaves about half a
million Python objects that live as long as the process. CPython's cyclic collector
walks all of them in every full collection: measured here, a tenth to a fifth of a
rank's imports (10.6-12.0 s with it on, 9.3-9.5 s off) and 3.0 s at interpreter exit
(0.3 s frozen);
in training, a full collection can land inside one rank's step while the others wait
for it in the next collective. torchtitan turns automatic collection off for the same
reason. We keep it off during set-up, then collect once and freeze what survived (the
collector never walks frozen objects again) and turn it back on for the objects the
loop makes; a process freezes again just before it exits.
"""

from __future__ import annotations

import contextlib
import gc


@contextlib.contextmanager
def paused_for_setup():
    """No automatic collections inside, until :func:`resume_after_setup` (or the block's
    end, when set-up failed)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def resume_after_setup() -> None:
    """Collect the set-up's garbage once, freeze the survivors, collect automatically again."""
    gc.collect()
    gc.freeze()
    gc.enable()


def before_exit() -> None:
    """Skip the interpreter's final walk over every object: freeze them all first (the
    ``atexit`` handlers still run; nothing is saved by finalisers in our processes)."""
    gc.freeze()
