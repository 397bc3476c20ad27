"""Tied word embeddings (Qwen3-0.6B / 1.7B / 4B: `tie_word_embeddings: true`) under pipeline parallelism.

megatron-core keeps a copy of the first stage's embedding as the last stage's output layer (`output_layer.weight`,
flagged `shared_embedding`), equal to it at build (an all-reduce over the embedding group, first and last stage)
and kept equal by `finalize_model_grads`, which all-reduces the two copies' gradients. Here: the PP = 2 logits and
the tied gradient equal PP = 1's, one optimizer step gives PP = 1's weights with both copies still bitwise equal,
HF import fills both copies and the export emits the tied tensor once (from the first stage), the weight sync sends
it once, and a checkpoint written at PP = 2 resumes at PP = 1 and at PP = 2."""

import dataclasses
import os

import pytest
import torch

from megatron_pdm.models import (
    ParallelConfig,
    build_model,
    canonical_hf_state,
    forward_logits,
    hf_state_from_model,
    initialize_parallel,
    load_hf_checkpoint,
    load_hf_into_model,
    save_hf_checkpoint,
)
from tests.helpers import DENSE, hf_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TIED = dataclasses.replace(DENSE, tie_word_embeddings=True)


def _tied_hf_state(seed):
    """An HF tied model's state in the checkpoint layout (no lm_head.weight: transformers' state_dict lists the
    tied tensor under both names, save_pretrained and the engines keep model.embed_tokens.weight)."""
    state = canonical_hf_state(hf_model(TIED, seed=seed).state_dict())
    assert torch.equal(state.pop("lm_head.weight"), state["model.embed_tokens.weight"])
    return state


def _tied_copy(model):
    """This stage's copy of the tied embedding: the embedding on the first stage, the output layer's weight on the
    last (a PP = 1 model has only the embedding: its output layer has no weight of its own)."""
    return model.shared_embedding_or_output_weight()


def rank_pipeline_forward_backward(group, cfg, pp, hf_state, ids, weights, targets):
    """The logits and the tied embedding's gradient of sum(weights x log p(targets)), run stage by stage by hand
    at PP = 2 (stage 0's hidden states sent to stage 1, their gradient sent back), in one piece at PP = 1. At PP = 2
    the gradient is the sum of the two copies' (what finalize_model_grads all-reduces); also returned: whether the
    last stage's copy was built equal to the first stage's embedding (random init, before the HF import)."""
    import torch.distributed as dist

    from megatron_pdm.vocab_parallel import token_logprobs

    ctx = initialize_parallel(ParallelConfig(pipeline=pp))
    model = build_model(cfg, ctx)
    built = _tied_copy(model).detach().clone()
    if pp > 1:
        assert getattr(_tied_copy(model), "shared_embedding", False)  # megatron's flag on both copies
        copies = [torch.empty_like(built) for _ in range(pp)]
        dist.all_gather(copies, built, group=ctx.pp_group)
        built_equal = torch.equal(copies[0], copies[-1]) and float(built.abs().max()) > 0
    else:
        built_equal = None
    load_hf_into_model(model, hf_state, cfg, ctx)
    stage, last = ctx.pp_rank, ctx.is_last_stage()
    B, S = ids.shape
    logits = None
    if pp == 1 or not last:
        out = forward_logits(model, ids)
    if pp > 1 and not last:  # stage 0: hidden states [S, B, H] to stage 1, their gradient back
        dist.send(out.detach().contiguous(), dst=dist.get_global_rank(group, stage + 1))
        grad = torch.empty_like(out)
        dist.recv(grad, src=dist.get_global_rank(group, stage + 1))
        out.backward(grad)
    else:
        if pp > 1:
            h = torch.empty(S, B, cfg.hidden_size)
            dist.recv(h, src=dist.get_global_rank(group, stage - 1))
            h.requires_grad_(True)
            model.set_input_tensor(h)
            out = forward_logits(model, ids)
        logits = out.detach()
        lp = token_logprobs(out.reshape(-1, out.shape[-1]), targets.reshape(-1))
        (lp * weights.reshape(-1)).sum().backward()
        if pp > 1:
            dist.send(h.grad.contiguous(), dst=dist.get_global_rank(group, stage - 1))
    grad = _tied_copy(model).grad.clone()
    ctx.close()
    return logits, grad, built_equal


def test_pipeline_logits_and_tied_gradient_equal_pp1(dist_pools):
    """PP = 2 computes every op of PP = 1 on the same inputs in the same order: the stage boundary only moves
    fp32 bytes, and the last stage's output layer multiplies by a bitwise copy of the embedding. So the logits are
    bitwise PP = 1's. The tied gradient is the sum of the output layer's and the embedding's contributions in both
    layouts (autograd adds them at PP = 1, the sum of the two copies' gradients at PP = 2, one fp32 addition of
    the same two terms either way): bitwise too."""
    state = _tied_hf_state(seed=1)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, TIED.vocab_size, (3, 12), generator=g)
    weights, targets = torch.randn(3, 12, generator=g), torch.randint(0, TIED.vocab_size, (3, 12), generator=g)
    ref_logits, ref_grad, _ = dist_pools(1).run(rank_pipeline_forward_backward,
                                                shared=(TIED, 1, state, ids, weights, targets))[0]
    (_, g0, built0), (logits, g1, built1) = dist_pools(2).run(rank_pipeline_forward_backward,
                                                              shared=(TIED, 2, state, ids, weights, targets))
    assert built0 and built1  # megatron's all-reduce at build: the last stage's copy is the random embedding
    assert torch.equal(logits, ref_logits)
    assert float(g0.abs().max()) > 0 and float(g1.abs().max()) > 0  # both copies take part
    torch.testing.assert_close(g0 + g1, ref_grad, atol=0, rtol=0)


# ---------------------------------------------------------------------------------------------- HF import / export


def rank_import_export(group, cfg, pp, hf_state, directory):
    """Import at PP = pp, export; rank 0 saves the export as an HF checkpoint. Also this stage's copy of the tied
    embedding after the import."""
    import torch.distributed as dist

    ctx = initialize_parallel(ParallelConfig(pipeline=pp))
    model = build_model(cfg, ctx)
    load_hf_into_model(model, hf_state, cfg, ctx)
    exported = hf_state_from_model(model, cfg, ctx)
    if dist.get_rank() == 0:
        save_hf_checkpoint(directory, exported, cfg)
    copy = _tied_copy(model).detach().clone()
    ctx.close()
    return exported, copy


def test_hf_import_fills_both_copies_and_export_emits_the_tied_weight_once(dist_pools, tmp_path):
    """HF import loads model.embed_tokens.weight into the first stage's embedding and the last stage's output-layer
    copy; the export (all stages) is the checkpoint again, PP = 1's export exactly, with one tied tensor and no
    lm_head.weight, and transformers loads the saved checkpoint to the original model's logits."""
    import transformers

    state = _tied_hf_state(seed=3)
    ref, _ = dist_pools(1).run(rank_import_export, shared=(TIED, 1, state, str(tmp_path / "pp1")))[0]
    results = dist_pools(2).run(rank_import_export, shared=(TIED, 2, state, str(tmp_path / "pp2")))
    for exported, copy in results:
        assert exported.keys() == state.keys() == ref.keys()  # model.embed_tokens.weight, no lm_head.weight
        assert all(torch.equal(exported[k], state[k]) and torch.equal(exported[k], ref[k]) for k in state)
        assert torch.equal(copy, state["model.embed_tokens.weight"])  # either stage's copy
    reloaded, cfg = load_hf_checkpoint(tmp_path / "pp2")
    assert cfg == TIED and reloaded.keys() == state.keys()
    hf2 = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "pp2", local_files_only=True).float().eval()
    ids = torch.randint(0, TIED.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf2(ids).logits, hf_model(TIED, seed=3)(ids).logits, atol=1e-5, rtol=1e-5)


def test_weight_sync_sends_the_tied_weight_once(dist_pools):
    """The bucketed weight sync at PP = 2: the first stage sends model.embed_tokens.weight, the last stage sends its
    layers and the final norm but not its copy of the embedding (nor an lm_head.weight), every key once; the
    embedded engine ends with the checkpoint's weights bit for bit (its lm_head is its embedding)."""
    from tests.helpers import rank_buckets_and_sync

    state = _tied_hf_state(seed=7)
    results = dist_pools(2).run(rank_buckets_and_sync, shared=(TIED, ParallelConfig(pipeline=2), state, 8192))
    synced = results[0][1]
    assert synced.keys() == state.keys()
    assert all(torch.equal(synced[k], state[k]) for k in state)
    seen = {}
    for buckets, _, stage, _ in results:
        for b in buckets:
            for k, t in b.items():
                assert k not in seen, f"{k} sent twice"
                seen[k] = (stage, t)
    assert seen.keys() == state.keys() and "lm_head.weight" not in seen
    assert seen["model.embed_tokens.weight"][0] == 0 and seen["model.norm.weight"][0] == 1
    assert all(torch.equal(t, state[k]) for k, (_, t) in seen.items())


# ---------------------------------------------------------------------------------------------- training, checkpoints


def rank_train_copies(group, cfg, run_dir, resume=False):
    """`tests.helpers.rank_train` (the metrics rows and the exported HF state), and this stage's copy of the
    tied embedding after the run."""
    from pathlib import Path

    from megatron_pdm.train.trainer import Trainer

    trainer = Trainer(cfg, Path(run_dir))
    rows = trainer.run(resume=resume)
    state = hf_state_from_model(trainer.chunks, cfg.model, trainer.parallel)
    copy = _tied_copy(trainer.chunks[0]).detach().clone()
    trainer.parallel.close()
    return rows, state, copy


def _train_model():
    from tests.helpers import TRAIN_DENSE

    return {**TRAIN_DENSE, "tie_word_embeddings": True}


_INIT = {}  # the warm-started tied model, built once per test session (deterministic: seeded)


def _init_checkpoint(tmp_path, dist_pools):
    """tests.helpers.init_checkpoint for the tied model (whose HF state_dict lists the tied tensor twice, which
    safetensors refuses to save): a random tied model warm-started at PP = 1, as an HF checkpoint."""
    from megatron_pdm.models import ModelConfig
    from tests.helpers import rank_train, train_cfg

    if "init" in _INIT and (_INIT["init"] / "config.json").is_file():
        return _INIT["init"]
    model = _train_model()
    cfg = ModelConfig(**model)
    state = canonical_hf_state(hf_model(cfg, seed=11).state_dict())
    del state["lm_head.weight"]
    save_hf_checkpoint(tmp_path / "random", state, cfg)
    warm = train_cfg(model, {}, tmp_path / "random", warm_start_steps=20, warm_start_lr=1e-2, steps=1)
    _, state = dist_pools(1).run(rank_train, shared=(warm, str(tmp_path / "warm")))[0]
    save_hf_checkpoint(tmp_path / "init", state, cfg)
    _INIT["init"] = tmp_path / "init"
    return _INIT["init"]


def test_training_step_at_pp2_equals_pp1_and_keeps_the_copies_equal(dist_pools, tmp_path):
    """One RL step (one optimizer update over 6 micro-batches through megatron's pipeline schedule, DDP and
    finalize_model_grads) from the same tied weights on the same rollouts: PP = 2 gives PP = 1's weights (fp32
    summation order: the tolerance of `tests.helpers.compare_rows`), and the first stage's embedding
    and the last stage's output-layer copy are bitwise equal after it (the same all-reduced gradient, the same
    Adam state, the same update)."""
    from tests.helpers import compare_rows, train_cfg

    model = _train_model()
    init = _init_checkpoint(tmp_path, dist_pools)
    one = dict(steps=1, minibatches=1)
    ref_rows, ref_state, _ = dist_pools(1).run(rank_train_copies, shared=(train_cfg(model, {}, init, **one),
                                                                         str(tmp_path / "pp1")))[0]
    results = dist_pools(2).run(rank_train_copies, shared=(train_cfg(model, {"pipeline": 2}, init, **one),
                                                          str(tmp_path / "pp2")))
    compare_rows(results[0][0], ref_rows, sampled_after_update=False)
    assert any(r.get("train/loss") for r in ref_rows)
    # the gradient norm counts the tied weight once: megatron leaves the last stage's copy (`shared`) out of it
    norms = [[r["train/grad_norm"] for r in rows if "train/grad_norm" in r] for rows in (results[0][0], ref_rows)]
    assert norms[1] and norms[0] == pytest.approx(norms[1], rel=1e-4)
    init_state, _ = load_hf_checkpoint(init)
    assert "lm_head.weight" not in init_state and ref_state.keys() == init_state.keys()
    for _, state, _ in results:
        assert state.keys() == ref_state.keys()
        for k in ref_state:
            torch.testing.assert_close(state[k], ref_state[k], atol=2e-5, rtol=1e-4, msg=lambda m, k=k: f"{k}: {m}")
    (_, _, first), (_, _, last) = results
    assert torch.equal(first, last)
    embedding = "model.embed_tokens.weight"
    assert float((ref_state[embedding] - init_state[embedding]).abs().max()) > 1e-3  # the tied weight moved


def test_checkpoint_at_pp2_resumes_at_pp2_and_pp1(dist_pools, tmp_path):
    """A checkpoint written at PP = 2 (distributed optimizer): megatron saves the last stage's copy as a replica of
    the first stage's embedding (one tensor in the checkpoint, under the embedding's key), so PP = 2 and PP = 1 both
    load it, the weights exactly the writer's and both PP = 2 copies equal. (Resharding the optimizer state across
    PP sizes is tested for untied models in tests/train/test_checkpoint.py; the tied weight adds only this key.)"""
    from tests.helpers import _with, train_cfg

    model = _train_model()
    init = _init_checkpoint(tmp_path, dist_pools)
    cfg = lambda parallel, steps: _with(train_cfg(model, parallel, init, steps=steps, checkpoint_every=2),  # noqa: E731
                                        optim={"distributed_optimizer": True})
    pp2 = {"pipeline": 2}
    _, at_two, _ = dist_pools(2).run(rank_train_copies, shared=(cfg(pp2, 2), str(tmp_path / "run")))[0]
    from megatron.core import dist_checkpointing

    saved = dist_checkpointing.load_tensors_metadata(str(tmp_path / "run" / "checkpoints" / "step_00000002"))
    assert "embedding.word_embeddings.weight" in saved and not [k for k in saved if "output_layer" in k]
    (_, same, first), (_, _, last) = dist_pools(2).run(rank_train_copies,
                                                       shared=(cfg(pp2, 2), str(tmp_path / "run"), True))
    assert torch.equal(first, last)
    _, loaded, _ = dist_pools(1).run(rank_train_copies, shared=(cfg({}, 2), str(tmp_path / "run"), True))[0]
    for k in at_two:
        torch.testing.assert_close(same[k], at_two[k], atol=0, rtol=0)
        torch.testing.assert_close(loaded[k], at_two[k], atol=0, rtol=0)
