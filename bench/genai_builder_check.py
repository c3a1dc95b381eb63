"""Does `DecoderRunner` serve what onnxruntime-genai's model builder exports? A random-weight Llama (no download)
goes through `python -m onnxruntime_genai.models.builder` and the runner's logits are checked against the Hugging
Face model's, and a batch of sequences of different lengths against each sequence alone.

What it shows: the builder's CPU export computes attention with onnxruntime's `GroupQueryAttention` contrib op, fed
`seqlens_k = ReduceSum(attention_mask) - 1` and `total_sequence_length = attention_mask.shape[1]`; the kernel reads
row b's past at positions 0 .. seqlens_k[b] - 1 and takes the rotary position from there, so a batch of caches must
be RIGHT-padded (the runner detects the op and does so). The "left-padded" rows force the layout that suits
MatMul attention (tiny-lm, Optimum exports) onto the same model, to show what it would cost.

It needs torch, transformers and onnxruntime-genai, which the agent does not: run it from a separate venv, never the
project's (.venv), with the repository on the path for the runner. Tests do not import it. From the repository root:

    python3 -m venv /tmp/ogenai
    /tmp/ogenai/bin/pip install torch onnxruntime-genai transformers onnx onnx_ir
    PYTHONPATH=. /tmp/ogenai/bin/python bench/genai_builder_check.py

(A CPU build of torch is enough: a local CPU wheel, `pip install /path/to/torch-...+cpu-...whl`, saves the CUDA
wheels PyPI's torch pulls in. `onnx_ir` is a module the builder imports without declaring it. Checked with
onnxruntime-genai 0.18.0, onnxruntime 1.32.0, transformers 5.24.0, torch 2.13.0+cpu.) `--precisions fp32,int4,fp16`
is the default: fp32 and int4 are the builder's CPU exports, fp16 its CUDA one (float16 KV cache and logits), which
onnxruntime's CPU provider runs as well. About 30 s on two cores.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edge_agent.generation.runner import DecoderConfig, DecoderRunner

EXECUTION_PROVIDER = {"fp32": "cpu", "int4": "cpu", "int8": "cpu", "fp16": "cuda"}  # what the builder accepts
PROMPTS = (3, 11, 7, 1)  # tokens in each sequence's prompt: a batch of different lengths
STEPS = 12  # greedy tokens each sequence decodes, batched and alone


def build_llama(folder: Path, *, hidden: int, layers: int, heads: int, kv_heads: int, vocab: int, seed: int) -> Any:
    """A random-weight Llama and a word-level tokenizer, saved as a Hugging Face checkpoint; returns the model."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=256,
                         bos_token_id=1, eos_token_id=[2, 3], pad_token_id=0, tie_word_embeddings=False,
                         initializer_range=0.05)  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(folder)
    words = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=words, bos_token="t1", eos_token="t2", pad_token="t0",
                            unk_token="t0").save_pretrained(folder)  # fmt: skip
    return model


def export(hf: Path, out: Path, precision: str, cache: Path) -> float:
    """Run the model builder; the seconds it took."""
    command = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o", str(out),
               "-p", precision, "-e", EXECUTION_PROVIDER[precision], "-c", str(cache)]  # fmt: skip
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0 or not (out / "model.onnx").exists():
        sys.exit(f"the builder failed ({' '.join(command)}):\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return time.perf_counter() - started


def describe(out: Path) -> None:
    """The export's inputs, outputs and attention op, and the genai_config.json fields the runner reads."""
    import onnx

    model = onnx.load(str(out / "model.onnx"), load_external_data=False)
    kinds = {t.name: onnx.TensorProto.DataType.Name(t.type.tensor_type.elem_type) for t in model.graph.input}
    kinds_out = {t.name: onnx.TensorProto.DataType.Name(t.type.tensor_type.elem_type) for t in model.graph.output}
    ops = sorted({f"{n.domain or 'ai.onnx'}:{n.op_type}" for n in model.graph.node if "Attention" in n.op_type})
    print(f"  inputs:  {', '.join(f'{k} {v}' for k, v in kinds.items() if '.1.' not in k)}")
    print(f"  outputs: {', '.join(f'{k} {v}' for k, v in kinds_out.items() if '.1.' not in k)}")
    print(f"  attention: {', '.join(ops)}")
    config = json.loads((out / "genai_config.json").read_text())
    decoder = config["model"]["decoder"]
    print(f"  genai_config: eos_token_id={config['model']['eos_token_id']} "
          f"pad_token_id={config['model'].get('pad_token_id')} inputs={decoder['inputs']} "
          f"past_present_share_buffer={config['search'].get('past_present_share_buffer')}")  # fmt: skip


def hf_last_logits(model: Any, tokens: list[int]) -> np.ndarray:
    import torch

    with torch.no_grad():
        return np.asarray(model(torch.tensor([tokens])).logits[0, -1].float().numpy())


def check(runner: DecoderRunner, hf: Any, prompts: list[list[int]]) -> list[tuple[str, float]]:
    """(check, max |difference|) rows for one export."""
    rows: list[tuple[str, float]] = []
    firsts = [int(np.argmax(hf_last_logits(hf, p))) for p in prompts]
    references = [hf_last_logits(hf, [*p, first]) for p, first in zip(prompts, firsts, strict=True)]
    # Each alone: whole prompt, then one decode step, against the HF model.
    alone: list[np.ndarray] = []
    prefill_hf = decode_hf = 0.0
    for row, prompt in enumerate(prompts):
        logits = runner.prefill(("alone", row), prompt)
        prefill_hf = max(prefill_hf, float(np.abs(logits - hf_last_logits(hf, prompt)).max()))
        alone.append(runner.decode([("alone", row)], [firsts[row]])[0])
        decode_hf = max(decode_hf, float(np.abs(alone[-1] - references[row]).max()))
        runner.release(("alone", row))
    rows += [("prefill alone vs HF", prefill_hf), ("decode alone vs HF", decode_hf)]
    # Chunked prefill (4 tokens a call after the cache), then one batched decode of all, against each alone and HF.
    for padding in (runner.padding, "left" if runner.padding == "right" else "right"):
        chosen, runner.padding = runner.padding, padding
        for row, prompt in enumerate(prompts):
            for start in range(0, len(prompt), 4):
                runner.prefill(row, prompt[start : start + 4])
        batched = runner.decode(list(range(len(prompts))), firsts)
        solo = max(float(np.abs(batched[r] - alone[r]).max()) for r in range(len(prompts)))
        vs_hf = max(float(np.abs(batched[r] - references[r]).max()) for r in range(len(prompts)))
        forced = "" if padding == chosen else " (forced)"
        rows += [(f"batch {padding}-padded{forced} vs alone", solo), (f"batch {padding}-padded{forced} vs HF", vs_hf)]
        for row in range(len(prompts)):
            runner.release(row)
        runner.padding = chosen
    # Greedy: STEPS tokens batched (continuous) against each alone; the count of tokens that differ.
    expected = []
    for row, prompt in enumerate(prompts):
        tokens = [int(runner.prefill(("g", row), prompt).argmax())]
        while len(tokens) < STEPS:
            tokens.append(int(runner.decode([("g", row)], [tokens[-1]])[0].argmax()))
        runner.release(("g", row))
        expected.append(tokens)
    produced = [[int(runner.prefill(row, prompt).argmax())] for row, prompt in enumerate(prompts)]
    while len(produced[0]) < STEPS:
        logits = runner.decode(list(range(len(prompts))), [t[-1] for t in produced])
        for row, tokens in enumerate(produced):
            tokens.append(int(logits[row].argmax()))
    for row in range(len(prompts)):
        runner.release(row)
    differing = sum(a != b for e, p in zip(expected, produced, strict=True) for a, b in zip(e, p, strict=True))
    rows.append((f"greedy {STEPS} tokens x {len(prompts)}: batched tokens != alone", float(differing)))
    return rows


def genai_greedy(out: Path, prompt: list[int], steps: int) -> list[int]:
    """onnxruntime-genai's own greedy tokens for `prompt` (its runtime on the same export), EOS ignored."""
    import onnxruntime_genai as og

    config = og.Config(str(out))
    config.clear_providers()  # its CPU provider, also for the fp16 export made for CUDA
    model = og.Model(config)
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + steps, min_length=len(prompt) + steps, do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens(np.asarray([prompt], np.int32))
    while not generator.is_done():
        generator.generate_next_token()
    return [int(t) for t in generator.get_sequence(0)[len(prompt) :]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--precisions", default="fp32,int4,fp16")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", type=Path, default=None, help="keep the checkpoint and exports here")
    args = parser.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="genai-builder-"))
    hf = build_llama(work / "hf", hidden=args.hidden, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads,
                     vocab=args.vocab, seed=args.seed)  # fmt: skip
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(4, args.vocab, size=n).tolist() for n in PROMPTS]
    print(f"random Llama: hidden {args.hidden}, {args.layers} layers, {args.heads} heads, {args.kv_heads} KV heads, "
          f"vocab {args.vocab}; prompts of {list(PROMPTS)} tokens")  # fmt: skip
    table: list[tuple[str, str, str, float]] = []
    for precision in args.precisions.split(","):
        out = work / precision
        seconds = export(work / "hf", out, precision, work / "cache")
        print(f"\n{precision} (-e {EXECUTION_PROVIDER[precision]}), built in {seconds:.1f} s: {out}")
        describe(out)
        runner = DecoderRunner(DecoderConfig.load(out))
        fed = {i.name for i in runner.session.get_inputs()}
        print(f"  runner: padding {runner.padding}, KV {runner.kv_dtype}, eos_ids {runner.config.eos_ids}, "
              f"position_ids fed: {runner.config.names['position_ids'] in fed}")  # fmt: skip
        scale = float(np.abs(hf_last_logits(hf, prompts[1])).max())
        for name, value in check(runner, hf, prompts):
            table.append((precision, runner.padding, name, value))
        ours = [int(runner.prefill("o", prompts[1]).argmax())]
        while len(ours) < STEPS:
            ours.append(int(runner.decode(["o"], [ours[-1]])[0].argmax()))
        runner.release("o")
        theirs = genai_greedy(out, prompts[1], STEPS)
        table.append((precision, runner.padding, f"greedy {STEPS} tokens: ours != onnxruntime-genai's",
                      float(sum(a != b for a, b in zip(ours, theirs, strict=True)))))  # fmt: skip
        table.append((precision, runner.padding, "HF logit scale: max abs logit", scale))
    print("\n| export | layout | check | max abs diff (or count) |\n| --- | --- | --- | --- |")
    for precision, layout, name, value in table:
        shown = f"{int(value)}" if "!=" in name else f"{value:.2e}"
        print(f"| {precision} | {layout} | {name} | {shown} |")


if __name__ == "__main__":
    main()
