"""Shared by the generative tests: what a prompt decodes greedily on its own, the reference that batching,
chunking, preemption and streaming must not change."""

from __future__ import annotations

from edge_agent.generation import DecoderRunner


def greedy_alone(runner: DecoderRunner, prompt: list[int], steps: int) -> list[int]:
    """`steps` greedy tokens of `prompt` run alone on `runner` (its cache released after)."""
    key = ("alone", tuple(prompt))
    token = int(runner.prefill(key, prompt).argmax())
    out = [token]
    while len(out) < steps:
        token = int(runner.decode([key], [token])[0].argmax())
        out.append(token)
    runner.release(key)
    return out
