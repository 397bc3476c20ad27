"""`megatron-pdm serve`: the embedded engine behind the subset of SGLang's HTTP worker API that we use.

Same request and response schema as SGLang 0.5.23 (`/generate` with `return_logprob`, `top_logprobs_num`, one
`sampling_params` dict or one per input row; `meta_info.output_token_logprobs` = [[logprob, token_id, null], ...]
and `output_top_logprobs` = [[[logprob, id, null] x K], ...]), same log-prob semantics (log_softmax(logits / T)
of the distribution sampled from, `meta_info.routed_experts` = base64 of int32 [prompt + completion - 1, layers,
top_k] with `return_routed_experts`), plus `/health` (200, an empty body), `/model_info` (the weights served
now: `model_path`, `weight_version`) and `/server_info` (the launch's arguments, which updates do not change, as
SGLang's resolved server args; `quantization` is the --quantization flag, None for a pre-quantized checkpoint),
with their deprecated `/get_*` names, and no `/get_weight_version` (0.5.23 has none: 404), the three weight-update
routes (`/update_weights_from_disk`, `/init_weights_update_group` +
`/update_weights_from_distributed` + `/destroy_weights_update_group`, `/update_weights_from_tensor`; a failed one
answers HTTP 400 with `success: false`, as SGLang does; they run one at a time, as SGLang's scheduler runs them,
so that a second group's announcement waits while the first group's broadcast is received) and SGLang 0.5.23's
weight-update session around them
(`/begin_weight_update`, `/end_weight_update`: tensor and distributed updates are refused outside one, before
anything is received, as 0.5.23 refuses them; `begin` is refused while one is open, `end` while none is; a disk
update is taken inside one too, as 0.5.23 takes it), `/flush_cache` (text/plain, as SGLang), `/pause_generation`
(mode "abort", the default, aborts the requests in flight: they answer with finish_reason "abort"; "retract" /
"in_place" only hold new ones), `/continue_generation`, `/release_memory_occupation` and
`/resume_memory_occupation`. Every weight update may carry `weight_version`, which the server reports in each
response's meta_info, as SGLang does. Every request stops at the launch checkpoint's EOS ids too (config.json's and
generation_config.json's `eos_token_id`, the tokenizer's EOS; `wire.checkpoint_eos_ids`), and one whose sampling
params say `ignore_eos` at no token (its stop_token_ids neither), as SGLang's scheduler does. Every POST body is a
JSON object whose fields are each of the JSON type its handler reads (`BODIES`, checked before any handler runs);
anything else is answered HTTP 400 naming the field and its value.

An FP8 engine (`--quantization fp8`, or a checkpoint whose config.json has a block-FP8 `quantization_config`,
which SGLang serves as FP8 without the flag) takes block-FP8 weights only (float8_e4m3fn + `_scale_inv`), as an
SGLang FP8 engine does: plain linear weights in an update are refused with HTTP 400.

Test hooks (EngineServer(test_hooks=True), or $MEGATRON_PDM_SERVE_TEST_HOOKS=1 for `serve`):
`POST /megatron_pdm/faults {"fail_updates": k, "fail_group": g, "refuse_updates": r, "abort_generates": m,
"abort_after": c, "delay_generates": d, "delay_updates": u, "delay_s": s}` makes the next k weight updates fail with
HTTP 400 (a distributed one after its broadcast, as a failed load; with g, only distributed ones over a group whose
name contains g), the next r tensor or distributed updates refuse with HTTP
400 before receiving anything (as 0.5.23 refuses an update outside a session), the next m /generate requests answer
as requests aborted by a pause (with their first c tokens, the partial output SGLang returns, when c is given), the
next d /generate requests sleep s seconds before they start, and the next u disk updates sleep s seconds before
they load (a load slower than the client's update timeout). Every such call resets all of these, and the counts
of weight-update requests received (by route), which `GET /megatron_pdm/faults` reports with the hooks left. It
lets CPU CI exercise the real `SGLangEngine` client over loopback, failures included.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from megatron_pdm._validate import is_int, is_number
from megatron_pdm.models.hf import architecture_mismatches, is_mtp_key, load_hf_checkpoint
from megatron_pdm.models.tokenizer import has_tokenizer, load_tokenizer
from megatron_pdm.precision import FP8_SCALE_SUFFIX, fp8_quantizable

from ..embedded import EmbeddedEngine
from . import weight_transfer
from .fp8_export import is_block_fp8
from .wire import SERVE_VERSION, WireError, checkpoint_eos_ids, generate_output, request_rows, score_output

log = logging.getLogger(__name__)
TEST_HOOKS_ENV = "MEGATRON_PDM_SERVE_TEST_HOOKS"
PAUSE_MODES = ("abort", "retract", "in_place")
# The largest POST body read, on every route; a larger Content-Length is answered 413 before a byte of it is read
# (the body is held in memory whole, then decoded). The largest legitimate bodies are far below it: a tensor update's
# pickle of shared-memory handles is ~240 bytes a tensor (DeepSeek-V3's ~190k block-FP8 tensors in one bucket:
# ~45 MB), a distributed announcement ~80 bytes a tensor, a /generate request ~7 bytes a token id; weights
# themselves never travel in a body.
MAX_BODY_BYTES = 256 << 20
# SGLang 0.5.23's /flush_cache answer (text/plain)
FLUSHED = ("Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting requests, "
           "the operation will not be performed.)\n")
_DIGITS = re.compile(r"[0-9]+")
_INTEGER = re.compile(r"[+-]?[0-9]+")


class _BadRequest(ValueError):
    pass


class _BodyError(ValueError):
    """A POST whose body is not read (HTTP `code`): its Content-Length is malformed or above MAX_BODY_BYTES."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


def body_length(values: list[str] | None) -> int:
    """The body length that a request's Content-Length header(s) give: 0 without one (RFC 9112: a request without
    Content-Length or Transfer-Encoding has no body, as `curl -X POST` sends); _BodyError 400 for a value that is
    not a decimal integer >= 0 or for differing repeated headers, 413 above MAX_BODY_BYTES. Checked before any read:
    `rfile.read(-1)` reads until the client disconnects, and a huge length is allocated up front."""
    if not values:
        return 0
    if len(set(values)) > 1:
        raise _BodyError(f"Content-Length: differing values {values}", 400)
    value = values[0].strip()
    if not _DIGITS.fullmatch(value):
        raise _BodyError(f"Content-Length: {value!r} is not a non-negative integer", 400)
    length = int(value) if len(value) <= 18 else MAX_BODY_BYTES + 1  # more digits: over the cap, not parsed
    if length > MAX_BODY_BYTES:
        raise _BodyError(f"Content-Length: {value} bytes exceeds the limit of {MAX_BODY_BYTES} bytes "
                         "(serve's MAX_BODY_BYTES)", 413)
    return length


# -- request bodies: every field a handler reads, of its JSON type, checked once before any handler runs -----


@dataclass(frozen=True)
class Kind:
    """The JSON value a request field takes: `what` names it in a refusal; `convert(value, name)` returns what the
    handler reads, raising TypeError / ValueError for a value of another kind (nested kinds name their parts)."""

    what: str
    convert: Callable


def _integer(v, name=None) -> int:
    """A JSON integer, or a string holding one (SGLang sends weight_version as a string); not a bool or a float, and
    within int64 (token ids and seeds become torch.long tensors)."""
    if isinstance(v, str) and _INTEGER.fullmatch(v.strip()):
        v = int(v)
    if not is_int(v) or not -(2**63) <= v < 2**63:
        raise TypeError
    return v


def _exact(type_: type) -> Callable:
    """A value of that JSON type (bool: true or false, str: a string), as it is."""

    def convert(v, name=None):
        if not isinstance(v, type_):
            raise TypeError
        return v
    return convert


def _number(v, name=None) -> float:
    """A finite JSON number, not a bool (Python's json reads NaN and Infinity, which JSON has not)."""
    if not is_number(v) or not math.isfinite(v):
        raise TypeError
    return v


def _list_of(item: Callable) -> Callable:
    """A JSON array, each element converted by `item`."""

    def convert(v, name=None):
        if not isinstance(v, list):
            raise TypeError
        return [item(x) for x in v]
    return convert


def _token_ids(v, name=None) -> list:
    """One prompt (a list of token ids) or a batch (a list of such lists): never the two mixed."""
    rows = [x for x in v if isinstance(x, list)] if isinstance(v, list) else None
    if rows is None or (rows and len(rows) != len(v)):
        raise TypeError
    return [_list_of(_integer)(x) for x in v] if rows else _list_of(_integer)(v)


def _sampling(v, name: str):
    """One sampling-params object for every row, or one per row, each checked against SAMPLING_FIELDS."""
    if isinstance(v, dict):
        return _fields(v, SAMPLING_FIELDS, (), f"{name}.")
    if isinstance(v, list) and all(x is None or isinstance(x, dict) for x in v):
        return [_fields(x or {}, SAMPLING_FIELDS, (), f"{name}[{i}].") for i, x in enumerate(v)]
    raise TypeError


INT, NUMBER = Kind("an integer", _integer), Kind("a number", _number)
BOOL, STR = Kind("true or false", _exact(bool)), Kind("a string", _exact(str))
STRS, INTS = Kind("a list of strings", _list_of(_exact(str))), Kind("a list of integers", _list_of(_integer))
SHAPES = Kind("a list of shapes (lists of integers)", _list_of(_list_of(_integer)))
TOKEN_IDS = Kind("a list of token ids or a list of such lists", _token_ids)
SAMPLING = Kind("an object or a list of objects, one per input row", _sampling)
# SGLang's per-request sampling parameters that serve reads (wire.sampling_from_request)
SAMPLING_FIELDS = {"max_new_tokens": INT, "temperature": NUMBER, "top_p": NUMBER, "top_k": INT,
                   "stop_token_ids": INTS, "sampling_seed": INT, "ignore_eos": BOOL}
# route -> (the fields its handler reads and their kinds, those that must be present in this order); null is
# absent (SGLang's None defaults); a field not named here is not read and passes as it is
BODIES = {
    "/generate": ({"input_ids": TOKEN_IDS, "sampling_params": SAMPLING, "return_logprob": BOOL,
                   "top_logprobs_num": INT, "logprob_start_len": INT, "return_routed_experts": BOOL}, ()),
    "/update_weights_from_disk": ({"model_path": STR, "weight_version": INT, "flush_cache": BOOL}, ("model_path",)),
    "/init_weights_update_group": ({"group_name": STR, "rank_offset": INT, "master_address": STR, "master_port": INT,
                                    "world_size": INT, "backend": STR},
                                   ("group_name", "rank_offset", "master_address", "master_port", "world_size")),
    "/update_weights_from_distributed": ({"group_name": STR, "names": STRS, "dtypes": STRS, "shapes": SHAPES,
                                          "weight_version": INT, "flush_cache": BOOL}, ("group_name",)),
    "/destroy_weights_update_group": ({"group_name": STR}, ("group_name",)),
    "/update_weights_from_tensor": ({"serialized_named_tensors": STRS, "load_format": STR, "weight_version": INT,
                                     "flush_cache": BOOL}, ("serialized_named_tensors",)),
    "/pause_generation": ({"mode": STR}, ()),
    "/megatron_pdm/faults": ({"fail_updates": INT, "fail_group": STR, "refuse_updates": INT, "abort_generates": INT,
                              "abort_after": INT, "delay_generates": INT, "delay_updates": INT, "delay_s": NUMBER},
                             ()),
}
JSON_TYPES = {dict: "an object", list: "an array", str: "a string", int: "a number", float: "a number",
              bool: "true or false", type(None): "null"}


def _shown(v) -> str:
    """A value as a refusal quotes it: its repr, cut at 200 characters (a prompt of 100k token ids is not)."""
    text = repr(v)
    return text if len(text) <= 200 else text[:200] + "..."


def _fields(obj: dict, fields: dict[str, Kind], required: tuple[str, ...], where: str) -> dict:
    """`obj` with each of `fields` converted by its kind, a null one dropped (absent); _BadRequest naming the field
    (`where` + its name) and its value for one of another kind, or for a `required` one that is absent."""
    out = {k: v for k, v in obj.items() if not (k in fields and v is None)}
    for name in required:
        if name not in out:
            raise _BadRequest(f"{where}{name}: missing")
    for name, kind in fields.items():
        if name in out:
            try:
                out[name] = kind.convert(out[name], where + name)
            except _BadRequest:
                raise
            except (TypeError, ValueError, OverflowError):
                raise _BadRequest(f"{where}{name}: expected {kind.what}, got {_shown(out[name])}") from None
    return out


def checked_body(path: str, body) -> dict:
    """The body of a POST to `path`, a JSON object whose fields are each of their kind (`BODIES`), converted: the one
    check of serve's request bodies, so that a handler never meets a list where it reads an object (an HTTP 500 and a
    traceback before). _BadRequest naming the field and its value."""
    if not isinstance(body, dict):
        raise _BadRequest(f"body: expected a JSON object, got {JSON_TYPES.get(type(body), type(body).__name__)}")
    fields, required = BODIES.get(path, ({}, ()))
    return _fields(body, fields, required, "")


def config_differences(ours, theirs) -> list[str]:
    """The fields where two ModelConfigs differ, `model.<field>: <ours> (checkpoint: <theirs>)`: the architecture
    fields (`architecture_mismatches`), else the others (which the equality the disk update checks compares too)."""
    diffs = architecture_mismatches(ours, theirs)
    return diffs or [f"model.{f.name}: {getattr(ours, f.name)!r} (checkpoint: {getattr(theirs, f.name)!r})"
                     for f in fields(ours) if getattr(ours, f.name) != getattr(theirs, f.name)]


def checkpoint_quantization(model_path) -> dict | None:
    """The `quantization_config` of an HF checkpoint's config.json (None when it has none)."""
    config = json.loads((Path(model_path) / "config.json").read_text())
    return config.get("quantization_config")


class EngineServer:
    """tokenizer: a tokenizer directory (default: model_path's own tokenizer files, when it has them), which
    decodes each response's `text` as SGLang does; without one, responses carry no `text` (SGLang's
    --skip-tokenizer-init)."""

    def __init__(self, model_path: str, *, dtype: str = "float32", quantization: str | None = None,
                 weight_version: int = 0, tokenizer: str | None = None, test_hooks: bool = False):
        state, cfg = load_hf_checkpoint(model_path)
        tokenizer = tokenizer or (model_path if has_tokenizer(model_path) else None)
        self.tokenizer = None if tokenizer is None else load_tokenizer(tokenizer, embedding_rows=cfg.vocab_size,
                                                                        field="serve --tokenizer")
        self.tokenizer_path = tokenizer
        quant = checkpoint_quantization(model_path)
        self.quantization_flag, self.dtype = quantization, dtype
        if quant and not is_block_fp8(quant):
            raise ValueError(f"{model_path}: quantization_config {quant} is not block-FP8 [128, 128], the only "
                             "quantized checkpoint serve loads")
        self.fp8 = quantization == "fp8" or is_block_fp8(quant)
        self.engine = EmbeddedEngine(cfg, dtype=dtype, quantization="fp8" if self.fp8 else None)
        self.engine.update_weights(state, version=weight_version)
        self.model_path = model_path
        self.launch = (model_path, weight_version)  # what /server_info reports: the launch's, as SGLang's
        self.eos_token_ids = checkpoint_eos_ids(model_path, () if self.tokenizer is None else self.tokenizer.stop_ids)
        self.lock = threading.Lock()
        self.running = threading.Event()
        self.running.set()
        self.state_lock = threading.Lock()  # guards the counters below
        self.aborts = 0  # pauses in mode "abort" so far: a request in flight across one is aborted
        self.inflight = 0  # /generate requests past the pause gate
        self.fail_updates = self.refuse_updates = self.abort_generates = self.delay_generates = 0  # test hooks
        self.delay_updates = 0
        self.fail_group = ""  # fail_updates counts only distributed updates of a group whose name contains it
        self.received: dict[str, int] = {}  # weight-update requests by route, since the last faults call
        self.delay_s = 0.0
        self.abort_after: int | None = None
        self.test_hooks = test_hooks
        self.session = False  # a weight-update session is open
        self.session_version = weight_version  # the engine's version when the session opened
        self.groups: dict[str, object] = {}
        # weight-update requests run one at a time in order of arrival, as SGLang's scheduler runs them (a second
        # group's announcement waits while the first group's broadcast is received)
        self.update_lock = threading.Lock()

    # -- generation -----------------------------------------------------------------------------------------
    def generate(self, body: dict):
        sp = body.get("sampling_params") or {}
        if any((x or {}).get("max_new_tokens") == 0 for x in (sp if isinstance(sp, list) else [sp])):
            return self.score(body)
        rows, batch = request_rows(body, self.eos_token_ids)
        with self.state_lock:
            delay = self.delay_s if self.delay_generates > 0 else 0.0
            self.delay_generates -= delay > 0
        time.sleep(delay)
        self.running.wait()  # held while paused (SGLang holds new requests until /continue_generation)
        with self.state_lock:
            epoch, self.inflight = self.aborts, self.inflight + 1
            injected = self.abort_generates > 0
            self.abort_generates -= injected
        try:
            with self.lock:
                samples = self._sample(rows)
                version = self.engine.weight_version
        finally:
            with self.state_lock:
                self.inflight -= 1
                aborted = injected or self.aborts != epoch
        if injected and self.abort_after is not None:  # the tokens generated before the abort
            samples = [smp.head(self.abort_after) for smp in samples]
        text = None if self.tokenizer is None else self.tokenizer.decode
        out = [generate_output(s, version=version, aborted=aborted, logprobs=bool(body.get("return_logprob")),
                               decode=text) for s in samples]
        return out if batch else out[0]

    def score(self, body: dict):
        """A prefill-only /generate (max_new_tokens 0 in every row): each row's input-token log-probs and top-K
        (`top_logprobs_num`) from `logprob_start_len` s, in SGLang 0.5.23's shape (`wire.score_output`). serve
        takes 0 <= s < L only (SGLang reads s = -1 as no input positions, which asks for nothing)."""
        ids, sp = body["input_ids"], body.get("sampling_params") or {}
        batch = bool(ids) and isinstance(ids[0], list)
        rows = ids if batch else [ids]
        if any((x or {}).get("max_new_tokens") != 0 for x in (sp if isinstance(sp, list) else [sp])):
            raise WireError("sampling_params.max_new_tokens: 0 in some rows and not in others; serve scores a "
                            "request only when every row is prefill-only")
        if not body.get("return_logprob"):
            raise WireError("return_logprob: a prefill-only request (max_new_tokens 0) must ask for log-probs")
        s, k = body.get("logprob_start_len", -1), int(body.get("top_logprobs_num") or 1)
        bad = [len(r) for r in rows if not 0 <= s < len(r)]
        if bad:
            raise WireError(f"logprob_start_len: {s} is not in [0, {bad[0]}) (the input's length)")
        self.running.wait()  # held while paused, as generate; aborted as generate (a pause, the abort hook)
        with self.state_lock:
            epoch, self.inflight = self.aborts, self.inflight + 1
            injected = self.abort_generates > 0
            self.abort_generates -= injected
        try:
            with self.lock:
                live = [j for j, r in enumerate(rows) if s + 1 < len(r)]
                scores = dict(zip(live, self.engine.score([rows[j] for j in live], [s + 1] * len(live), k),
                                  strict=True))
                version = self.engine.weight_version
        finally:
            with self.state_lock:
                self.inflight -= 1
                aborted = injected or self.aborts != epoch
        out = [score_output(r, s + 1, scores.get(j), version=version, aborted=aborted) for j, r in enumerate(rows)]
        return out if batch else out[0]

    def _sample(self, rows):
        """Rows with a sampling_seed are sampled each from its own seed (so that equal seeds give equal samples, as
        in SGLang with --enable-deterministic-inference); consecutive rows with equal params and no seed together."""
        samples, i = [], 0
        while i < len(rows):
            j = i + 1
            while rows[i][1].seed is None and j < len(rows) and rows[j][1] == rows[i][1]:
                j += 1
            samples += self.engine.generate([p for p, _ in rows[i:j]], rows[i][1])
            i = j
        return samples

    def pause(self, body: dict):
        mode = body.get("mode", "abort")
        if mode not in PAUSE_MODES:
            raise _BadRequest(f"mode: {mode!r} is not one of {', '.join(PAUSE_MODES)}")
        with self.state_lock:
            self.running.clear()
            self.aborts += mode == "abort"
        return {"message": "Generation paused successfully.", "status": "ok"}

    # -- weights --------------------------------------------------------------------------------------------
    def _injected_failure(self, group: str = "") -> None:
        with self.state_lock:
            fail = self.fail_updates > 0 and self.fail_group in group
            self.fail_updates -= fail
        if fail:
            raise _BadRequest("injected failure (test hook fail_updates)")

    def _session_update(self, route: str) -> None:
        """A tensor or distributed update: refused outside a session, and by the refuse_updates hook, before
        anything is received (an engine that never joins the trainer's broadcast)."""
        with self.state_lock:
            refuse = self.refuse_updates > 0
            self.refuse_updates -= refuse
            if not self.session:
                raise _BadRequest(f"{route} must run between begin_weight_update() and end_weight_update()")
        if refuse:
            raise _BadRequest(f"{route}: injected refusal (test hook refuse_updates)")

    def begin_weight_update(self, body: dict):
        """Open a session: the tensor or distributed updates until `end_weight_update` are one update, whose
        block-FP8 halves pair across its buckets (requests), never with an earlier update's."""
        with self.state_lock:
            if self.session:
                raise _BadRequest("begin_weight_update: a weight-update session is already open")
            self.session = True
        # no generation lock needed (a generate may hold it for long): the halves are only touched by weight-update
        # requests, which run one at a time (update_lock)
        self.engine.forget_fp8_halves()
        self.session_version = self.engine.weight_version
        return {"success": True, "message": "weight-update session opened"}

    def end_weight_update(self, body: dict):
        """Close the session; a block-FP8 weight whose other half never came in it fails the update (HTTP 400
        naming the weights, the session closed, the version the engine had when it opened: the engine still holds
        those weights' previous values, so the client takes it out of service)."""
        with self.state_lock:
            if not self.session:
                raise _BadRequest("end_weight_update: no weight-update session is open")
            self.session = False
        try:
            self.engine.check_fp8_halves()
        except ValueError as e:
            with self.lock:
                self.engine.weight_version = self.session_version
            raise _BadRequest(f"end_weight_update: {e}") from None
        return {"success": True, "message": "weight-update session closed"}

    def update_weights_from_disk(self, body: dict):
        """Load an HF checkpoint, inside a weight-update session or not (SGLang 0.5.23 takes both)."""
        with self.state_lock:
            delay = self.delay_s if self.delay_updates > 0 else 0.0
            self.delay_updates -= delay > 0
        time.sleep(delay)
        self._injected_failure()
        if self.engine.released:  # SGLang: /resume_memory_occupation comes first
            raise _BadRequest("update_weights: memory released (resume_memory_occupation first)")
        path = body["model_path"]
        quant = checkpoint_quantization(path)
        if self.fp8 and not is_block_fp8(quant):
            raise _BadRequest(f"model_path: {path} is not a block-FP8 checkpoint, and this engine is FP8")
        state, cfg = load_hf_checkpoint(path)
        cfg = replace(cfg, mtp_num_layers=self.engine.cfg.mtp_num_layers)  # MTP layers: skipped (`_main_model`)
        if cfg != self.engine.cfg:
            raise _BadRequest(f"model_path: {path} holds a different model than this engine's: "
                              f"{'; '.join(config_differences(self.engine.cfg, cfg))}")
        with self.lock:
            version = self._version(body)
            self.engine.update_weights(state, version)
            self.model_path = path
        return {"success": True, "message": f"loaded {path}", "num_paused_requests": 0}

    def _version(self, body: dict) -> int:
        return body.get("weight_version", self.engine.weight_version)

    def init_weights_update_group(self, body: dict):
        """Join the trainer's group as rank rank_offset + tp_rank (one engine rank here, tp_rank 0), the way SGLang's
        WeightUpdater.init_weights_update_group does; blocks until every rank joined."""
        name, address = body["group_name"], body["master_address"]
        rank, port, world = body["rank_offset"], body["master_port"], body["world_size"]
        if not name or name in self.groups:
            raise _BadRequest(f"group_name: {name!r} is empty or already exists")
        self.groups[name] = weight_transfer.custom_process_group(address, port, rank, world, name,
                                                                 backend=body.get("backend", "nccl"))
        return {"success": True, "message": "Succeeded to initialize custom process group."}

    def update_weights_from_distributed(self, body: dict):
        """Receive one bucket: a broadcast from rank 0 per announced (name, dtype, shape), then load it."""
        self._session_update("update_weights_from_distributed")
        group = self.groups.get(body.get("group_name"))
        if group is None:
            raise _BadRequest(f"group_name: {body.get('group_name')!r} is not a joined group ({sorted(self.groups)})")
        named = weight_transfer.receive_tensors(group, body.get("names") or [], body.get("dtypes") or [],
                                                body.get("shapes") or [])
        self._injected_failure(str(body.get("group_name")))  # after the broadcast, as a load that fails in SGLang
        return self._load(named, body)

    def destroy_weights_update_group(self, body: dict):
        group = self.groups.pop(body.get("group_name"), None)
        if group is None:
            raise _BadRequest(f"group_name: {body.get('group_name')!r}: The group to be destroyed does not exist.")
        weight_transfer.destroy_group(group)
        return {"success": True, "message": "Succeeded to destroy custom process group."}

    def update_weights_from_tensor(self, body: dict):
        """serialized_named_tensors: one entry per engine TP rank (this server has one)."""
        self._session_update("update_weights_from_tensor")
        self._injected_failure()
        entries = body.get("serialized_named_tensors")
        if not isinstance(entries, list) or len(entries) != 1:
            raise _BadRequest("serialized_named_tensors: expected a list with one entry per TP rank (1 here)")
        if body.get("load_format") not in (None, "direct"):
            raise _BadRequest(f"load_format: {body.get('load_format')!r} is not supported (None or 'direct')")
        return self._load(weight_transfer.deserialize_named_tensors(entries[0]), body)

    def _load(self, named, body: dict):
        """Load some weights and take the version the update carries (a bucket without one keeps the current)."""
        if self.fp8:
            plain = [(n, t.dtype) for n, t in named if fp8_quantizable(n, t) and not n.endswith(FP8_SCALE_SUFFIX)
                     and t.dtype != weight_transfer.DTYPE_NAMES["float8_e4m3fn"]
                     and not is_mtp_key(n, self.engine.cfg)]  # skipped by the engine (`_main_model`)
            if plain:
                raise _BadRequest(f"{plain[0][0]}: {weight_transfer.dtype_name(plain[0][1])} weights sent to an FP8 "
                                  "engine, which takes block-FP8 weights (float8_e4m3fn + _scale_inv) only")
        with self.lock:
            self.engine.load_weights(named)
            self.engine.weight_version = self._version(body)
        dtypes = sorted({weight_transfer.dtype_name(t.dtype) for _, t in named})
        return {"success": True, "message": f"loaded {len(named)} tensors ({', '.join(dtypes)})"}

    # -- information ----------------------------------------------------------------------------------------
    def model_info(self):
        """SGLang's /model_info fields that apply here."""
        return {"model_path": self.model_path, "tokenizer_path": self.tokenizer_path, "is_generation": True,
                "weight_version": str(self.engine.weight_version),
                "model_type": self.engine.cfg.model_type, "architectures": None}

    def server_info(self):
        """SGLang's /server_info (its resolved server arguments: the launch's checkpoint and weight version, whatever
        was loaded since; /model_info has the current ones) for the fields that apply here."""
        path, version = self.launch
        return {"model_path": path, "tokenizer_path": self.tokenizer_path, "dtype": self.dtype,
                "quantization": self.quantization_flag, "tp_size": 1, "skip_tokenizer_init": self.tokenizer is None,
                "weight_version": str(version), "device": "cpu", "version": SERVE_VERSION}

    def faults(self, body: dict):
        if not self.test_hooks:
            raise _BadRequest(f"no test hooks (start serve with {TEST_HOOKS_ENV}=1)")
        counts = {f: body.get(f, 0) for f in ("fail_updates", "refuse_updates", "abort_generates", "delay_generates",
                                              "delay_updates")}
        with self.state_lock:  # every field checked before (`checked_body`): a bad one changed nothing
            self.fail_updates, self.refuse_updates = counts["fail_updates"], counts["refuse_updates"]
            self.abort_generates, self.delay_generates = counts["abort_generates"], counts["delay_generates"]
            self.delay_updates = counts["delay_updates"]
            self.fail_group = body.get("fail_group", "")
            self.abort_after, self.delay_s = body.get("abort_after"), body.get("delay_s", 0.0)
            self.received = {}
        return {"success": True}

    def fault_state(self):
        """The hooks left and the weight-update requests received since the last faults call."""
        if not self.test_hooks:
            raise _BadRequest(f"no test hooks (start serve with {TEST_HOOKS_ENV}=1)")
        with self.state_lock:
            return {"fail_updates": self.fail_updates, "refuse_updates": self.refuse_updates,
                    "abort_generates": self.abort_generates, "delay_generates": self.delay_generates,
                    "delay_updates": self.delay_updates, "received": dict(self.received)}

    def count(self, route: str) -> None:
        with self.state_lock:
            self.received[route] = self.received.get(route, 0) + 1


UPDATE_ROUTES = {f"/{name}": name for name in ("update_weights_from_disk", "init_weights_update_group",
                                               "update_weights_from_distributed", "destroy_weights_update_group",
                                               "update_weights_from_tensor", "begin_weight_update",
                                               "end_weight_update")}


def make_handler(server: EngineServer):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # quiet: one line per request is noise in tests and logs
            pass

        def _reply(self, code: int, payload, *, close: bool = False) -> None:
            """close: the connection closes after this answer (a body left unread would be taken for the next
            request on a kept-alive connection)."""
            data = json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if close:
                self.send_header("Connection", "close")
                self.close_connection = True
            self.end_headers()
            self.wfile.write(data)

        def _reply_text(self, code: int, text: str) -> None:
            """A text/plain answer (SGLang's /flush_cache; /health's empty body)."""
            data = text.encode()
            self.send_response(code)
            self.send_header("Content-Type", "text/plain; charset=utf-8")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _body(self) -> dict:
            """The JSON body (`{}` when empty), read once its length is known good (`body_length`), each field of
            its kind (`checked_body`)."""
            raw = self.rfile.read(body_length(self.headers.get_all("Content-Length")))
            return checked_body(self.path, json.loads(raw or b"{}"))

        def _refuse(self, message: str) -> None:
            """HTTP 400: SGLang's {"success": false, "message"} on a weight-update route, {"error"} elsewhere."""
            self._reply(400, {"success": False, "message": message} if self.path in UPDATE_ROUTES
                        else {"error": message})

        def do_GET(self):
            if self.path == "/health":  # SGLang: the status only, an empty body
                self._reply_text(200 if server.engine.health() else 503, "")
            elif self.path in ("/model_info", "/get_model_info"):
                self._reply(200, server.model_info())
            elif self.path in ("/server_info", "/get_server_info"):
                self._reply(200, server.server_info())
            elif self.path == "/megatron_pdm/faults":
                try:
                    self._reply(200, server.fault_state())
                except _BadRequest as e:
                    self._reply(400, {"error": str(e)})
            else:
                self._reply(404, {"error": f"no route {self.path}"})

        def do_POST(self):
            try:
                body = self._body()
            except _BodyError as e:
                return self._reply(e.code, {"error": str(e)}, close=True)
            except (json.JSONDecodeError, UnicodeDecodeError, RecursionError, _BadRequest) as e:
                return self._refuse(str(e) if isinstance(e, _BadRequest) else f"body: not JSON ({e})")
            if self.path in UPDATE_ROUTES:  # SGLang: 200 on success, 400 with success false on any failure
                server.count(self.path)
                try:
                    with server.update_lock:  # one at a time, as SGLang's scheduler takes them
                        answer = getattr(server, UPDATE_ROUTES[self.path])(body)
                    self._reply(200, answer)
                except Exception as e:
                    if not isinstance(e, _BadRequest):
                        log.exception("%s failed", self.path)
                    self._refuse(f"{type(e).__name__}: {e}")
                return
            try:
                if self.path == "/generate":
                    self._reply(200, server.generate(body))
                elif self.path == "/flush_cache":  # no prefix cache to flush: every request is computed afresh
                    self._reply_text(200, FLUSHED)
                elif self.path == "/pause_generation":
                    self._reply(200, server.pause(body))
                elif self.path == "/continue_generation":
                    server.running.set()
                    self._reply(200, {"message": "Generation continued successfully.", "status": "ok"})
                elif self.path in ("/release_memory_occupation", "/resume_memory_occupation"):
                    with server.lock:
                        if self.path == "/release_memory_occupation":
                            server.engine.release_memory()
                        else:
                            server.engine.resume_memory()
                    self._reply(200, {"success": True})
                elif self.path == "/megatron_pdm/faults":
                    self._reply(200, server.faults(body))
                else:
                    self._reply(404, {"error": f"no route {self.path}"})
            except (_BadRequest, ValueError, FileNotFoundError) as e:
                self._reply(400, {"error": str(e)})
            except Exception as e:  # the server lives on, the client sees why
                log.exception("%s failed", self.path)
                self._reply(500, {"error": f"{type(e).__name__}: {e}"})

    return Handler


def serve(model_path: str, *, host: str = "127.0.0.1", port: int = 30000, dtype: str = "float32",
          quantization: str | None = None, weight_version: int = 0, tokenizer: str | None = None) -> None:
    server = EngineServer(model_path, dtype=dtype, quantization=quantization, weight_version=weight_version,
                          tokenizer=tokenizer, test_hooks=os.environ.get(TEST_HOOKS_ENV) == "1")
    httpd = ThreadingHTTPServer((host, port), make_handler(server))
    print(f"serving {model_path} on http://{host}:{port}", flush=True)
    httpd.serve_forever()
