"""`megatron-pdm export`."""

from __future__ import annotations

from megatron_pdm.commands import add_writer_parser, input_errors, refuse


def add_parser(subparsers) -> None:
    add_writer_parser(subparsers, "export", run, "checkpoint", "a checkpoint directory (<run-dir>/checkpoints/step_N)")


def run(args) -> int:
    """Write a training checkpoint as an HF checkpoint (safetensors shards, index, config.json, tokenizer), from one
    process whatever layout wrote it."""
    from megatron_pdm.train.export import check_export, export_job
    from megatron_pdm.train.launch import launch

    try:  # the checkpoint, its config and the target checked before the process starts
        check_export(args.checkpoint, args.to, force=args.force)
        launch(export_job, (args.checkpoint, args.to, args.force), None, nproc=1)
    except input_errors() as e:
        return refuse("export", e)
    print(f"exported {args.checkpoint} to {args.to}")
    return 0
