"""`megatron-pdm serve` (the server itself: rollout/server.py)."""

from __future__ import annotations

from megatron_pdm.commands import EPILOG


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("serve", help=run.__doc__, epilog=EPILOG)
    p.add_argument("--model-path", required=True, help="HF checkpoint directory (config.json + *.safetensors)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--quantization", choices=["fp8"],
                   help="as SGLang's: block-FP8 weights (emulated: see rollout/embedded.py)")
    p.add_argument("--weight-version", type=int, default=0, help="the version of the weights at --model-path")
    p.add_argument("--tokenizer", help="tokenizer directory (default: --model-path's tokenizer files, if any)")
    p.set_defaults(func=run)


def run(args) -> int:
    """Serve an HF checkpoint with the embedded engine over SGLang's HTTP worker API (the subset we use)."""
    from megatron_pdm.rollout.sglang.server import serve

    serve(args.model_path, host=args.host, port=args.port, dtype=args.dtype, quantization=args.quantization,
          weight_version=args.weight_version, tokenizer=args.tokenizer)
    return 0
