"""ds_diloco: Decoupled DiLoCo on DeepSpeed ZeRO-3 islands.

Data path: launcher -> island -> shard pseudo-gradient -> transport -> coordinator
-> merge -> outer optimizer -> checkpoint / export.
"""

__version__ = "0.1.0"
