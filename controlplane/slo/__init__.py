"""SLIs, error budgets and multiwindow burn rates, from the agents' metric rollups.

Other packages import what `__all__` names, from here: the evaluator's windows and the burn rate a rule condition
compares. The SLO arithmetic itself (SLI, budget, alert firing) is `controlplane.slo.maths`, pure and importable
alone."""

from controlplane.slo.maths import Counts, burn_rate
from controlplane.slo.windows import Evaluation, SloSpec, SloWindows

__all__ = ["Counts", "Evaluation", "SloSpec", "SloWindows", "burn_rate", "maths"]
