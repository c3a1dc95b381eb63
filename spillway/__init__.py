"""Spillway: keep AI inference on edge devices inside its SLOs.

The umbrella package holds what every part shares and nothing that serves: `spillway.contract` (the wire contract
that the edge agent and the control plane both import), `spillway.cli` (the one `spillway` command) and
`spillway.demo` (the demo stories, burst clients, demo model builders and the process harness that the demo, the
tests and the benchmarks share). The services are `edge_agent` (installs alone), `controlplane` and `dashboards`.
"""

__version__ = "0.2.0"

__all__ = ["__version__"]
