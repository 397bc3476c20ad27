"""The embedded rollout engine: a separate inference copy of the policy (HF transformers) on this machine.

It is the default engine on CPU: batched sampling with a KV cache from `softmax(logits / T)` computed in float32,
returning per position the sampled token's log-prob and the top-K of the same distribution. Weights arrive in
the HF layout that `megatron_pdm.models.hf` exports (the same a SGLang server loads).

The model computes in `dtype` (real bf16 / fp16 matmuls on a CPU). quantization "fp8" emulates SGLang's
block-FP8 serving: at every weight update each linear weight (not the embeddings, the output layer or the norms)
is quantized to float8_e4m3fn with one scale per 128 x 128 block and dequantized into `dtype`, so the engine
samples from the weights an FP8 engine holds; the GEMMs themselves then run in `dtype`, not in fp8.
"""

from __future__ import annotations

import os

import torch

from megatron_pdm.models.config import ModelConfig
from megatron_pdm.models.hf import hf_config_dict
from megatron_pdm.precision import fp8_block_dequantize, fp8_block_quantize

from .base import RolloutSample, SamplingParams

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
QUANTIZATIONS = (None, "fp8")
_UNQUANTIZED = ("embed_tokens", "lm_head", "norm", "mlp.gate.weight")  # kept in dtype, as FP8 checkpoints keep them


def _quantized(name: str, w: torch.Tensor) -> bool:
    return w.dim() >= 2 and not any(part in name for part in _UNQUANTIZED)


def _fuse_experts(state: dict[str, torch.Tensor], model_keys) -> dict[str, torch.Tensor]:
    """Per-expert checkpoint keys -> transformers>=5's fused in-memory experts, when the model uses them."""
    if not any(k.endswith("mlp.experts.gate_up_proj") for k in model_keys):
        return state
    out, experts = {}, {}
    for k, v in state.items():
        if ".mlp.experts." in k:
            prefix, rest = k.split(".mlp.experts.")
            e, name = rest.split(".", 1)
            experts.setdefault(prefix, {}).setdefault(int(e), {})[name] = v
        else:
            out[k] = v
    for prefix, per in experts.items():
        order = sorted(per)
        out[f"{prefix}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([per[e]["gate_proj.weight"], per[e]["up_proj.weight"]]) for e in order])
        out[f"{prefix}.mlp.experts.down_proj"] = torch.stack([per[e]["down_proj.weight"] for e in order])
    return out


class EmbeddedEngine:
    """`RolloutEngine` backed by a transformers model built from a `ModelConfig` (no hub access)."""

    def __init__(self, cfg: ModelConfig, *, dtype: str = "float32", quantization: str | None = None,
                 max_batch_size: int = 64):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        import transformers

        if dtype not in DTYPES:
            raise ValueError(f"engine dtype: {dtype!r} is not one of {', '.join(DTYPES)}")
        if quantization not in QUANTIZATIONS:
            raise ValueError(f"engine quantization: {quantization!r} is not one of {QUANTIZATIONS}")
        self.cfg, self.quantization = cfg, quantization
        self.dtype = DTYPES[dtype]
        self.max_batch_size = max_batch_size
        hf_cfg = transformers.AutoConfig.for_model(
            **{k: v for k, v in hf_config_dict(cfg).items() if k not in ("architectures", "torch_dtype")})
        self.model = transformers.AutoModelForCausalLM.from_config(hf_cfg).to(self.dtype).eval()
        self.weight_version = -1
        self.released = False

    # -- weights ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def update_weights(self, state: dict[str, torch.Tensor], version: int) -> None:
        if self.released:
            raise ValueError("update_weights: memory released (resume_memory_occupation first)")
        own = self.model.state_dict()
        state = _fuse_experts(state, own)
        missing = sorted(set(own) - set(state))
        unexpected = sorted(set(state) - set(own))
        if missing or unexpected:
            raise ValueError(f"update_weights: state does not match the model (missing {missing[:4]}, "
                             f"unexpected {unexpected[:4]})")
        for k, v in state.items():
            if self.quantization == "fp8" and _quantized(k, v):
                v = fp8_block_dequantize(*fp8_block_quantize(v), own[k].dtype)
            own[k].copy_(v.to(own[k].dtype))
        self.weight_version = version

    def health(self) -> bool:
        return self.weight_version >= 0 or self.released

    # -- memory occupation (colocated engines give their memory to the trainer while it trains) -------------
    def release_memory(self) -> None:
        """Free the weights' storage (SGLang's /release_memory_occupation); they are gone until `resume_memory`
        and the next `update_weights`."""
        self._shapes = {n: (p.shape, p.dtype) for n, p in self.model.named_parameters()}
        for p in self.model.parameters():
            p.data = torch.empty(0, dtype=p.dtype)
        self.released, self.weight_version = True, -1

    def resume_memory(self) -> None:
        """Allocate the weights' storage again (zeros: the next `update_weights` fills them)."""
        if not self.released:
            return
        for n, p in self.model.named_parameters():
            shape, dtype = self._shapes[n]
            p.data = torch.zeros(shape, dtype=dtype)
        self.released = False

    def close(self) -> None:
        pass

    # -- sampling -----------------------------------------------------------------------------------------
    def _check(self, prompts, params: SamplingParams):
        if self.released:
            raise ValueError("generate: memory released (resume_memory_occupation, then update the weights)")
        if self.weight_version < 0:
            raise RuntimeError("generate: no weights loaded yet (call update_weights first)")
        if params.top_k_logprobs > self.cfg.vocab_size:
            raise ValueError(f"sampling.top_k_logprobs: {params.top_k_logprobs} exceeds the vocabulary size "
                             f"{self.cfg.vocab_size}")
        limit = self.cfg.max_position_embeddings
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"prompts[{i}]: empty prompt")
            if len(p) + params.max_new_tokens > limit:
                raise ValueError(f"prompts[{i}]: prompt length {len(p)} + max_new_tokens {params.max_new_tokens} "
                                 f"exceeds the context length {limit}")
            bad = [t for t in p if not 0 <= t < self.cfg.vocab_size]
            if bad:
                raise ValueError(f"prompts[{i}]: token id {bad[0]} outside [0, {self.cfg.vocab_size})")

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[RolloutSample]:
        self._check(prompts, params)
        gen = torch.Generator().manual_seed(params.seed if params.seed is not None else
                                            int(torch.randint(0, 2**62, ())))
        jobs = [(i, list(p)) for i, p in enumerate(prompts) for _ in range(params.n)]
        out = []
        for b in range(0, len(jobs), self.max_batch_size):
            out += self._generate_batch(jobs[b : b + self.max_batch_size], params, gen)
        return out

    @torch.no_grad()
    def _generate_batch(self, jobs, params: SamplingParams, gen) -> list[RolloutSample]:
        from transformers import DynamicCache

        B, K, T = len(jobs), params.top_k_logprobs, params.temperature
        lengths = torch.tensor([len(p) for _, p in jobs])
        width = int(lengths.max())
        ids = torch.zeros(B, width, dtype=torch.long)
        attn = torch.zeros(B, width, dtype=torch.long)
        for r, (_, p) in enumerate(jobs):  # left padding: the last prompt token of every row is at width - 1
            ids[r, width - len(p):] = torch.tensor(p)
            attn[r, width - len(p):] = 1
        stop = torch.tensor(list(params.stop_token_ids), dtype=torch.long)
        cache = DynamicCache()
        done = torch.zeros(B, dtype=torch.bool)
        tokens, logps, top_ids, top_lps = [], [], [], []
        finished_at = torch.full((B,), params.max_new_tokens, dtype=torch.long)
        step_ids, pos = ids, (attn.cumsum(-1) - 1).clamp_min(0)
        for t in range(params.max_new_tokens):
            logits = self.model(input_ids=step_ids, attention_mask=attn, position_ids=pos, past_key_values=cache,
                                use_cache=True).logits[:, -1]
            logp = torch.log_softmax(logits.float() / T, dim=-1)
            nxt = torch.multinomial(logp.exp(), 1, generator=gen).squeeze(-1)
            lp_top, id_top = logp.topk(K, dim=-1)
            if params.topk_include_sampled:
                outside = ~(id_top == nxt[:, None]).any(-1)
                id_top[outside, -1] = nxt[outside]
                lp_top[outside, -1] = logp[outside].gather(1, nxt[outside, None]).squeeze(-1)
            tokens.append(nxt)
            logps.append(logp.gather(1, nxt[:, None]).squeeze(-1))
            top_ids.append(id_top)
            top_lps.append(lp_top)
            if stop.numel():
                newly = ~done & (nxt[:, None] == stop).any(-1)
                finished_at[newly] = t + 1
                done |= newly
            if bool(done.all()):
                break
            step_ids = nxt[:, None]
            attn = torch.cat([attn, torch.ones(B, 1, dtype=attn.dtype)], dim=-1)
            pos = pos[:, -1:] + 1
        tokens, logps = torch.stack(tokens, 1), torch.stack(logps, 1)
        top_ids, top_lps = torch.stack(top_ids, 1), torch.stack(top_lps, 1)
        samples = []
        for r, (i, p) in enumerate(jobs):
            n = int(finished_at[r].clamp(max=tokens.shape[1]))
            samples.append(RolloutSample(
                prompt_index=i, prompt_ids=p, response_ids=tokens[r, :n].clone(), token_logprobs=logps[r, :n].clone(),
                topk_ids=top_ids[r, :n].clone(), topk_logprobs=top_lps[r, :n].clone(),
                finish_reason="stop" if bool(done[r]) else "length", weight_version=self.weight_version,
            ))
        return samples
