"""`SGLangEngine`: a `RolloutEngine` over SGLang HTTP workers (or `megatron-pdm serve`, which speaks the same API).

Prompts are spread round-robin over the live workers, one request per prompt carrying its n samples. A request
that times out or fails is retried with exponential backoff; a worker that keeps failing is dropped (logged)
and its prompts are re-sent to the others. Each prompt's result is recorded once, so none is lost or scored
twice. Responses are validated (ids in range, finite log-probs, K as asked) and must carry the weight version
the trainer pushed last, so that a rollout is never scored against the wrong weights.
"""

from __future__ import annotations

import json
import logging
import math
import time
import urllib.error
import urllib.request
from collections import deque
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path

import torch

from .base import RolloutSample, SamplingParams
from .health import is_healthy, wait_healthy

log = logging.getLogger(__name__)


class WorkerError(RuntimeError):
    pass


def _post(url: str, path: str, body: dict, timeout: float):
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace")
        if 400 <= e.code < 500:  # the request is wrong: retrying elsewhere will not help
            raise ValueError(f"{url}{path}: HTTP {e.code}: {detail}") from None
        raise WorkerError(f"{url}{path}: HTTP {e.code}: {detail}") from None
    except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as e:
        raise WorkerError(f"{url}{path}: {e}") from None


def parse_generate_output(out: dict, *, prompt_index: int, prompt_ids: list[int], k: int, vocab_size: int,
                          weight_version: int) -> RolloutSample:
    """One SGLang `/generate` output -> RolloutSample; ValueError naming the field when malformed."""
    where = f"generate output for prompt {prompt_index}"
    if not isinstance(out, dict) or not isinstance(out.get("meta_info"), dict):
        raise ValueError(f"{where}: meta_info: missing")
    meta = out["meta_info"]
    tok, top = meta.get("output_token_logprobs"), meta.get("output_top_logprobs")
    if not isinstance(tok, list):
        raise ValueError(f"{where}: meta_info.output_token_logprobs: missing (was return_logprob sent?)")
    if not isinstance(top, list) or len(top) != len(tok):
        raise ValueError(f"{where}: meta_info.output_top_logprobs: expected {len(tok)} positions, got "
                         f"{len(top) if isinstance(top, list) else type(top).__name__}")
    ids, lps, top_ids, top_lps = [], [], [], []
    for t, (entry, row) in enumerate(zip(tok, top, strict=True)):
        try:
            lp, tid = float(entry[0]), int(entry[1])
        except (TypeError, ValueError, IndexError):
            raise ValueError(f"{where}: meta_info.output_token_logprobs[{t}]: expected [logprob, id, text], got "
                             f"{entry!r}") from None
        if not isinstance(row, list) or len(row) != k:
            raise ValueError(f"{where}: meta_info.output_top_logprobs[{t}]: expected {k} entries, got "
                             f"{len(row) if isinstance(row, list) else row!r}")
        ids.append(tid)
        lps.append(lp)
        top_ids.append([int(x[1]) for x in row])
        top_lps.append([float(x[0]) for x in row])
    for name, vals in (("output_token_logprobs", ids), ("output_top_logprobs", sum(top_ids, []))):
        bad = [v for v in vals if not 0 <= v < vocab_size]
        if bad:
            raise ValueError(f"{where}: meta_info.{name}: token id {bad[0]} outside [0, {vocab_size})")
    for name, vals in (("output_token_logprobs", lps), ("output_top_logprobs", sum(top_lps, []))):
        bad = [v for v in vals if not (math.isfinite(v) and v <= 1e-3)]
        if bad:
            raise ValueError(f"{where}: meta_info.{name}: log-prob {bad[0]} is not finite and <= 0")
    version = meta.get("weight_version")
    if version is not None and int(version) != weight_version:
        raise ValueError(f"{where}: meta_info.weight_version: {version}, but the trainer pushed {weight_version}")
    finish = (meta.get("finish_reason") or {}).get("type", "length")
    L = len(ids)
    return RolloutSample(
        prompt_index=prompt_index, prompt_ids=list(prompt_ids), response_ids=torch.tensor(ids, dtype=torch.long),
        token_logprobs=torch.tensor(lps, dtype=torch.float32),
        topk_ids=torch.tensor(top_ids, dtype=torch.long).reshape(L, k),
        topk_logprobs=torch.tensor(top_lps, dtype=torch.float32).reshape(L, k),
        finish_reason="stop" if finish == "stop" else "length", weight_version=weight_version,
    )


class SGLangEngine:
    """`RolloutEngine` over the SGLang workers at `urls` (http://host:port) serving `model_config`'s model;
    weight updates are HF exports written under `weight_dir` (a directory every worker can read)."""

    def __init__(self, urls: list[str], model_config, *, weight_dir, timeout: float = 60.0, retries: int = 2,
                 backoff: float = 0.5):
        if not urls:
            raise ValueError("urls: at least one SGLang worker URL is needed")
        self.urls = [u.rstrip("/") for u in urls]
        self.alive = list(self.urls)
        self.model_config, self.vocab_size = model_config, model_config.vocab_size
        self.weight_dir = Path(weight_dir)
        self.timeout, self.retries, self.backoff = timeout, retries, backoff
        self.weight_version = -1
        self.released = False

    def health(self) -> bool:
        ok = []
        for url in self.alive:
            if is_healthy(url, self.timeout):
                ok.append(url)
            else:
                log.warning("dropping SGLang worker %s: health check failed", url)
        self.alive = ok
        return bool(ok)

    def wait_ready(self, deadline_s: float = 120.0) -> None:
        wait_healthy(self.urls, deadline_s=deadline_s, poll_s=0.2)

    def _call(self, url, path, body):
        """POST with retries and exponential backoff; WorkerError when the worker keeps failing."""
        for attempt in range(self.retries + 1):
            try:
                return _post(url, path, body, self.timeout)
            except WorkerError:
                if attempt == self.retries:
                    raise
                time.sleep(self.backoff * 2**attempt)

    def update_weights(self, state: dict, version: int) -> None:
        """Export the HF-layout state to weight_dir/v<version> and load it on every live worker from disk (taking
        the workers' memory back first if it was released)."""
        from megatron_pdm.models.hf import save_hf_checkpoint

        failed = []
        path = self.weight_dir / f"v{version:06d}"
        save_hf_checkpoint(path, state, self.model_config)
        self.resume_memory()
        for url in list(self.alive):
            try:
                self._call(url, "/pause_generation", {})
                out = self._call(url, "/update_weights_from_disk",
                                 {"model_path": str(path), "weight_version": str(version)})
                self._call(url, "/continue_generation", {})
                if not out.get("success"):
                    failed.append(f"{url}: {out}")
            except WorkerError as e:
                log.warning("dropping SGLang worker %s: weight update failed (%s)", url, e)
                self.alive.remove(url)
        if failed:
            raise RuntimeError(f"update_weights_from_disk failed: {failed}")
        if not self.alive:
            raise RuntimeError("update_weights: no SGLang worker left")
        self.weight_version = version

    def release_memory(self) -> None:
        """Colocated engines: free the weights and KV cache on every worker while the trainer uses the GPUs."""
        self._broadcast("/release_memory_occupation")
        self.released = True

    def resume_memory(self) -> None:
        """Take the memory back (before the next weight update); a no-op unless released."""
        if self.released:
            self._broadcast("/resume_memory_occupation")
            self.released = False

    def _broadcast(self, path: str) -> None:
        for url in list(self.alive):
            try:
                self._call(url, path, {})
            except WorkerError as e:
                log.warning("dropping SGLang worker %s: %s failed (%s)", url, path, e)
                self.alive.remove(url)
        if not self.alive:
            raise RuntimeError(f"{path}: no SGLang worker left")

    def _request(self, prompt: list[int], params: SamplingParams, seed: int | None) -> dict:
        return {
            "input_ids": [prompt] * params.n,
            "sampling_params": {"temperature": params.temperature, "max_new_tokens": params.max_new_tokens,
                                "top_p": 1.0, "top_k": -1, "stop_token_ids": list(params.stop_token_ids),
                                **({"sampling_seed": seed} if seed is not None else {})},
            "return_logprob": True,
            "top_logprobs_num": params.top_k_logprobs,
            "logprob_start_len": -1,  # response positions only
        }

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[RolloutSample]:
        if self.weight_version < 0:
            raise RuntimeError("generate: no weights pushed yet (call update_weights first)")
        results: dict[int, list[RolloutSample]] = {}
        queue = deque(range(len(prompts)))
        with ThreadPoolExecutor(max_workers=max(1, len(self.alive))) as pool:
            running = {}
            while queue or running:
                if not self.alive:
                    raise RuntimeError(f"generate: every SGLang worker failed; {len(queue) + len(running)} prompts "
                                       "unanswered")
                busy = {url for url, _ in running.values()}
                for url in self.alive:
                    if queue and url not in busy:
                        i = queue.popleft()
                        seed = None if params.seed is None else params.seed * 1_000_003 + i
                        fut = pool.submit(self._call, url, "/generate", self._request(prompts[i], params, seed))
                        running[fut] = (url, i)
                done, _ = wait(running, return_when=FIRST_COMPLETED)
                for fut in done:
                    url, i = running.pop(fut)
                    try:
                        outs = fut.result()
                    except WorkerError as e:
                        log.warning("dropping SGLang worker %s (%s); re-sending prompt %d", url, e, i)
                        if url in self.alive:
                            self.alive.remove(url)
                        queue.appendleft(i)
                        continue
                    if i in results:  # answered already (cannot happen: one request per prompt at a time)
                        continue
                    outs = outs if isinstance(outs, list) else [outs]
                    if len(outs) != params.n:
                        raise ValueError(f"generate output for prompt {i}: expected {params.n} samples, got "
                                         f"{len(outs)}")
                    results[i] = [parse_generate_output(o, prompt_index=i, prompt_ids=prompts[i],
                                                        k=params.top_k_logprobs, vocab_size=self.vocab_size,
                                                        weight_version=self.weight_version) for o in outs]
        return [s for i in range(len(prompts)) for s in results[i]]

    def close(self) -> None:
        pass
