"""The ZeRO engine (the step layer): from the sharding plan to one compiled training step.

    layout.py      ZeroLayout: axes, config, plan, collectives, optimizer layout, shardings,
                   built once in a fixed order; what every consumer of a step reads
    state.py       TrainState and the consolidated (gathered) parameters
    stored.py      a parameter's stored form <-> its logical values (frozen codes quantized here)
    frozen_codes.py a step's model seen with every leaf frozen and stored as int8 codes of its
                   partitions (an RL job's int8 reference), read per layer like the step's own
    step.py        ZeroStep: the step as one pure function, compiled once
    apply.py       the update half: clipping, the optax update, fp16 overflow skip
    loss.py        losses as (sum, count)
    objective.py   what one forward of the loss gives the step: (sum, count) and the opt-in
                   terms added to it (an MoE model's auxiliary loss), as one object
    router_aux.py  an MoE model's auxiliary load-balancing loss as one device computes it
    batch_checks.py the batch validated before sending
    bin_packing.py sequences into packed rows, rows balanced over data replicas
    sequence.py    sequence parallelism in the step: the batch's split, refusals
    consumption.py proof, read in the traced loss, that the model used the SequenceParallel
                   and a packed batch's positions and segment ids (refused by name if not)
    token_forward.py per-token values (an RL policy's log-probs, a critic's values) computed
                   in a step's layout, rows and tokens split as the step splits them
    experts.py     expert parallelism in the step: the `experts=` the model's forward is
                   passed (beside `sequence=`), refusals
    randomness.py  one seed -> a key per step, data device and micro-batch (dropout)
    model_state.py non-parameter Variables (BatchNorm statistics): replicated, cross-replica
    wrap.py        the model copy inside the step: gather units follow the module tree
    gather.py      gather before use, release, re-gather in backward (custom VJPs)
    layer_loop.py  a gathered stack's layer loop: prefetch, per-layer values read in place
    remat.py       what a gathered unit keeps for its backward (remat policies)
    invariant_residuals.py a stack's layer residuals that are the same at every layer
                   (a causal mask), computed and kept once instead of per layer
    cotangent_layout.py a unit's pullback with its weight cotangents left in their dot's
                   dim order (for the reduce-scatter, `collectives.dot_layout`)
    weight_split.py a pullback split into its input-gradient part B and its weight-gradient
                   part W (zero-bubble schedules), W reading what B stashes
    weight_split_plan.py which jaxpr equations B and W run, and the stash between them
    gradients.py   what is differentiated, and where each gradient is reduced, per stage
    update.py      each leaf's layouts around the optax update
    optimizer.py   any optax transformation on the logical, sharded parameters
    loss_scale.py  fp16 dynamic loss scaling, DeepSpeed's semantics
    offload.py     ZeRO-Offload / ZeRO-Infinity: optimizer state, masters and stage-3 partitions in host memory
    host_update.py ZeRO-Offload's update in host memory (compute_on), or why it runs on the device
    logical.py     the state's mesh-independent form (checkpoints)
    layout_argument.py a ZeroStep given where a layout is expected: its layout, deprecated

The plan it runs (mesh, ZeroConfig, rules, leaf plans) is `zeroxla.sharding`; collectives live
in `zeroxla.collectives`, kernels in `zeroxla.pallas_kernels`, what differs between JAX
versions (the jaxpr facts the split reads, `compute_on`) in `zeroxla.compat`.
`zeroxla.make.make_step` builds the layout and chooses the plain step or the pipelined one
(`zeroxla.pipeline`), which sit above.
"""
