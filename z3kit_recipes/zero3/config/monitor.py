"""MonitorConfig: where the engine writes its per-step numbers (DeepSpeed's monitor sections).

DeepSpeed's ``tensorboard`` and ``csv_monitor`` sections (``enabled``,
``output_path``, ``job_name``; ``deepspeed/monitor/config.py``) map onto
one ``MonitorConfig`` each, written by ``zero3.runtime.monitor``: under
``output_path/job_name``, as DeepSpeed lays them out. A section with
``enabled: false`` changes nothing and is left out. TensorBoard needs the
``tensorboard`` package (``torch.utils.tensorboard`` imports it): a JSON
that enables it where it is not installed is refused at once, not after a
run that logged nothing.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from typing import Any, Final

import attrs

#: the JSON's section name -> ``MonitorConfig.kind``
KINDS: Final = {"tensorboard": "tensorboard", "csv_monitor": "csv"}
_KEYS: Final = frozenset({"enabled", "output_path", "job_name"})
#: DeepSpeed's default job name (``TensorBoardConfig.job_name``, ``CSVConfig.job_name``)
DEFAULT_JOB_NAME: Final = "DeepSpeedJobName"


def _check_kind(instance: object, attribute: attrs.Attribute[str], value: object) -> None:
    if value not in KINDS.values():
        raise ValueError(f"MonitorConfig.kind must be one of {sorted(KINDS.values())}, got {value!r}")
    if value == "tensorboard" and importlib.util.find_spec("tensorboard") is None:
        raise ValueError("TensorBoard logging needs the tensorboard package (torch.utils.tensorboard imports it), "
                         "which is not installed: pip install tensorboard, or write the same numbers to CSV "
                         "(csv_monitor) instead")


def _check_str(instance: object, attribute: attrs.Attribute[str], value: object) -> None:
    if not isinstance(value, str):
        raise TypeError(f"MonitorConfig.{attribute.name} must be a str, got {type(value).__name__}")


@attrs.frozen(kw_only=True)
class MonitorConfig:
    """One monitor: ``kind`` "tensorboard" (a ``SummaryWriter`` event file) or "csv"
    (one CSV file per number), written by rank 0 under ``log_dir``."""

    kind: str = attrs.field(validator=_check_kind)
    output_path: str = attrs.field(default="", validator=_check_str)
    job_name: str = attrs.field(default=DEFAULT_JOB_NAME, validator=_check_str)

    @property
    def log_dir(self) -> str:
        """``output_path/job_name``, DeepSpeed's folder (relative to the working directory when
        ``output_path`` is, as DeepSpeed's default "" is)."""
        return os.path.join(self.output_path, self.job_name)

    @classmethod
    def from_json(cls, section: str, value: Any) -> MonitorConfig | None:
        """DeepSpeed's ``tensorboard`` or ``csv_monitor`` section; None when it is not enabled."""
        if not isinstance(value, Mapping):
            raise TypeError(f"{section} must be a dict like {{\"enabled\": true, \"output_path\": \"logs/\"}}, "
                            f"got {type(value).__name__}")
        extra = sorted(k for k in value if k not in _KEYS)
        if extra:
            raise ValueError(f"unsupported DeepSpeed config keys: {', '.join(f'{section}.{k}' for k in extra)} "
                             f"({section} takes {', '.join(sorted(_KEYS))})")
        enabled = value.get("enabled", False)
        if not isinstance(enabled, bool):
            raise TypeError(f"{section}.enabled must be true or false, got {enabled!r}")
        if not enabled:
            return None
        try:
            return cls(kind=KINDS[section], output_path=value.get("output_path", ""),
                       job_name=value.get("job_name", DEFAULT_JOB_NAME))
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{section}: {exc}") from None
