"""The rollout engines by name (`rollout.engine`): each one's `EngineSpec` (spec.py). A new engine is a package
beside sglang/ with its spec, one entry here and its sub-section's field in `RolloutConfig`."""

from __future__ import annotations

from .sglang.spec import SPEC as SGLANG
from .spec import EngineSpec


def _eos_ids(tokenizer_dir) -> tuple[int, ...]:
    """The EOS ids an SGLang engine stops at when its checkpoint carries the tokenizer files of `tokenizer_dir` (the
    trainer's exports do): none without a tokenizer."""
    if tokenizer_dir is None:
        return ()
    from megatron_pdm.models.tokenizer import load_tokenizer

    from .sglang.wire import checkpoint_eos_ids

    return checkpoint_eos_ids(tokenizer_dir, load_tokenizer(tokenizer_dir).stop_ids)


def _build_embedded(rollout, model_cfg, precision_cfg, *, dtype: str, quantization: str | None, run_dir,
                    tokenizer_dir):
    """An in-process `EmbeddedEngine` computing in the rollout dtype (fp8: bf16 compute on block-FP8-rounded
    weights), stopping at the EOS ids an SGLang engine on the trainer's export stops at."""
    from .embedded import EmbeddedEngine

    return EmbeddedEngine(model_cfg, dtype=dtype, quantization=quantization, eos_token_ids=_eos_ids(tokenizer_dir))


EMBEDDED = EngineSpec(name="embedded", build=_build_embedded)
ENGINES: dict[str, EngineSpec] = {spec.name: spec for spec in (EMBEDDED, SGLANG)}


def engine_spec(name: str) -> EngineSpec:
    """The spec of engine `name`; ValueError naming it and the known engines."""
    if name not in ENGINES:
        raise ValueError(f"rollout.engine: {name!r} is not one of {', '.join(ENGINES)}")
    return ENGINES[name]
