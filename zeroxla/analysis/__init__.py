"""Reading the compiled program: collectives and their bytes, memory per device.

    hlo.py             the collectives of a compiled program (`collectives()`), from its HLO text
    hlo_text.py        a small parser for XLA's HLO text: computations, instructions, shapes
    replica_groups.py  the device groups of a collective, in each of XLA's printed forms
    trip_counts.py     how many times each computation runs (while-loop trip counts)
    comm_report.py     bytes each device sends per step, by collective kind and ZeRO phase
    memory.py          per-device memory of a live state and a compiled step; predictions
"""
