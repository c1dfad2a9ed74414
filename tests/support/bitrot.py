"""Bit rot for checkpoint tests: bytes flipped throughout the data files orbax wrote.

Orbax splits a checkpoint's arrays over several data files, differently from run to run (its
writes are concurrent), and a file can hold index nodes that a newer node superseded. A flip at
one place in one file can therefore land in bytes no reader looks at. Flipping one byte every
4 KiB of every data file lands in every array larger than that, whatever the split.
"""

from pathlib import Path

STRIDE = 4096


def flip_data_bytes(step_directory: Path) -> int:
    """XORs one byte every `STRIDE` bytes of each file under `step_directory`'s `d/` folders;
    returns how many files changed (a test asserts it is not zero)."""
    changed = 0
    for path in Path(step_directory).rglob("*"):
        if not (path.is_file() and path.parent.name == "d"):
            continue
        raw = bytearray(path.read_bytes())
        for at in range(len(raw) // 2 % STRIDE, len(raw), STRIDE):
            raw[at] ^= 0x5A
        path.write_bytes(bytes(raw))
        changed += 1
    return changed
