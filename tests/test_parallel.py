"""The `ParallelContext` (models/parallel.py): built once from megatron's `parallel_state`, which no other module
reads, and equal to what megatron's own getters say for every layout kind (TP, PP, CP, EP with expert-TP, DP)."""

import ast
from pathlib import Path

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
