"""The peers of `generate.py`: small servers of the same OpenAI completions API (`POST /v1/completions`, streamed as
server-sent events in the agent's shape, `stream_options.include_usage`, vLLM's `ignore_eos`) on the same
`DecoderRunner` (the agent's runner class, and nothing else of the agent) with the same onnxruntime threads, that
differ from the agent only in how they schedule:

- `naive`: one request at a time, first come first served: its prompt in one prefill, then one decode call per
  token until it ends; only then the next request;
- `static`: up to `--max-batch` waiting requests as one batch (whatever waits when the last batch ends; it does
  not wait to fill one): each prompt prefilled, then one decode call for all of them per token until every one of
  the batch has ended (a finished row leaves the call, which only makes the peer faster); requests that arrive
  meanwhile wait for the next batch.

One model thread owns the runner (like the agent's engine thread); the event loop only moves tokens. Decoding is
greedy (argmax: the bench asks for `temperature` 0); `priority` and `timeout` are accepted and ignored. Tokens
become text with the tokenizer of the model's folder, a short window at a time (the agent's incremental
detokenization, written out here), and a token that completes no text sends no event (as the agent does).
`GET /health` answers 200; `GET /status` the model thread's timing: steps, seconds per step and in `session.run`.

    python bench/generate_peers.py --mode static --model DIR/tiny-lm-bench/1 --port 8102 --intra-op-threads 1
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import uvicorn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the repository's packages
from edge_agent.generation.runner import DecoderConfig, DecoderRunner
from edge_agent.generation.text import IncrementalText

Send = Callable[[dict[str, Any]], Awaitable[None]]
Receive = Callable[[], Awaitable[dict[str, Any]]]


@dataclass(eq=False)
class Job:
    """One request: its prompt, how many tokens to make, and the queue its events go to (on the event loop)."""

    prompt: list[int]
    max_tokens: int
    ignore_eos: bool
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue[tuple[str, int, str | None]] = field(default_factory=asyncio.Queue)
    tokens: list[int] = field(default_factory=list)  # generated
    text: IncrementalText | None = None  # the agent's incremental detokenization, on the model's tokenizer
    cancelled: bool = False


class ModelThread:
    """The model's thread: takes up to `max_batch` waiting jobs, runs them to their end, then the next ones."""

    def __init__(self, runner: DecoderRunner, tokenizer: Any, eos: set[int], context: int, max_batch: int) -> None:
        self.runner, self.tokenizer, self.eos, self.context = runner, tokenizer, eos, context
        self.max_batch = max_batch
        self.waiting: deque[Job] = deque()
        self.ready = threading.Condition()
        self.steps, self.step_s, self.batches, self.requests = 0, 0.0, 0, 0
        threading.Thread(target=self._serve, name="model", daemon=True).start()

    def submit(self, job: Job) -> None:
        with self.ready:
            self.waiting.append(job)
            self.ready.notify()

    def _serve(self) -> None:
        while True:
            with self.ready:
                while not self.waiting:
                    self.ready.wait()
                taken = [self.waiting.popleft() for _ in range(min(self.max_batch, len(self.waiting)))]
            batch = [job for job in taken if not job.cancelled]  # its client left while it waited
            if not batch:
                continue
            self.batches += 1
            self.requests += len(batch)
            try:
                self._run(batch)
            except Exception as exc:  # a model failure ends the batch's streams, never the thread
                for job in batch:
                    self._post(job, "", 0, f"error: {type(exc).__name__}: {exc}")
            finally:
                for job in batch:
                    self.runner.release(id(job))

    def _run(self, batch: list[Job]) -> None:
        active: list[Job] = []
        for job in batch:  # each prompt in one prefill, its first token out at once
            started = time.perf_counter()
            logits = self.runner.prefill(id(job), job.prompt)
            if self._append(job, int(np.argmax(logits))):
                active.append(job)
            self._count(started)
        while active:
            started = time.perf_counter()
            active = [job for job in active if not self._cancelled(job)]
            if not active:
                break
            logits = self.runner.decode([id(job) for job in active], [job.tokens[-1] for job in active])
            active = [job for row, job in enumerate(active) if self._append(job, int(np.argmax(logits[row])))]
            self._count(started)

    def _count(self, started: float) -> None:
        self.steps += 1
        self.step_s += time.perf_counter() - started

    def _cancelled(self, job: Job) -> bool:
        if job.cancelled:
            self._post(job, "", 0, "cancelled")
        return job.cancelled

    def _append(self, job: Job, token: int) -> bool:
        """Hand the token's text to the job's stream; False when the job has ended."""
        job.tokens.append(token)
        if token in self.eos and not job.ignore_eos:
            self._post(job, "", 1, "stop")
            return False
        new = self._detokenize(job, token)
        if len(job.tokens) >= job.max_tokens or len(job.prompt) + len(job.tokens) >= self.context:
            self._post(job, new, 1, "length")
            return False
        self._post(job, new, 1, None)
        return True

    def _detokenize(self, job: Job, token: int) -> str:
        """The text this token completes (never half a character)."""
        if job.text is None:
            job.text = IncrementalText(self.tokenizer)
        return job.text.push(token)

    def _post(self, job: Job, text: str, tokens: int, finish: str | None) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            job.loop.call_soon_threadsafe(job.events.put_nowait, (text, tokens, finish))

    def status(self) -> dict[str, Any]:
        model_s = self.runner.run_s
        return {"steps": self.steps, "step_s": round(self.step_s, 6), "model_s": round(model_s, 6),
                "overhead_share": round((self.step_s - model_s) / self.step_s, 4) if self.step_s else 0.0,
                "batches": self.batches, "requests": self.requests, "waiting": len(self.waiting)}  # fmt: skip


class CompletionsApp:
    """The ASGI app: `/v1/completions` (streaming), `/health`, `/status`."""

    def __init__(self, folder: Path, mode: str, threads: int, max_batch: int, name: str) -> None:
        from tokenizers import Tokenizer

        config = DecoderConfig.load(folder)
        self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        self.context = config.context
        self.name = name
        self.mode = mode
        eos = json.loads((folder / "genai_config.json").read_text())["model"]["eos_token_id"]
        self.model = ModelThread(DecoderRunner(config, threads=threads), self.tokenizer,
                                 set(eos) if isinstance(eos, list) else {eos}, config.context,
                                 1 if mode == "naive" else max_batch)  # fmt: skip

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # lifespan is off
            return
        path, method = scope["path"], scope["method"]
        if method == "GET" and path == "/health":
            await _respond(send, 200, b'{"ready":true}')
        elif method == "GET" and path == "/status":
            await _respond(send, 200, json.dumps({"mode": self.mode, "timing": self.model.status()}).encode())
        elif method == "POST" and path == "/v1/completions":
            await self._complete(receive, send)
        else:
            await _respond(send, 404, b'{"error":{"message":"not found"}}')

    async def _complete(self, receive: Receive, send: Send) -> None:
        raw = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            raw += message.get("body", b"")
            if not message.get("more_body"):
                break
        try:
            body = json.loads(raw)
            prompt = self.tokenizer.encode(body["prompt"], add_special_tokens=False).ids
            max_tokens = int(body.get("max_tokens", 16))
            fits = len(prompt) > 0 and max_tokens > 0 and len(prompt) + max_tokens <= self.context
            if not fits or body.get("stream") is not True:
                raise ValueError("a non-empty prompt, max_tokens within the context and stream: true")
        except (KeyError, TypeError, ValueError) as exc:
            error = {"error": {"message": f"bad request: {exc}", "type": "invalid_request_error"}}
            await _respond(send, 400, json.dumps(error).encode())
            return
        options = body.get("stream_options")
        usage = isinstance(options, dict) and options.get("include_usage") is True
        job = Job(list(prompt), max_tokens, body.get("ignore_eos") is True, asyncio.get_running_loop())
        self.model.submit(job)
        watcher = asyncio.ensure_future(_watch_disconnect(receive, job))
        try:
            await self._stream(send, job, usage)
        finally:
            watcher.cancel()
            job.cancelled = True  # no-op once it ended; a stream that ends early frees its place

    async def _stream(self, send: Send, job: Job, usage: bool) -> None:
        headers = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        ident, created, first = "cmpl-" + uuid.uuid4().hex, int(time.time()), True

        async def event(payload: dict[str, Any] | str) -> None:
            data = payload if isinstance(payload, str) else json.dumps(payload)
            await send({"type": "http.response.body", "body": f"data: {data}\n\n".encode(), "more_body": True})

        while True:
            text, _, finish = await job.events.get()
            if finish is not None and finish.startswith("error"):
                await event({"error": {"message": finish, "type": "server_error"}})
                break
            if not text and finish is None and not first:
                continue
            reason = None if finish is None else "length" if finish == "length" else "stop"
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
            await event({"id": ident, "object": "text_completion", "created": created, "model": self.name,
                         "choices": [choice]})  # fmt: skip
            first = False
            if finish is not None:
                break
        if usage:
            counts = {"prompt_tokens": len(job.prompt), "completion_tokens": len(job.tokens),
                      "total_tokens": len(job.prompt) + len(job.tokens)}  # fmt: skip
            await event({"id": ident, "object": "text_completion", "created": created, "model": self.name,
                         "choices": [], "usage": counts})  # fmt: skip
        await event("[DONE]")
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _respond(send: Send, status: int, body: bytes) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _watch_disconnect(receive: Receive, job: Job) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    job.cancelled = True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=("naive", "static"), required=True)
    parser.add_argument("--model", type=Path, required=True, help="a decoder version's folder (genai_config.json)")
    parser.add_argument("--name", default="tiny-lm-bench", help="the model name its answers carry")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--intra-op-threads", type=int, default=1)
    parser.add_argument("--max-batch", type=int, default=8, help="static: the most requests in one batch")
    args = parser.parse_args()
    app = CompletionsApp(args.model, args.mode, args.intra_op_threads, args.max_batch, args.name)
    # The agent's uvicorn options (edge_agent/serving/server.py): uvloop and httptools when installed.
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False, server_header=False,
                lifespan="off")  # fmt: skip


if __name__ == "__main__":
    main()
