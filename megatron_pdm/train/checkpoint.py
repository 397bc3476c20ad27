"""Checkpoints that survive scale and are never lost: megatron-core distributed checkpointing (`torch_dist`).

A checkpoint holds the model's and the megatron optimizer's `sharded_state_dict` (Adam moments and fp32 main
parameters included, the distributed optimizer in megatron's `fully_reshardable` form), so it loads at any
TP / PP / EP / DP layout of the same model. Next to it: the trainer's state (step, updates skipped, the engines'
weight version; the loss scale lives in the optimizer's state) as JSON, and each rank's RNG states, restored when
the world size is unchanged. The data order needs no state: every step's prompts and rollout seeds derive from
(train.seed, step).

Never-lose protocol: every rank writes into step_N.tmp/; after all have finished, rank 0 writes the manifest
(every file and its size) as `complete`, publishes the directory by one rename and only then prunes older
checkpoints beyond keep_last. A directory whose manifest is missing, unreadable or disagrees with the files on
disk is skipped with a log line, and the previous checkpoint is used.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import json
import logging
import pickle
import shutil
import zipfile
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_pdm._rundir import RunDir
from megatron_pdm.compat import cuda_to_cpu_scope
from megatron_pdm.models import ParallelConfig, model_chunks

log = logging.getLogger(__name__)

COMPLETE = "complete"  # the manifest, written last: {"format", "step", "world", "files": {relative path: bytes}}
TRAINER_STATE = "trainer_state.json"
CONFIG_FILE = "config.yaml"  # the run's config: `export` rebuilds the model from it
TOKENIZER_DIR = "tokenizer"  # the run's tokenizer files, copied into every export
FORMAT = "torch_dist"
# megatron's reshardable form of the distributed optimizer (canonical per-parameter state; the default
# `fully_sharded_model_space` is rejected by dist_checkpointing 0.16 and ties the checkpoint to its DP layout)
# (and no `chained_N.` prefix on its tensors: megatron chains a separate expert optimizer only when EP > 1, so the
# prefix would tie the optimizer state to the expert-parallel size)
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True}


def _step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


# the suffixes of a step directory that is not a published checkpoint
WRITING, FAILED, REPLACED = ".tmp", ".failed", ".old"  # being written, set aside after a failed load, being replaced


def _writing_dir(root: Path, step: int) -> Path:
    return _step_dir(root, step).with_suffix(WRITING)


def set_aside(path: Path) -> Path:
    """A checkpoint that failed to load renamed step_N.failed (step_N.1.failed, ... when a step failed before):
    kept for a post-mortem, never listed again."""
    names = (f"{path.name}{f'.{i}' if i else ''}{FAILED}" for i in range(1_000_000))
    return path.rename(next(path.with_name(n) for n in names if not path.with_name(n).exists()))


def set_aside_everywhere(path: Path) -> None:
    """`set_aside` by rank 0, with every rank told the outcome (collective): a rename that fails raises on every
    rank, never on rank 0 alone while the others wait for it."""
    agreed(lambda: set_aside(path), f"{path}: failed to load, and could not be set aside as {path.name}{FAILED}",
           rank0_only=True)


def agreed(fn, what: str, *, rank0_only: bool = False) -> None:
    """fn() on every rank (on rank 0 only with rank0_only), then every rank learns whether it failed anywhere
    (collective: one all_gather_object) and raises RuntimeError(what: the first failure) if so. For file system
    work beside collectives: a full disk or a permission error raises on every rank, never on one while the others
    wait for it in the next barrier."""
    error = None
    if not rank0_only or dist.get_rank() == 0:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - every rank raises it below
            error = f"rank {dist.get_rank()}: {type(e).__name__}: {e}"
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise RuntimeError(f"{what}: {first}")


def set_aside_checkpoints(root) -> list[Path]:
    """The checkpoints under root that an earlier resume set aside (step_N.failed)."""
    root = Path(root)
    return sorted(p for p in root.glob(f"step_*{FAILED}")) if root.is_dir() else []


# -- finding checkpoints ----------------------------------------------------------------------------------------
def checkpoint_problem(path: Path) -> str | None:
    """Why `path` is not a complete checkpoint, or None: the manifest must parse and every file it lists must be
    on disk with its recorded size (a truncated shard is caught here, before any rank reads it)."""
    try:
        manifest = json.loads((path / COMPLETE).read_text())
    except FileNotFoundError:
        return "no manifest (never published)"
    except (OSError, ValueError) as e:
        return f"unreadable manifest ({e})"
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        return f"not a {FORMAT} checkpoint (an older per-rank format?)"
    if not isinstance(manifest.get("files"), dict):
        return "the manifest lists no files"
    for name, size in manifest["files"].items():
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != size:
            return f"{name} has {f.stat().st_size} bytes, the manifest says {size} (truncated?)"
    return None


def complete_checkpoints(root, *, verbose: bool = False) -> list[Path]:
    """The published, intact checkpoints under root, oldest first; with verbose, a log line for each skipped."""
    root = Path(root)
    if not root.is_dir():
        return []
    out = []
    for p in sorted(p for p in root.iterdir() if p.name.startswith("step_")
                    and p.suffix not in (WRITING, FAILED, REPLACED)):
        why = checkpoint_problem(p)
        if why is None:
            out.append(p)
        elif verbose:
            log.warning("checkpoint %s skipped: %s", p, why)
    return out


def check_run_dir(run_dir, resume: bool | str) -> None:
    """What a run refuses about its directory, before a file in it is written: an earlier run's checkpoints without
    resume (--resume True, --auto-resume "auto"), --resume without a checkpoint. The CLI checks before it spawns a
    process, the trainer again on every rank."""
    ckpts = RunDir(run_dir).checkpoints
    found = complete_checkpoints(ckpts)
    if found and not resume:
        raise FileExistsError(f"{run_dir}: holds checkpoints of an earlier run; pass --resume to continue it or "
                              "choose another --run-dir")
    if not found and resume is True and not set_aside_checkpoints(ckpts):  # (all set aside: load_latest says so)
        raise FileNotFoundError(f"--resume: no complete checkpoint under {ckpts}")


def latest_checkpoint(root, *, verbose: bool = False) -> Path | None:
    done = complete_checkpoints(root, verbose=verbose)
    return done[-1] if done else None


def read_trainer_state(path) -> dict:
    """The trainer state of a checkpoint; its "parallel" section has every field of this version's ParallelConfig
    (those added since it was written take their defaults), so that it compares equal at the same layout."""
    state = json.loads((Path(path) / TRAINER_STATE).read_text())
    if "parallel" in state:
        state["parallel"] = {**dataclasses.asdict(ParallelConfig()), **state["parallel"]}
    return state


# -- the sharded state ------------------------------------------------------------------------------------------
def _optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _model_keys(chunks: list, name: str = "model") -> list[str]:
    """The state's key of each model chunk, as megatron-LM names them: "model", or "model0", "model1", ... with
    virtual pipeline stages (`name` "reference": the reference policy's). The tensors inside are keyed by global
    layer, so any layout reads any other's."""
    return [name] if len(chunks) == 1 else [f"{name}{i}" for i in range(len(chunks))]


REFERENCE_PREFIX = "reference."  # the frozen reference policy's tensors (objective.kl_coef) in a checkpoint


def _reference_chunks(reference) -> dict:
    """{"reference" (or "reference0", ...): chunk} of the reference policy (empty without one)."""
    chunks = [] if reference is None else model_chunks(reference)
    return dict(zip(_model_keys(chunks, "reference"), chunks, strict=True)) if chunks else {}


def _reference_states(reference) -> dict:
    """{"reference" (or "reference0", ...): the reference chunk's sharded state, its tensors keyed "reference.*"}."""
    return {key: c.sharded_state_dict(prefix=REFERENCE_PREFIX) for key, c in _reference_chunks(reference).items()}


def sharded_state(model, optimizer, *, is_loading: bool, reference=None) -> dict:
    """{"model": model.sharded_state_dict(), "optimizer": optimizer.sharded_state_dict(...)} (optimizer None:
    the model only, as `export` reads it); a list of model chunks gives one key per chunk (`_model_keys`). With
    `reference` (the frozen reference policy's chunks), its tensors too, under "reference.*"."""
    chunks = model_chunks(model)
    with cuda_to_cpu_scope():
        state = {key: c.sharded_state_dict() for key, c in zip(_model_keys(chunks), chunks, strict=True)}
        if optimizer is not None:
            state["optimizer"] = optimizer.sharded_state_dict(dict(state), is_loading=is_loading,
                                                              metadata=OPTIMIZER_METADATA)
        state.update(_reference_states(reference))  # after the optimizer's, which maps its parameters on the model's
    return state


def load_model_state(model, loaded: dict, reference=None) -> None:
    """Copy the model part of a loaded `sharded_state` into the model (or its chunks), and the reference's."""
    chunks = model_chunks(model)
    for key, c in zip(_model_keys(chunks), chunks, strict=True):
        c.load_state_dict(loaded[key])
    for key, c in _reference_chunks(reference).items():
        c.load_state_dict({k.removeprefix(REFERENCE_PREFIX): v for k, v in loaded[key].items()})


def _allocate_optimizer_state(optimizer) -> None:
    """Give a never-stepped distributed optimizer its Adam state before a load: megatron's loader reads the state
    it replaces (without Apex / TE it asserts on an empty one). The dummy zero-gradient step moves the main
    parameters by weight decay only, and the load overwrites them and every moment."""
    for o in _optimizers(optimizer):
        if hasattr(o, "_init_optimizer_states_with_dummy_values") and not o.optimizer.state:
            with cuda_to_cpu_scope():
                o._init_optimizer_states_with_dummy_values()


@contextlib.contextmanager
def _torch_adam_steps(optimizer):
    """megatron-core 0.16's fully_reshardable loader copies every key of a parameter's optimizer state from the
    checkpoint, but torch's Adam (the optimizer without Apex / TE) also keeps a per-parameter 'step', which the
    checkpoint stores once in the param groups: copy only the keys the checkpoint has. Afterwards each parameter
    gets its own step tensor (megatron's loader assigns one shared tensor, which torch's Adam would then
    increment once per parameter per update)."""
    patched = []
    for o in _optimizers(optimizer):
        if hasattr(o, "_set_main_param_and_optimizer_states"):
            if o.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
                raise ValueError("optimizer: megatron's precision-aware optimizer keeps its state under other names; "
                                 "this loader covers the plain distributed optimizer")
            def set_states(model_param, tensors, o=o):
                group, order = o.model_param_group_index_map[model_param]
                main = o.optimizer.param_groups[group]["params"][order]
                dst = {"param": main, **o.optimizer.state[main]}
                for key, src in tensors.items():
                    dst[key].copy_(src)

            o._set_main_param_and_optimizer_states = set_states
            patched.append(o)
    try:
        yield
    finally:
        for o in patched:
            del o._set_main_param_and_optimizer_states
        for o in _optimizers(optimizer):
            for s in getattr(o, "optimizer", o).state.values():
                if isinstance(s.get("step"), torch.Tensor):
                    s["step"] = s["step"].clone()


def model_mismatches(path, model, reference=None) -> list[str]:
    """The model tensors whose global shape differs from the checkpoint's, or that it lacks, first one first: a
    checkpoint of another model fails here, naming the tensor and both shapes, before anything is loaded. With
    `reference`, a checkpoint without the reference policy is named as such."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    saved = dist_checkpointing.load_tensors_metadata(str(path))
    with cuda_to_cpu_scope():
        ours = [v for c in model_chunks(model) for v in c.sharded_state_dict().values()]
        if reference is not None and not any(k.startswith(REFERENCE_PREFIX) for k in saved):
            return ["reference.*: not in the checkpoint (written with objective.kl_coef 0); objective.kl_coef needs "
                    "the reference policy, the weights RL started from"]
        ours += [v for state in _reference_states(reference).values() for v in state.values()]
    out = []
    for value in ours:
        if not isinstance(value, ShardedTensor):
            continue
        if value.key not in saved:
            out.append(f"{value.key}: not in the checkpoint")
        elif tuple(saved[value.key].global_shape) != tuple(value.global_shape):
            out.append(f"{value.key}: the checkpoint has shape {tuple(saved[value.key].global_shape)}, this model "
                       f"{tuple(value.global_shape)}")
    return out


def _saved_chain(path) -> list[dict]:
    """The non-tensor state (param groups with the step, grad scaler) of each optimizer of the chain that wrote the
    checkpoint: one (dense and expert parameters together: EP = 1, or no MoE) or two (dense, expert)."""
    from megatron.core import dist_checkpointing

    common = dist_checkpointing.load_common_state_dict(str(path))["optimizer"]
    return [common[k] for k in sorted(common)] if all(isinstance(k, int) for k in common) else [common]


def _rechain(loaded: dict, saved_chain: list[dict], optimizer):
    """The loaded optimizer state in the shape of this run's chain. When the expert-parallel size changed the chain
    length did too (EP 1 <-> EP > 1): the tensors (Adam moments, main parameters) are keyed by parameter and load
    as they are, and each optimizer takes its own param groups (the same hyperparameters) and grad scaler with the
    checkpoint's step. Only the distributed optimizer's reshardable form carries its tensors this way."""
    ours = _optimizers(optimizer)
    if len(ours) == len(saved_chain):
        return loaded
    if not all(hasattr(o, "_set_main_param_and_optimizer_states") for o in ours):
        raise ValueError(f"parallel.expert: the checkpoint's optimizer chain has {len(saved_chain)} part(s), this "
                         f"run's {len(ours)} (the expert-parallel size changed); resuming across that needs "
                         "optim.distributed_optimizer: true")
    steps = {g["step"] for part in saved_chain for g in part["optimizer"]["param_groups"] if "step" in g}
    if len(steps) > 1:
        raise ValueError(f"optimizer: the checkpoint's optimizers disagree on the step: {sorted(steps)}")
    parts = [loaded] if len(ours) == 1 else [loaded[i] for i in range(len(ours))]
    out = []
    for o, part in zip(ours, parts, strict=True):
        own = o.state_dict()  # this run's param groups (hyperparameters) and grad scaler
        for g in own["optimizer"]["param_groups"]:
            if steps:
                g["step"] = next(iter(steps))
        common = {k: v for k, v in own.items() if k not in ("param_state", "param_state_sharding_type")}
        if "grad_scaler" in saved_chain[0]:
            common["grad_scaler"] = saved_chain[0]["grad_scaler"]
        out.append({**{k: v for k, v in part.items() if not isinstance(k, int)}, **common,
                    "param_state": part["param_state"],
                    "param_state_sharding_type": OPTIMIZER_METADATA["distrib_optim_sharding_type"]})
    return out[0] if len(out) == 1 else dict(enumerate(out))


# -- save / load ------------------------------------------------------------------------------------------------
def _rng_state() -> dict:
    from megatron.core import tensor_parallel

    state = {"torch": torch.get_rng_state(), "megatron": tensor_parallel.get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    from megatron.core import tensor_parallel

    torch.set_rng_state(state["torch"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["megatron"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def nonfinite_weights(model) -> str | None:
    """The first model weight holding a NaN or an infinity on any rank ("name on rank r"), or None (collective: one
    pass over this rank's weights on their device, one all-reduce, one host sync)."""
    named = [(n, p) for c in model_chunks(model) for n, p in c.named_parameters()]
    ok = torch.stack([torch.isfinite(p.detach()).all() for _, p in named])
    bad = (~ok).any().to(torch.int32).reshape(1)
    dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    if not bad.item():
        return None
    first = next((n for (n, _), good in zip(named, ok.tolist(), strict=True) if not good), None)
    names = [None] * dist.get_world_size()
    dist.all_gather_object(names, first)
    return next(f"{n} on rank {r}" for r, n in enumerate(names) if n is not None)


def save_checkpoint(root, step: int, model, optimizer, *, trainer_state: dict, keep_last: int, config: dict,
                    tokenizer_dir=None, async_queue=None, rank0_files: dict | None = None, reference=None) -> Path:
    """Write step_N (collective over all ranks): the sharded model and optimizer state through dist_checkpointing,
    each rank's RNG states, the trainer state, the run's config and tokenizer files, rank0_files ({name: plain data},
    torch.save'd by rank 0; read back with `read_rank0_file`), then the manifest; publish by one rename; prune
    beyond keep_last. Cost: one pass over this rank's shards to disk; the distributed optimizer
    gathers its state over DP first. async_queue (megatron's AsyncCallsQueue): the shards are written by a forked
    process (a copy-on-write snapshot of this moment) and the checkpoint is published when the queue finalizes the
    request (`maybe_finalize_async_calls`, on every rank). reference: the frozen reference policy's chunks, saved
    beside the model (a resumed run, at any layout, keeps the weights RL started from)."""
    from megatron.core import dist_checkpointing

    root = Path(root)
    final, tmp = _step_dir(root, step), _writing_dir(root, step)
    bad = nonfinite_weights(model)
    if bad:
        raise FloatingPointError(f"checkpoint step {step}: not published, the weights are not finite ({bad}); the "
                                 f"last good checkpoint under {root} stays the newest")
    def fresh():  # empty: dist_checkpointing warns about (and overwrites) a non-empty one
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)

    agreed(fresh, f"checkpoint step {step}: could not make {tmp}", rank0_only=True)
    publish = functools.partial(_publish, root, step, _rng_state(), trainer_state, keep_last, config, tokenizer_dir,
                                rank0_files or {})
    state = sharded_state(model, optimizer, is_loading=False, reference=reference)
    if async_queue is None:
        dist_checkpointing.save(state, str(tmp))
        publish()
    else:
        request = dist_checkpointing.save(state, str(tmp), async_sharded_save=True)
        request.add_finalize_fn(publish)
        async_queue.schedule_async_request(request)
    return final


def _publish(root: Path, step: int, rng: dict, trainer_state: dict, keep_last: int, config: dict,
             tokenizer_dir, rank0_files: dict) -> None:
    """The shards of step_N.tmp are on disk on every rank: add the RNG states, trainer state, config, tokenizer and
    the manifest, rename to step_N, prune (collective)."""
    import yaml

    from megatron_pdm.models.tokenizer import copy_tokenizer_files

    from .faults import kill_point

    rank, world = dist.get_rank(), dist.get_world_size()
    final, tmp = _step_dir(root, step), _writing_dir(root, step)

    def rng_file():
        (tmp / "rng").mkdir(exist_ok=True)
        torch.save(rng, tmp / "rng" / f"rank_{rank:05d}.pt")

    agreed(rng_file, f"checkpoint step {step}: not published")
    kill_point("checkpoint_write", step, rank)

    def publish():
        (tmp / CONFIG_FILE).write_text(yaml.safe_dump(config, sort_keys=False))
        if tokenizer_dir is not None:
            copy_tokenizer_files(tokenizer_dir, tmp / TOKENIZER_DIR)
        (tmp / TRAINER_STATE).write_text(json.dumps({**trainer_state, "step": step, "world": world}, indent=1))
        for name, data in rank0_files.items():
            torch.save(data, tmp / name)
        files = {str(f.relative_to(tmp)): f.stat().st_size for f in sorted(tmp.rglob("*")) if f.is_file()}
        (tmp / COMPLETE).write_text(json.dumps({"format": FORMAT, "step": step, "world": world, "files": files}))
        if final.exists():  # a rerun of this step (after a resume from an older one): set the old one aside first
            final.replace(final.with_name(final.name + REPLACED))
        tmp.replace(final)  # the publication: one rename
        shutil.rmtree(final.with_name(final.name + REPLACED), ignore_errors=True)
        # prune older checkpoints only: a newer one (a run resumed from before it) is never counted against this one
        older = [p for p in complete_checkpoints(root) if p.name < final.name]
        for old in older[: max(0, len(older) - (keep_last - 1))]:
            shutil.rmtree(old)

    agreed(publish, f"checkpoint step {step}: publishing {final}", rank0_only=True)


def load_checkpoint(path, model, optimizer, *, layout: dict | None = None, reference=None) -> dict:
    """Restore the model and the optimizer from `path` at this run's layout (resharding as needed) and return the
    trainer state (collective). RNG states are restored when the checkpoint was written at the same world size and
    `layout` (the parallel section): otherwise a rank would take another role's RNG states."""
    from megatron.core import dist_checkpointing

    from .faults import fail_point

    path = Path(path)
    try:  # what each rank does alone, before the collective load: every rank learns how it went on every rank
        fail_point("checkpoint_load", read_trainer_state(path)["step"], dist.get_rank())
        check_pickles(path)  # before torch reads them with pickle
        mine, error = model_mismatches(path, model, reference), None  # this rank's shards: a stage may see what
        # others do not
        _allocate_optimizer_state(optimizer)
        saved_chain = _saved_chain(path)
    except Exception as e:  # noqa: BLE001 - raised below, after every rank has heard of it
        mine, error = [], e
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (mine, None if error is None else
                                      (failure_kind(error), f"{type(error).__name__}: {error}")))
    if error is not None:
        raise error
    failed = next(((r, f) for r, (_, f) in enumerate(everyone) if f is not None), None)
    if failed is not None:
        raise PeerLoadFailure(f"rank {failed[0]}: {failed[1][1]}", kind=failed[1][0])
    mismatches = next((m for m, _ in everyone if m), [])
    if mismatches:  # raised on every rank, before any rank enters the collective load
        raise ValueError(f"{path}: a checkpoint of another model: {mismatches[0]}"
                         + (f" (and {len(mismatches) - 1} more)" if len(mismatches) > 1 else ""))
    loaded = dist_checkpointing.load(sharded_state(model, optimizer, is_loading=True, reference=reference), str(path))
    load_model_state(model, loaded, reference)
    with _torch_adam_steps(optimizer), cuda_to_cpu_scope():
        optimizer.load_state_dict(_rechain(loaded["optimizer"], saved_chain, optimizer))
    state = read_trainer_state(path)
    if state["world"] == dist.get_world_size() and state.get("parallel") == layout:
        # tensors only: a pickled object in a checkpoint never runs (an UnpicklingError marks the file corrupt)
        _set_rng_state(torch.load(path / "rng" / f"rank_{dist.get_rank():05d}.pt", weights_only=True))
    return state


# What the files of a corrupt checkpoint raise when read: a pickle that does not unpickle (or is refused), a file that
# ends early, a zip (torch.save) or JSON that does not parse, bytes that are not text. Only these set a checkpoint
# aside; any other failure (out of memory, host or device; a module that does not import; a device, NCCL or file
# system error; a bug) is taken for a failure of the loading process, which must never cost a checkpoint.
CORRUPTION = (pickle.UnpicklingError, EOFError, json.JSONDecodeError, zipfile.BadZipFile, UnicodeDecodeError)
_CORRUPTION_WORDS = ("PytorchStreamReader", "file might be corrupted", "unexpected EOF", "invalid header",
                     "failed finding central directory")


# torch.distributed.checkpoint reads a checkpoint's `.metadata` with a plain pickle.load and its byte items (megatron's
# _extra_state) with torch.load(weights_only=False): either would run code put into the files. `check_pickles`
# reads both first, admitting only what dist_checkpointing writes; torch's own reads then see nothing else.
_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                                              "TensorStorageMetadata", "BytesStorageMetadata",
                                              "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.distributed.checkpoint.planner": {"SavePlan", "WriteItem", "WriteItemType", "TensorWriteData"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size", "float32", "float64", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "int8", "uint8",
              "int16", "int32", "int64", "bool", "strided"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if name not in _METADATA_GLOBALS.get(module, ()):
            raise pickle.UnpicklingError(f".metadata: global {module}.{name} is not what dist_checkpointing writes")
        return super().find_class(module, name)


def read_rank0_file(checkpoint, name: str):
    """A file `save_checkpoint` wrote from rank0_files (plain data only: torch.load(weights_only=True)), None when
    the checkpoint has none."""
    path = Path(checkpoint) / name
    return torch.load(path, weights_only=True) if path.exists() else None


def check_pickles(path) -> None:
    """Raise pickle.UnpicklingError when the checkpoint's `.metadata` names a global dist_checkpointing never
    writes, or one of its byte items is not plain data (`torch.load(weights_only=True)`); one read of the metadata
    and of the byte items (small: megatron's _extra_state), before any rank loads."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    path = Path(path)
    with open(path / ".metadata", "rb") as f:
        metadata = _MetadataUnpickler(f).load()
    byte_items = {k for k, v in metadata.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)}
    for index, info in metadata.storage_data.items():
        if index.fqn not in byte_items:
            continue
        if getattr(info, "transform_descriptors", None):
            raise pickle.UnpicklingError(f"{index.fqn}: a transformed byte item, which this trainer never writes")
        with open(path / info.relative_path, "rb") as f:
            f.seek(info.offset)
            raw = f.read(info.length)
        torch.load(io.BytesIO(raw), weights_only=True)  # raises UnpicklingError on anything but plain data


class PeerLoadFailure(RuntimeError):
    """Another rank failed to load the checkpoint (`kind`: what `failure_kind` made of its error there)."""

    def __init__(self, message: str, *, kind: int):
        super().__init__(message)
        self.kind = kind


LOADED, CORRUPT, PROCESS, PROPAGATE = range(4)  # how a load went, worst last: every rank takes the worst of all


def failure_kind(e: BaseException | None) -> int:
    """LOADED (no error); CORRUPT when the checkpoint's files are, on positive evidence (`CORRUPTION`, or a
    RuntimeError of torch's readers naming a damaged file; inside torch.distributed.checkpoint's CheckpointException
    and through the exception's cause); PROPAGATE for a ValueError of the run's own (another model, an optimizer
    layout that cannot load it: no older checkpoint helps); PROCESS for anything else."""
    from torch.distributed.checkpoint.api import CheckpointException

    if e is None:
        return LOADED
    if isinstance(e, PeerLoadFailure):
        return e.kind
    if isinstance(e, CheckpointException):
        kinds = [failure_kind(w[0] if isinstance(w, tuple) else w) for w in e.failures.values()]
        return max(kinds, default=PROCESS)
    if isinstance(e, CORRUPTION) or isinstance(e, RuntimeError) and any(w in str(e) for w in _CORRUPTION_WORDS):
        return CORRUPT
    cause = e.__cause__ or e.__context__
    if cause is not None and cause is not e and failure_kind(cause) == CORRUPT:
        return CORRUPT
    return PROPAGATE if type(e) is ValueError else PROCESS


def load_latest(root, model, optimizer, *, layout: dict, device: torch.device, reference=None) -> dict | None:
    """Load the newest checkpoint under root that loads, and return its trainer state (with "path"), or None when
    there is none (collective). Rank 0 lists the candidates, so every rank tries the same ones, and every rank learns
    how each load went on every rank:
    - a corrupt checkpoint (its files fail to read: `failure_kind`) is set aside (step_N.failed) with a log line
      and the previous one is tried; at most one per attempt: a second failure in a row is an error, not a run of
      renames (a failure that is really this process's must not eat every checkpoint);
    - any other failure on any rank (out of memory, a missing module, a device error, a bug) is an error on every
      rank, and nothing is set aside: the checkpoint may well be intact;
    - a directory whose checkpoints were all set aside is an error, never a fresh start.
    A ValueError of the run's own (a checkpoint of another model) is raised on every rank: no older one helps."""
    from torch.distributed.checkpoint.api import CheckpointException

    root = Path(root)
    box = [(complete_checkpoints(root, verbose=True), set_aside_checkpoints(root)) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    candidates, earlier = box[0]
    if not candidates and earlier:
        raise RuntimeError(f"{root}: no checkpoint to resume, and {len(earlier)} set aside after failing to load "
                           f"({', '.join(p.name for p in earlier)}): look at them, and move them away to start this "
                           "run afresh")
    set_aside_now = None
    for path in reversed(candidates):
        try:
            state, error = load_checkpoint(path, model, optimizer, layout=layout, reference=reference), None
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - every rank must agree on what follows
            state, error = None, e
        worst = torch.tensor([failure_kind(error)], dtype=torch.int32, device=device)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)  # a host sync, once per candidate
        worst = int(worst.item())
        why = f"{type(error).__name__}: {error}" if error is not None else "on another rank"
        if worst == LOADED:
            return {**state, "path": path}
        if worst == PROPAGATE:  # every rank raises: its own error, or word of the other's
            raise error if failure_kind(error) == PROPAGATE else RuntimeError(f"{path}: failed to load on another rank")
        if worst == PROCESS:
            raise RuntimeError(f"{path}: failed to load ({why}), not a corrupt file that we can tell: nothing set "
                               "aside; resume again once the cause is fixed") from error
        if set_aside_now is not None:
            raise RuntimeError(f"{path}: failed to load too ({why}), after {set_aside_now.name} was set aside in this "
                               "attempt: two in a row look like a failure of this process; nothing more set aside")
        if dist.get_rank() == 0:
            log.warning("checkpoint %s set aside: it failed to load (%s); trying the previous one", path, why)
        set_aside_everywhere(path)
        set_aside_now = path
    if set_aside_now is not None:
        raise RuntimeError(f"{set_aside_now} failed to load and was set aside, and {root} holds no older checkpoint: "
                           "nothing to resume from")
    return None
