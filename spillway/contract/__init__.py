"""The wire contract between the edge agent and the control plane, importing nothing else of ours.

- `names`: metric, attribute, outcome, reason and header names, as constants and `Literal` types;
- `v2`: the Open Inference Protocol (KServe V2) tensor codec with Triton's binary extension, and the request
  header parsing both sides share (`Inference-Header-Content-Length`, `Spillway-Timeout-Us`, `timeout`);
- `policy`: the policy document the control plane writes and the agent applies;
- `spec`: what a model is (Triton's model config, normalised): tensor specs, batching, queue and version policies.
"""

from spillway.contract import names, policy, spec, v2

__all__ = ["names", "policy", "spec", "v2"]
