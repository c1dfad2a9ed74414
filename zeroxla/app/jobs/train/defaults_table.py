"""The ZeRO stage, persistence threshold, clipping and overflow-check defaults of the three ways
to configure a run, side by side, each with the reason where they differ.

    API   `ZeroConfig()`, the library's
    CLI   `zeroxla train` with no options, its config tree resolved as the command resolves it
    JSON  `zeroxla train --config` of a JSON whose `zero_optimization` is empty

Each column is computed by the code path it names, not restated; the reasons are the ones the
options' `--help` prints (`zeroxla.app.jobs.train.defaults.JOB_DEFAULTS`, and `--config`'s help for
DeepSpeed's own defaults). Print it with

    python -c "from zeroxla.app.jobs.train.defaults_table import main; main()"

No device is used.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from zeroxla.app.jobs.train.defaults import job_default_of
from zeroxla.app.jobs.train.options import OPTION_NAMES, json_default_text
from zeroxla.app.jobs.train.resolve import resolve_job
from zeroxla.deepspeed.zero_config import KEY_OF_FIELD
from zeroxla.sharding.config import ZeroConfig

FIELDS = ("stage", "persistence_threshold", "gradient_clipping", "check_grad_overflow")
EMPTY_ZERO_OPTIMIZATION = {"zero_optimization": {}}
# The option of each field: the one whose --help says its default and why.
OPTION_OF_FIELD = {"stage": "zero_stage", "persistence_threshold": "persistence_threshold",
                   "gradient_clipping": "gradient_clipping",
                   "check_grad_overflow": "check_grad_overflow"}


@dataclasses.dataclass(frozen=True)
class DefaultsRow:
    """One field's defaults: the API's, `zeroxla train`'s, a DeepSpeed JSON's, and why they
    differ (empty where all three agree)."""

    field: str
    api: Any
    cli: Any
    json: Any
    reason: str


def _reason(field: str, api: Any, cli: Any, json: Any) -> str:
    parts = []
    row = job_default_of(field)
    if cli != api and row is not None:
        parts.append(f"CLI ({OPTION_NAMES[OPTION_OF_FIELD[field]]}): {row.reason}")
    if json != api and row is not None and row.with_config and json == cli:
        parts.append(f"JSON: the job's default also with --config, unless it sets "
                     f"{KEY_OF_FIELD[field]}")
    elif json != cli:
        parts.append(f"JSON (--config): DeepSpeed's default, {json_default_text(field)}")
    return "; ".join(parts)


def defaults_table() -> list[DefaultsRow]:
    """The rows for FIELDS, each column computed by its own path (see the module docstring)."""
    api = ZeroConfig()
    cli = resolve_job({}).zero_config()
    json = resolve_job({"deepspeed_config": EMPTY_ZERO_OPTIMIZATION}).zero_config()
    rows = []
    for field in FIELDS:
        values = [getattr(config, field) for config in (api, cli, json)]
        rows.append(DefaultsRow(field, *values, _reason(field, *values)))
    return rows


def format_table(rows: list[DefaultsRow]) -> str:
    """The rows as a Markdown table (docs/zero.md's)."""
    lines = ["| field | API `ZeroConfig()` | CLI `zeroxla train` | JSON, empty "
             "`zero_optimization` | why they differ |", "|---|---|---|---|---|"]
    lines += [f"| `{r.field}` | {r.api} | {r.cli} | {r.json} | {r.reason or 'they agree'} |"
              for r in rows]
    return "\n".join(lines)


def main() -> None:
    print(format_table(defaults_table()))


__all__ = ["DefaultsRow", "EMPTY_ZERO_OPTIMIZATION", "FIELDS", "OPTION_OF_FIELD",
           "defaults_table", "format_table", "main"]
