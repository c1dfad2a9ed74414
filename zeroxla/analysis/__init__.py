"""Reading the compiled program: collectives and their bytes, memory per device.

    hlo.py             the collectives of a compiled program (`collectives()`), from its HLO text
    hlo_text.py        a small parser for XLA's HLO text: computations, instructions, shapes
    replica_groups.py  the device groups of a collective, in each of XLA's printed forms
    trip_counts.py     how many times each computation runs (while-loop trip counts)
    comm_report.py     bytes each device sends per step, by collective kind and ZeRO phase
    schedule.py        a scheduled GPU program's async collectives and the compute between
    memory.py          per-device memory of a live state and a compiled step; predictions
    abstract_step.py   the step traced and compiled on abstract arrays (nothing allocated)
    host_residuals.py  bytes remat "offload" keeps in host memory, from the traced program
    planner.py         what fits a device: per-device figures by part, the largest T (`zeroxla plan`)
"""
