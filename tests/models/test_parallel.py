"""The `ParallelContext` (models/parallel.py): built once from megatron's `parallel_state`, which no other module
reads, and equal to what megatron's own getters say for every layout kind (TP, PP, CP, EP with expert-TP, DP). The
MoE dispatch keys (model.moe_token_dispatcher_type, moe_enable_deepep, moe_grouped_gemm): their checks, and the
allgather dispatcher against alltoall."""

import ast
from pathlib import Path

import pytest
import torch

import megatron_pdm

PACKAGE = Path(megatron_pdm.__file__).parent


def _reads_parallel_state(tree: ast.AST) -> list[int]:
    """Lines of `tree` that import megatron's parallel_state (or its old name, mpu) in any spelling."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = {a.name for a in node.names}
            if node.module in ("megatron.core.parallel_state", "megatron.core.mpu") or (
                    node.module == "megatron.core" and names & {"parallel_state", "mpu"}):
                lines.append(node.lineno)
        elif isinstance(node, ast.Import):
            if any(a.name in ("megatron.core.parallel_state", "megatron.core.mpu") for a in node.names):
                lines.append(node.lineno)
    return lines


def test_parallel_state_is_read_only_where_the_context_is_built():
    """No module but models/parallel.py imports megatron's parallel_state (its globals): every other one takes the
    process groups from the ParallelContext passed down to it."""
    readers = {str(p.relative_to(PACKAGE)): lines for p in sorted(PACKAGE.rglob("*.py"))
               if (lines := _reads_parallel_state(ast.parse(p.read_text(), str(p))))}
    assert set(readers) == {"models/parallel.py"}, readers
    # the scan finds the spellings it looks for
    spellings = ("from megatron.core import parallel_state as ps\nimport megatron.core.parallel_state\n"
                 "from megatron.core.parallel_state import get_tensor_model_parallel_group\n")
    assert _reads_parallel_state(ast.parse(spellings)) == [1, 2, 3]


LAYOUTS = [dict(tensor=2, pipeline=2), dict(tensor=2, context=2), dict(context=2), dict(expert=2, tensor=2),
           dict(expert=4, expert_tensor=1), dict(pipeline=2, context=2), dict(pipeline=4, virtual=2)]


def rank_context_against_megatron(group, layouts):
    """For each layout: the context's ranks, sizes, groups, stages, export roles and replicas, and megatron's getters'
    view of the same (read here, in the test, while the context is alive)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_pdm.models import ParallelConfig, initialize_parallel

    out = []
    for layout in layouts:
        with initialize_parallel(ParallelConfig(**layout)) as ctx:
            ours = dict(
                tp=(ctx.tp_rank, ctx.tp), pp=(ctx.pp_rank, ctx.pp), cp=(ctx.cp_rank, ctx.cp), dp=(ctx.dp_rank, ctx.dp),
                ep=(ctx.ep_rank, ctx.ep), etp=(ctx.etp_rank, ctx.etp), last=ctx.pipeline_ranks[-1],
                first_stage=ctx.is_first_stage(), last_stage=ctx.is_last_stage(),
                tp_group=None if ctx.tp_group is None else dist.get_process_group_ranks(ctx.tp_group),
                cp_group=None if ctx.cp_group is None else dist.get_process_group_ranks(ctx.cp_group),
                dp_cp=dist.get_process_group_ranks(ctx.dp_cp_group),
                sender=ctx.roles.sender, dense=ctx.roles.dense, expert=ctx.roles.expert,
                replica=None if ctx.replica_group is None else sorted(dist.get_process_group_ranks(ctx.replica_group)),
                replicas=ctx.replicas,
                columns=ctx.routed_columns(torch.arange(8)[None].expand(2, 8)).tolist(),
                chunks=[(ctx.is_first_stage(v), ctx.is_last_stage(v)) for v in range(ctx.config.virtual)])
            theirs = dict(
                tp=(ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()),
                pp=(ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()),
                cp=(ps.get_context_parallel_rank(), ps.get_context_parallel_world_size()),
                dp=(ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()),
                ep=(ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size()),
                etp=(ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size()),
                last=ps.get_pipeline_model_parallel_last_rank(),
                first_stage=ps.is_pipeline_first_stage(), last_stage=ps.is_pipeline_last_stage(),
                tp_group=dist.get_process_group_ranks(ps.get_tensor_model_parallel_group())
                if layout.get("tensor", 1) > 1 else None,
                cp_group=dist.get_process_group_ranks(ps.get_context_parallel_group())
                if layout.get("context", 1) > 1 else None,
                dp_cp=dist.get_process_group_ranks(ps.get_data_parallel_group(with_context_parallel=True)),
                expert_dp=ps.get_expert_data_parallel_rank(),
                chunks=[(ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=v),
                         ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=v))
                        for v in range(layout.get("virtual", 1))])
            out.append((dist.get_rank(), ours, theirs))
    return out


def test_context_agrees_with_megatron(dist_pools):
    """Over 4 ranks and seven layouts (virtual stages among them): every rank, size and chunk's stage is megatron's;
    each stage has exactly one export sender, the rank whose every rank is 0; the replicas partition the world into
    DP groups of TP x CP x PP ranks (the replica group: megatron's model-parallel group without CP, one made here
    with CP); a router sees this TP rank's chunk of the sequence under sequence parallelism."""
    per_rank = dist_pools(4).run(rank_context_against_megatron, shared=(LAYOUTS,))
    for i, layout in enumerate(LAYOUTS):
        rows = [r[i] for r in per_rank]
        for rank, ours, theirs in rows:
            for key in ("tp", "pp", "cp", "dp", "ep", "etp", "last", "first_stage", "last_stage", "tp_group",
                        "cp_group", "dp_cp", "chunks"):
                assert ours[key] == theirs[key], (layout, rank, key)
            tp_rank, cp_rank, dp_rank = ours["tp"][0], ours["cp"][0], ours["dp"][0]
            assert ours["dense"] == (dp_rank == 0 and cp_rank == 0), (layout, rank)
            assert ours["expert"] == (theirs["expert_dp"] == 0), (layout, rank)
            assert ours["sender"] == (ours["dense"] and ours["expert"] and tp_rank == 0 and ours["ep"][0] == 0
                                      and ours["etp"][0] == 0), (layout, rank)
            replica = list(ours["replicas"][dp_rank])
            assert rank in replica and len(replica) == 4 // ours["dp"][1]
            assert ours["replica"] == (replica if len(replica) > 1 else None), (layout, rank)
            tp = ours["tp"][1]
            assert ours["columns"] == [list(range(8))[tp_rank * 8 // tp:(tp_rank + 1) * 8 // tp]] * 2
        senders = {}
        for rank, ours, _ in rows:
            senders.setdefault(ours["pp"][0], []).append(rank) if ours["sender"] else None
        assert senders == {s: [min(r for r, o, _ in rows if o["pp"][0] == s)] for s in range(layout.get("pipeline", 1))}
        assert sorted(r for rep in rows[0][1]["replicas"] for r in rep) == [0, 1, 2, 3]


def rank_own_groups_freed(group):
    import gc
    import weakref

    from megatron_pdm.models import ParallelConfig, initialize_parallel

    ctx = initialize_parallel(ParallelConfig(context=2))
    refs = [weakref.ref(g) for g in ctx.own_groups]
    ctx.close()
    ctx.close()  # a second close does nothing (its groups are gone already)
    del ctx
    gc.collect()
    return len(refs), sum(r() is not None for r in refs)


def test_close_frees_the_groups_it_made(dist_pools):
    """With CP > 1 the replica groups are the context's own (megatron has no TP x CP x PP group): close() destroys
    them with megatron's, and nothing keeps them (a gloo group polls with three threads until it is freed)."""
    for made, alive in dist_pools(4).run(rank_own_groups_freed):
        assert (made, alive) == (1, 0)  # its own replica's; the other replica's group is not this rank's


# ---------------------------------------------------------------------------------------------- MoE dispatch keys


def _moe_cfg(model=None, **sections):
    from megatron_pdm.train.config import config_from_dict
    from megatron_pdm.train.data import ARITHMETIC_TOKENIZER
    from tests.helpers import TRAIN_MOE

    return config_from_dict({"model": {**TRAIN_MOE, "tokenizer": str(ARITHMETIC_TOKENIZER), **(model or {})},
                             **sections})


def test_moe_dispatch_keys_are_checked_at_load():
    """model.moe_token_dispatcher_type / moe_enable_deepep / moe_grouped_gemm: a bad value, DeepEP without flex (or
    flex without DeepEP), allgather under pipeline parallelism, a setting on a dense model and CUDA kernels on a CPU
    cluster are each refused at load, naming the field and the value."""
    from megatron_pdm.train.config import config_from_dict

    assert _moe_cfg({"moe_token_dispatcher_type": "allgather"}).model.moe_token_dispatcher_type == "allgather"
    bad = [({"moe_token_dispatcher_type": "deepep"}, {}, "model.moe_token_dispatcher_type: 'deepep' is not one of"),
           ({"moe_grouped_gemm": "yes"}, {}, "model.moe_grouped_gemm: expected true or false, got 'yes'"),
           ({"moe_enable_deepep": True}, {}, "model.moe_enable_deepep: True with moe_token_dispatcher_type 'alltoall'"),
           ({"moe_token_dispatcher_type": "flex"}, {}, "model.moe_enable_deepep: False with moe_token_dispatcher_type"),
           ({"moe_token_dispatcher_type": "allgather"}, {"parallel": {"pipeline": 2}},
            "moe_token_dispatcher_type 'allgather' takes no variable sequence lengths, which PP 2 needs"),
           ({"moe_grouped_gemm": True}, {"cluster": {"gpu": "cpu", "gpus_per_node": 2}},
            "model.moe_grouped_gemm: true runs Transformer Engine's grouped GEMM kernels, which this machine lacks "
            r"\(cuda=False, transformer_engine=False\); set it false \(cluster.gpu 'cpu'\)"),
           ({"moe_token_dispatcher_type": "flex", "moe_enable_deepep": True},
            {"cluster": {"gpu": "cpu", "gpus_per_node": 2}}, "model.moe_token_dispatcher_type: 'flex'")]
    for model, sections, message in bad:
        with pytest.raises(ValueError, match=message):
            _moe_cfg(model, **sections)
    with pytest.raises(ValueError, match="model.moe_grouped_gemm: True does nothing with .* a setting of MoE layers"):
        config_from_dict({"model": {"moe_grouped_gemm": True}})


def test_moe_kernels_need_cuda_and_their_packages():
    """flex needs CUDA and DeepEP, grouped GEMM CUDA and Transformer Engine (the grouped linear whose weights the
    checkpoint mapping reads); a dense model or alltoall / allgather need neither. On this CPU machine the model
    builder refuses both before building anything."""
    from megatron_pdm.models import ModelConfig, moe_kernel_problem
    from megatron_pdm.models.gpt import check_moe_kernels
    from tests.helpers import TRAIN_MOE

    flex = ModelConfig(**TRAIN_MOE, moe_token_dispatcher_type="flex", moe_enable_deepep=True)
    grouped = ModelConfig(**TRAIN_MOE, moe_grouped_gemm=True)
    gpu = dict(cuda=True, transformer_engine=True, deep_ep=True)
    assert moe_kernel_problem(flex, **gpu) is None and moe_kernel_problem(grouped, **gpu) is None
    assert "deep_ep=False" in moe_kernel_problem(flex, **{**gpu, "deep_ep": False})
    assert "transformer_engine=False" in moe_kernel_problem(grouped, **{**gpu, "transformer_engine": False})
    for ok in (ModelConfig(**TRAIN_MOE), ModelConfig(**TRAIN_MOE, moe_token_dispatcher_type="allgather"),
               ModelConfig()):
        assert moe_kernel_problem(ok, cuda=False, transformer_engine=False, deep_ep=False) is None
        check_moe_kernels(ok)
    if not torch.cuda.is_available():
        for cfg, field in ((flex, "moe_token_dispatcher_type"), (grouped, "moe_grouped_gemm")):
            with pytest.raises(ValueError, match=f"model.{field}: .* which this machine lacks"):
                check_moe_kernels(cfg)


def test_grouped_gemm_expert_names_map_to_the_local_spec():
    """Under grouped GEMM, Transformer Engine's grouped linear holds local expert j's weight as the j-th GEMM's
    (`linear_fc1.weight{j}`, the same [rows, H] tensor): the checkpoint mapping finds it under that name."""
    from megatron_pdm.models.hf.mapping import _param, _te_name

    name = "decoder.layers.3.mlp.experts.local_experts.{}.linear_fc{}.weight"
    assert _te_name(name.format(12, 1)) == "decoder.layers.3.mlp.experts.linear_fc1.weight12"
    assert _te_name(name.format(0, 2)) == "decoder.layers.3.mlp.experts.linear_fc2.weight0"
    grouped = {"decoder.layers.3.mlp.experts.linear_fc2.weight1": "w1"}
    assert _param(grouped, name.format(1, 2)) == "w1"
    assert _te_name("decoder.layers.3.mlp.router.weight") == "decoder.layers.3.mlp.router.weight"


@pytest.mark.parametrize("parallel", [{"expert": 2}, {"tensor": 2}], ids=["ep2", "tp2"])
def test_allgather_dispatcher_step_equals_alltoall(dist_pools, parallel):
    """megatron's allgather dispatcher runs on the CPU: one R3 update (random replayed routes, so that tokens cross
    ranks) through it equals the alltoall dispatcher's, in loss, gradient norm and every reduced gradient."""
    from tests.helpers import TRAIN_MOE
    from tests.train.test_r3_recompute import rank_r3_step

    alltoall = dist_pools(2).run(rank_r3_step, shared=(TRAIN_MOE, parallel, "none"))
    allgather = dist_pools(2).run(rank_r3_step, shared=({**TRAIN_MOE, "moe_token_dispatcher_type": "allgather"},
                                                        parallel, "none"))
    for (loss, norm, grads, *_), (loss_g, norm_g, grads_g, *_) in zip(alltoall, allgather, strict=True):
        # the same expert GEMMs on the same tokens; the outputs return by reduce-scatter instead of all-to-all, so
        # the sums over TP's partial products may run in another order: fp32 rounding, ~1e-8 measured
        assert loss_g == pytest.approx(loss, rel=1e-6) and norm_g == pytest.approx(norm, rel=1e-6)
        for k in grads:
            torch.testing.assert_close(grads_g[k], grads[k], rtol=1e-6, atol=1e-7, msg=lambda m, k=k: f"{k}: {m}")
