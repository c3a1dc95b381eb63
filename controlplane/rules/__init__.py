"""The control loop: degradation rules evaluated against telemetry, composed into per-agent policy documents.

Other packages import what `__all__` names, from here; the modules are this package's own business."""

from controlplane.rules.loop import ControlLoop, CycleReport, Leadership, PolicyDefaults, current_policy
from controlplane.rules.policy import stepped_action

__all__ = ["ControlLoop", "CycleReport", "Leadership", "PolicyDefaults", "current_policy", "stepped_action"]
