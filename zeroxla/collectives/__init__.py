"""What moves between devices: ZeRO's gather / reduce-scatter and ZeRO++'s quantized and
hierarchical versions, called inside `jax.shard_map` over the data axes of the mesh.

    zero.py        ZeroCollectives: all-gather, re-gather, reduce-scatter of one unit
    wire.py        the dtype a collective travels in, per backend (XLA:CPU widens bf16)
    dot_layout.py  a weight gradient reduce-scattered in its backward dot's dim order
                   (XLA:CPU: the transpose moves to the shard, the dot keeps its library)
    zeropp.py      ZeroPPCollectives: qwZ, hpZ, qgZ (ZeRO++, Wang et al. 2023)
    quantized.py   the quantized all-gather and the two-hop quantized reduce-scatter
"""
