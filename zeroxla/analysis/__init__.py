"""Reading the compiled program: collectives and their bytes, memory per device.

    hlo.py          a small parser for XLA's HLO text: collectives, groups, loop trip counts
    comm_report.py  bytes each device sends per step, by collective kind and ZeRO phase
    memory.py       per-device memory of a live state and a compiled step; predictions
"""
