"""SGLang's `/generate` wire format (SGLang 0.5.23), both ends: the request body the client sends and the server
reads, and the response the server writes and the client parses. The client (`sglang.py`, its worker pool
`pool.py`) and `server.py` (`megatron-pdm serve`) share this module, so the two cannot drift apart.

Request: `input_ids` (one prompt, or one row per sample), `sampling_params` (one dict, or one per row, each with its
`sampling_seed`), `return_logprob`, `top_logprobs_num` K, `logprob_start_len` -1 (response positions only),
`return_routed_experts`. Response per row: `output_ids`, `meta_info` with `output_token_logprobs` =
[[logprob, id, text|null], ...], `output_top_logprobs` = [[[logprob, id, null] x K], ...], `finish_reason`
({"type": "stop" | "length" | "abort", ...}), `weight_version`, and with return_routed_experts `routed_experts` =
base64 of int32 [prompt + completion - 1, layers, top_k]. Log-probs are log_softmax(logits / T) of the distribution
sampled from, before any top-p / top-k truncation.
"""

from __future__ import annotations

import base64
import math

import torch

from ..base import RolloutSample, SamplingParams, TeacherScores

# /server_info "version" of `megatron-pdm serve` (SGLang's is its package version): how a client tells our server from
# SGLang (`transports.probe_engines`), which takes distributed weight updates into CPU tensors, over gloo only
SERVE_VERSION = "megatron-pdm serve"


class AbortedRequest(RuntimeError):
    """The engine aborted the request (finish_reason "abort") or changed weights during it: send it again."""


class WireError(ValueError):
    """A malformed request (the server answers HTTP 400)."""


# ---------------------------------------------------------------------------------------------- requests


def generate_request(prompt: list[int], params: SamplingParams, seeds: list[int] | None,
                     rows: tuple[int, ...] | None = None) -> dict:
    """The /generate body for samples `rows` (default: all n) of one prompt: one input row per sample, each with
    its own sampling_seed; a single sample (one row, also n = 1) as a single request with one sampling_params dict,
    which is all that sglang-router takes (0.3.2 answers a list with HTTP 422)."""
    rows = tuple(range(params.n)) if rows is None else rows
    sampling = {"temperature": params.temperature, "max_new_tokens": params.max_new_tokens,
                "top_p": params.top_p, "top_k": params.top_k, "stop_token_ids": list(params.stop_token_ids)}
    per_row = [sampling if seeds is None else {**sampling, "sampling_seed": seeds[j]} for j in rows]
    single = len(rows) == 1
    return {
        "input_ids": prompt if single else [prompt] * len(rows),
        "sampling_params": per_row[0] if single else per_row,
        "return_logprob": True,
        "top_logprobs_num": params.top_k_logprobs,
        "logprob_start_len": -1,  # response positions only
        **({"return_routed_experts": True} if params.return_routed_experts else {}),
    }


def score_request(sequence: list[int], start: int, top_k: int) -> dict:
    """The /generate body that asks for the teacher's top-K on positions [start, L) of `sequence`, prefill only:
    max_new_tokens 0 (SGLang 0.5.23's Req.is_prefill_only) and logprob_start_len start - 1, since SGLang's
    input_token_logprobs / input_top_logprobs from logprob_start_len s are one entry per input token s..L-1 whose
    first is null (a token's log-prob comes from the position before it, not computed), then the log-prob of token
    p under t(. | x_<p) and the top-K of that distribution (`_process_input_token_logprobs`)."""
    return {"input_ids": list(sequence), "sampling_params": {"max_new_tokens": 0, "temperature": 1.0},
            "return_logprob": True, "top_logprobs_num": top_k, "logprob_start_len": start - 1}


def checkpoint_eos_ids(directory, tokenizer_stop_ids=()) -> tuple[int, ...]:
    """The ids an SGLang engine launched from the HF checkpoint at `directory` stops every request at, besides the
    request's stop_token_ids (unless it says ignore_eos, which stops at no token): config.json's and
    generation_config.json's `eos_token_id` (an id or a list; SGLang's ModelConfig._get_hf_eos_token_id) and, when it
    loaded a tokenizer, the tokenizer's EOS (`tokenizer_stop_ids`: `Tokenizer.stop_ids`). Read once, at launch, as
    SGLang does."""
    import json
    from pathlib import Path

    from megatron_pdm.models.tokenizer import token_id_list

    found = list(tokenizer_stop_ids)
    for name in ("config.json", "generation_config.json"):
        path = Path(directory) / name
        found += token_id_list(json.loads(path.read_text()).get("eos_token_id") if path.is_file() else None)
    return tuple(dict.fromkeys(found))


def sampling_from_request(sp: dict, body: dict, eos_token_ids=()) -> SamplingParams:
    """One row's SamplingParams; it stops at `eos_token_ids` too (`checkpoint_eos_ids`), and with ignore_eos at no
    token at all, stop_token_ids neither (SGLang 0.5.23's Req._check_token_based_finish)."""
    k = int(body.get("top_logprobs_num", 1) or 1)
    top_k = int(sp.get("top_k", -1))
    stop = () if sp.get("ignore_eos") else (*(sp.get("stop_token_ids") or ()), *eos_token_ids)
    return SamplingParams(max_new_tokens=int(sp.get("max_new_tokens", 16)), n=1,
                          temperature=float(sp.get("temperature", 1.0)), top_k_logprobs=k,
                          stop_token_ids=tuple(dict.fromkeys(stop)), seed=sp.get("sampling_seed"),
                          top_p=float(sp.get("top_p", 1.0)), top_k=-1 if top_k == 0 else top_k,
                          return_routed_experts=bool(body.get("return_routed_experts")))


def request_rows(body: dict, eos_token_ids=()) -> tuple[list[tuple[list[int], SamplingParams]], bool]:
    """[(prompt, its sampling params)] per input row (`sampling_params` is one dict for all or one per row, each
    stopping at `eos_token_ids` too), and whether the request was a batch."""
    ids = body.get("input_ids")
    if not isinstance(ids, list) or not ids:
        raise WireError("input_ids: expected a list of token ids or a list of such lists")
    batch = isinstance(ids[0], list)
    prompts = ids if batch else [ids]
    sp = body.get("sampling_params") or {}
    if isinstance(sp, list) and len(sp) != len(prompts):
        raise WireError(f"sampling_params: {len(sp)} entries for {len(prompts)} input rows")
    rows = sp if isinstance(sp, list) else [sp] * len(prompts)
    try:
        out = [(p, sampling_from_request(s or {}, body, eos_token_ids)) for p, s in zip(prompts, rows, strict=True)]
    except ValueError as e:
        raise WireError(str(e)) from None
    return out, batch


# ---------------------------------------------------------------------------------------------- responses


def generate_output(s: RolloutSample, *, version: int, aborted: bool, logprobs: bool, decode=None) -> dict:
    """One response row as SGLang writes it. aborted: answered as a request aborted by /pause_generation
    (SGLang's FINISH_ABORT.to_json()); logprobs: the request's return_logprob; decode: ids -> text (None: no
    `text`, SGLang's --skip-tokenizer-init)."""
    if aborted:
        finish = {"type": "abort", "message": "Aborted by /pause_generation", "status_code": None, "err_type": None}
    elif s.finish_reason == "stop":
        finish = {"type": "stop", "matched": int(s.response_ids[-1])}
    else:
        finish = {"type": "length", "length": len(s.response_ids)}
    meta = {"id": f"{id(s):x}", "finish_reason": finish, "prompt_tokens": len(s.prompt_ids),
            "weight_version": str(version), "completion_tokens": len(s.response_ids), "cached_tokens": 0,
            "weight_versions": [{"version": str(v), "start": a, "end": b} for v, a, b in s.spans()]}
    if s.routed_experts is not None:
        meta["routed_experts"] = base64.b64encode(s.routed_experts.contiguous().numpy().tobytes()).decode()
    if logprobs:
        meta["input_token_logprobs"] = []  # logprob_start_len = -1: none for the prompt
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in
                                         zip(s.token_logprobs.tolist(), s.response_ids.tolist(), strict=True)]
        meta["output_token_logprobs_length"] = len(s.response_ids)
        meta["input_top_logprobs"] = []
        meta["output_top_logprobs"] = [[[lp, t, None] for lp, t in zip(lps, ids, strict=True)]
                                       for lps, ids in zip(s.topk_logprobs.tolist(), s.topk_ids.tolist(), strict=True)]
    text = {} if decode is None else {"text": decode(s.response_ids.tolist())}
    return {**text, "output_ids": s.response_ids.tolist(), "meta_info": meta}


def score_output(sequence: list[int], start: int, scores: TeacherScores | None, *, version: int,
                 aborted: bool = False) -> dict:
    """The answer to a prefill-only /generate (max_new_tokens 0) from logprob_start_len start - 1, as SGLang 0.5.23
    writes it: input_token_logprobs [[null, x_(start-1), null], [lp, x_p, null] for p in [start, L)],
    input_top_logprobs [null, [[lp, id, null] x K] per p], no output tokens, finish_reason length 0. scores: the
    engine's on [start, L) (None when that range is empty); aborted: finish_reason abort, as `generate_output`."""
    tok = [[None, sequence[start - 1], None]]
    top: list = [None]
    if scores is not None:
        tok += [[lp, t, None] for lp, t in zip(scores.token_logprobs.tolist(), sequence[start:], strict=True)]
        top += [[[lp, t, None] for lp, t in zip(lps, ids, strict=True)]
                for lps, ids in zip(scores.topk_logprobs.tolist(), scores.topk_ids.tolist(), strict=True)]
    finish = ({"type": "abort", "message": "Aborted by /pause_generation", "status_code": None, "err_type": None}
              if aborted else {"type": "length", "length": 0})
    meta = {"id": f"{id(tok):x}", "finish_reason": finish, "prompt_tokens": len(sequence),
            "weight_version": str(version), "completion_tokens": 0, "cached_tokens": 0, "weight_versions": [],
            "input_token_logprobs": tok, "output_token_logprobs": [], "output_token_logprobs_length": 0,
            "input_top_logprobs": top, "output_top_logprobs": []}
    return {"output_ids": [], "meta_info": meta}


def parse_score_output(out: dict, *, index: int, sequence: list[int], start: int, k: int,
                       vocab_size: int) -> TeacherScores:
    """One answer to `score_request` -> TeacherScores of positions [start, L); ValueError naming the field when
    malformed (an aborted request raises AbortedRequest: sent again). Entry 0 of SGLang's input lists is the null
    of token start - 1 and is dropped; each later entry's id must be the sequence's token there."""
    where = f"score output for sequence {index}"
    if not isinstance(out, dict) or not isinstance(out.get("meta_info"), dict):
        raise ValueError(f"{where}: meta_info: missing")
    meta = out["meta_info"]
    if (meta.get("finish_reason") or {}).get("type") == "abort":
        raise AbortedRequest(f"{where}: aborted ({(meta.get('finish_reason') or {}).get('message')})")
    n = len(sequence) - start
    tok, top = meta.get("input_token_logprobs"), meta.get("input_top_logprobs")
    for name, vals in (("input_token_logprobs", tok), ("input_top_logprobs", top)):
        if not isinstance(vals, list) or len(vals) != n + 1:
            raise ValueError(f"{where}: meta_info.{name}: expected {n + 1} entries (the first null), got "
                             f"{len(vals) if isinstance(vals, list) else type(vals).__name__} (was "
                             "logprob_start_len sent?)")
    lps, top_ids, top_lps = [], [], []
    for q in range(1, n + 1):
        lp, tid = _logprob_entry(tok[q], f"{where}: meta_info.input_token_logprobs[{q}]")
        if tid != sequence[start + q - 1]:
            raise ValueError(f"{where}: meta_info.input_token_logprobs[{q}]: token {tid}, but the sequence has "
                             f"{sequence[start + q - 1]} at position {start + q - 1}")
        row = top[q]
        if not isinstance(row, list) or len(row) != k:
            raise ValueError(f"{where}: meta_info.input_top_logprobs[{q}]: expected {k} entries, got "
                             f"{len(row) if isinstance(row, list) else row!r}")
        pairs = [_logprob_entry(x, f"{where}: meta_info.input_top_logprobs[{q}][{j}]") for j, x in enumerate(row)]
        lps.append(lp)
        top_ids.append([i for _, i in pairs])
        top_lps.append([v for v, _ in pairs])
    flat_ids, flat_lps = sum(top_ids, []), lps + sum(top_lps, [])
    bad = [v for v in flat_ids if not 0 <= v < vocab_size]
    if bad:
        raise ValueError(f"{where}: meta_info.input_top_logprobs: token id {bad[0]} outside [0, {vocab_size})")
    bad = [v for v in flat_lps if not (math.isfinite(v) and v <= 1e-3)]
    if bad:
        raise ValueError(f"{where}: meta_info.input_token_logprobs / input_top_logprobs: log-prob {bad[0]} is not "
                         "finite and <= 0")
    return TeacherScores(torch.tensor(lps, dtype=torch.float32),
                         torch.tensor(top_ids, dtype=torch.long).reshape(n, k),
                         torch.tensor(top_lps, dtype=torch.float32).reshape(n, k))


def _logprob_entry(entry, where: str) -> tuple[float, int]:
    """(log-prob, token id) of an engine's [logprob, id, text] entry; ValueError naming `where` for anything else
    (an id that is not an integer, a number too large for a float: OverflowError, not ValueError)."""
    try:
        return float(entry[0]), int(entry[1])
    except (TypeError, ValueError, IndexError, KeyError, OverflowError):
        raise ValueError(f"{where}: expected [logprob, id, text], got {str(entry)[:200]}") from None


def parse_generate_output(out: dict, *, prompt_index: int, prompt_ids: list[int], k: int, vocab_size: int,
                          weight_version: int, routed_experts: tuple[int, int, int] | None = None,
                          spans: bool = False, partial: bool = False) -> RolloutSample:
    """One SGLang `/generate` output -> RolloutSample; ValueError naming the field when malformed.
    routed_experts (layers, top_k, num_experts): parse meta_info.routed_experts too.

    Weight versions: by default every token must come from `weight_version`, the version pushed last (a response
    generated across an update raises AbortedRequest: sent again). With `spans`, updates may land mid-generation:
    meta_info.weight_versions ([{version, start, end}] over the output tokens) gives each token's version, none
    newer than `weight_version`. An aborted request raises AbortedRequest, or with `partial` comes back as a
    partial sample (finish_reason "abort") with the tokens generated before the abort."""
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
        lp, tid = _logprob_entry(entry, f"{where}: meta_info.output_token_logprobs[{t}]")
        if not isinstance(row, list) or len(row) != k:
            raise ValueError(f"{where}: meta_info.output_top_logprobs[{t}]: expected {k} entries, got "
                             f"{len(row) if isinstance(row, list) else row!r}")
        ids.append(tid)
        lps.append(lp)
        pairs = [_logprob_entry(x, f"{where}: meta_info.output_top_logprobs[{t}][{j}]") for j, x in enumerate(row)]
        top_ids.append([i for _, i in pairs])
        top_lps.append([v for v, _ in pairs])
    for name, vals in (("output_token_logprobs", ids), ("output_top_logprobs", sum(top_ids, []))):
        bad = [v for v in vals if not 0 <= v < vocab_size]
        if bad:
            raise ValueError(f"{where}: meta_info.{name}: token id {bad[0]} outside [0, {vocab_size})")
    for name, vals in (("output_token_logprobs", lps), ("output_top_logprobs", sum(top_lps, []))):
        bad = [v for v in vals if not (math.isfinite(v) and v <= 1e-3)]
        if bad:
            raise ValueError(f"{where}: meta_info.{name}: log-prob {bad[0]} is not finite and <= 0")
    L = len(ids)
    version = meta.get("weight_version")
    newest = weight_version if version is None else int(version)
    if newest > weight_version or (not spans and newest != weight_version):
        raise ValueError(f"{where}: meta_info.weight_version: {version}, but the trainer pushed {weight_version}")
    finish = (meta.get("finish_reason") or {}).get("type", "length")
    if finish == "abort" and not partial:
        raise AbortedRequest(f"{where}: aborted ({(meta.get('finish_reason') or {}).get('message')})")
    versions = _token_versions(meta.get("weight_versions") or [], L, where, newest=weight_version)
    if versions is not None and not spans and len(set(versions.tolist())) > 1:
        raise AbortedRequest(f"{where}: generated across weight versions {meta.get('weight_versions')}")
    if versions is not None and versions.numel():
        newest = int(versions[-1])
    routed = None
    if routed_experts is not None:
        routed = _routed_experts(meta.get("routed_experts"), where, positions=len(prompt_ids) + L - 1,
                                 layers=routed_experts[0], top_k=routed_experts[1], num_experts=routed_experts[2])
    return RolloutSample(
        prompt_index=prompt_index, prompt_ids=list(prompt_ids), response_ids=torch.tensor(ids, dtype=torch.long),
        token_logprobs=torch.tensor(lps, dtype=torch.float32),
        topk_ids=torch.tensor(top_ids, dtype=torch.long).reshape(L, k),
        topk_logprobs=torch.tensor(top_lps, dtype=torch.float32).reshape(L, k),
        finish_reason=finish if finish in ("stop", "abort") else "length", weight_version=newest,
        routed_experts=routed, token_versions=versions if spans else None,
    )


def _token_versions(spans, L: int, where: str, *, newest: int) -> torch.Tensor | None:
    """meta_info.weight_versions ([{version, start, end}], output tokens [start, end) each) -> [L] int64 versions,
    None when absent; ValueError unless the spans tile the L tokens in order with versions <= newest."""
    if not spans:
        return None
    out, at = [], 0
    for span in spans:
        try:
            v, a, b = int(span["version"]), int(span["start"]), int(span["end"])
        except (TypeError, KeyError, ValueError):
            raise ValueError(f"{where}: meta_info.weight_versions: expected {{version, start, end}}, got "
                             f"{span!r}") from None
        if a != at or b < a or v > newest:
            raise ValueError(f"{where}: meta_info.weight_versions: span {span!r} after token {at} (versions up to "
                             f"{newest})")
        out += [v] * (b - a)
        at = b
    if at != L:
        raise ValueError(f"{where}: meta_info.weight_versions: spans cover {at} of {L} tokens")
    return torch.tensor(out, dtype=torch.long)


def _routed_experts(data, where: str, *, positions: int, layers: int, top_k: int, num_experts: int) -> torch.Tensor:
    """meta_info.routed_experts (base64 of int32 [positions, layers, top_k], SGLang's encoding) -> a tensor."""
    if not isinstance(data, str):
        raise ValueError(f"{where}: meta_info.routed_experts: missing (was the server started with "
                         "--enable-return-routed-experts?)")
    try:
        raw = base64.b64decode(data, validate=True)
    except ValueError:
        raise ValueError(f"{where}: meta_info.routed_experts: not base64") from None
    if len(raw) != 4 * positions * layers * top_k:
        raise ValueError(f"{where}: meta_info.routed_experts: {len(raw)} bytes, expected int32 [{positions}, "
                         f"{layers}, {top_k}] = {4 * positions * layers * top_k}")
    routed = torch.frombuffer(bytearray(raw), dtype=torch.int32).reshape(positions, layers, top_k)
    if routed.numel() and not (0 <= int(routed.min()) and int(routed.max()) < num_experts):
        raise ValueError(f"{where}: meta_info.routed_experts: expert ids outside [0, {num_experts})")
    return routed
