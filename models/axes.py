"""Logical axis names carried by every parameter (`Param(..., logical_axes=(...))`).

Models name their dims; they never name mesh axes. The engine decides from these names which
dims are a stacked layer axis (`LAYERS`, always dim 0 of a scanned stack) and how each leaf is
laid out on the mesh.
"""

LAYERS = "layers"
VOCAB = "vocab"
EMBED = "embed"
POSITION = "position"
HEADS = "heads"
KV_HEADS = "kv_heads"
HEAD_DIM = "head_dim"
MLP = "mlp"
BATCH = "batch"                 # the rows of a batch (dim 1 of a KV cache)
CACHE_LENGTH = "cache_length"   # a KV cache's slot dim (one slot per position)
EXPERTS = "experts"             # a Mixture-of-Experts layer's expert dim (`models.moe`)
ROUTER = "router"               # the router's output dim: one score per expert, never split
EXPERT_MLP = "expert_mlp"       # an expert's inner dim (tensor-parallel generation keeps it whole)
CONV_WINDOW = "conv_window"     # a causal conv1d's kernel taps (Gated DeltaNet's)
