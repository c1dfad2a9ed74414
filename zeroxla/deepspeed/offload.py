"""DeepSpeed's ZeRO-Offload keys -> `ZeroConfig.offload_optimizer`, `offload_param`,
`offload_pin_memory`.

    "zero_optimization": {"offload_optimizer": {"device": "cpu", "pin_memory": true},
                          "offload_param": {"device": "none"}}

`device` "cpu" is host memory (a JAX host memory kind, `zeroxla.engine.offload`); "none" keeps
the state on the accelerator; "nvme" is refused by name (zeroxla has no NVMe swapper).
`pin_memory` picks pinned (`pinned_host`) or pageable (`unpinned_host`) host memory for the
optimizer state and masters; offloaded parameter partitions are pinned whatever it says (the step
fetches them from inside its program, which JAX allows from pinned host memory only:
`ZeroConfig.param_offload_memory_kind`). The pre-0.6
booleans `cpu_offload`, `cpu_offload_param` and `cpu_offload_use_pin_memory` are DeepSpeed's old
spellings of the same settings and map the same way. What depends on more than one key (an old
and a new spelling of one setting; differing pin_memory; the stage) is checked in
`offload_fields`, each error naming the JSON keys.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from zeroxla.deepspeed.checks import (Check, DeepSpeedConfigError, DeepSpeedConfigWarning,
                                      Invalid)

# Tuning keys of DeepSpeed's offload sections that act on the NVMe swapper or the torch CPU Adam
# only: with device "cpu" they change nothing DeepSpeed computes either, so they are accepted.
OFFLOAD_TUNING = ("nvme_path", "buffer_count", "buffer_size", "max_in_cpu", "fast_init",
                  "pipeline", "pipeline_read", "pipeline_write", "cpuadam_cores_perc")
_Z = "zero_optimization."
# ZeroConfig field -> (its object key, its old boolean key); the stages each needs.
_SETTINGS = {"offload_optimizer": ("offload_optimizer", "cpu_offload", (1, 2, 3)),
             "offload_param": ("offload_param", "cpu_offload_param", (3,))}


def offload_section(name: str) -> Check:
    """DeepSpeed's `offload_optimizer` / `offload_param` object -> {"device", "pin_memory"}:
    device "none" or "cpu" (JAX host memory), pin_memory a bool (pinned vs pageable host
    memory). "nvme", partial offload (`ratio` < 1) and SuperOffload are refused."""
    extra = ", ratio 1.0" if name == "offload_optimizer" else ""
    accepted = (f"null or an object with device 'none' or 'cpu' ('nvme' is not built: zeroxla "
                f"offloads to host memory only), pin_memory true/false{extra}; NVMe-only keys "
                f"({', '.join(OFFLOAD_TUNING[:4])}, ...) are accepted and have no effect")

    def fn(v):
        if v is None:
            return {"device": "none", "pin_memory": False}
        if not isinstance(v, dict):
            raise Invalid
        allowed = {"device", "pin_memory", *OFFLOAD_TUNING}
        if name == "offload_optimizer":
            allowed |= {"ratio", "super_offload"}
        device, pin = v.get("device", "none"), v.get("pin_memory", False)
        if (set(v) - allowed or device not in ("none", "cpu") or not isinstance(pin, bool)
                or v.get("ratio", 1.0) != 1.0 or v.get("super_offload", False) is not False):
            raise Invalid
        return {"device": device, "pin_memory": pin}

    return Check(accepted, fn)


def device_of(section: Mapping[str, Any]) -> str:
    """A checked offload object's device."""
    return section["device"]


def cpu_if(flag: bool) -> str:
    """An old boolean key (`cpu_offload`) -> the device it means."""
    return "cpu" if flag else "none"


def offload_fields(zero: Mapping[str, Any], fields: dict[str, Any], source: str) -> None:
    """Completes `fields` (from the key table) for the offload keys in the checked
    `zero_optimization` section `zero`; raises `DeepSpeedConfigError` naming the JSON keys."""
    stage = zero.get("stage", 0)
    pins: dict[str, bool] = {}           # JSON key -> pin_memory, for what is offloaded
    for field, (key, old, stages) in _SETTINGS.items():
        if key in zero and old in zero:
            raise DeepSpeedConfigError(
                f"{source}: {_Z}{key} and {_Z}{old} are both given; {old} is DeepSpeed's old "
                f"spelling of {key}.device: give {key} only")
        given = key if key in zero else old if old in zero else None
        if given is None or fields[field] == "none":
            continue
        if stage not in stages:
            why = ("ZeRO-Offload moves the partitioned optimizer state" if len(stages) > 1
                   else "only stage 3 partitions parameters")
            raise DeepSpeedConfigError(
                f"{source}: {_Z}{given} offloads to 'cpu' at {_Z}stage={stage}; accepted: "
                f"{_Z}stage {' or '.join(map(str, stages))} ({why}), or device 'none'")
        pins[f"{_Z}{key}.pin_memory"] = zero[key]["pin_memory"] if key in zero else False
    old_pin = zero.get("cpu_offload_use_pin_memory")
    if old_pin is not None and pins:
        # The old key sets pin_memory of everything offloaded; an object's own pin_memory
        # (default false) must agree with it.
        pins = {k: v for k, v in pins.items() if k.split(".")[1] in zero}
        pins[f"{_Z}cpu_offload_use_pin_memory"] = old_pin
    if len(set(pins.values())) > 1:
        raise DeepSpeedConfigError(
            f"{source}: {' and '.join(f'{k}={str(v).lower()}' for k, v in pins.items())} "
            "differ; accepted: one pin_memory for everything offloaded (zeroxla keeps the "
            "offloaded optimizer state in one host memory kind, and parameter partitions "
            "pinned)")
    if pins:
        fields["offload_pin_memory"] = next(iter(pins.values()))
        return
    fields.pop("offload_pin_memory", None)
    if old_pin:
        warnings.warn(f"{source}: {_Z}cpu_offload_use_pin_memory=true has no effect: nothing "
                      "is offloaded", DeepSpeedConfigWarning, stacklevel=4)
