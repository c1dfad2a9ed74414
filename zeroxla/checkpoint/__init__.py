"""Checkpoints: sharded, layout-independent save and restore on orbax; safetensors export.

    manager.py   save / restore / list, crash safety and integrity checks
    export.py    a checkpoint's weights as Hugging Face safetensors, streamed
"""

from zeroxla.checkpoint.manager import *  # noqa: F401,F403
from zeroxla.checkpoint.manager import (  # noqa: F401  (private names the export and tests use)
    COMMIT_FILE,
    META_ITEM,
    STATE_ITEM,
    TMP_SUFFIX,
    __all__,
)
