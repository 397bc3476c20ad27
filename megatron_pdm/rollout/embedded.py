"""The embedded rollout engine: a separate inference copy of the policy (HF transformers) on this machine.

It is the default engine on CPU: batched sampling with a KV cache from `softmax(logits / T)` computed in float32,
returning per position the sampled token's log-prob and the top-K of the same distribution. Sampling noise is
counter-based, per (sample seed, position): a sample does not depend on the batch it was drawn in, and a generation
continued with `extend` draws what an uncut one draws. Weights arrive in
the HF layout that `megatron_pdm.models.hf` exports (the same a SGLang server loads).

The model computes in `dtype` (bf16 / fp16 products: torch's, or where the CPU has no native GEMM for the
dtype float32 ones on the same inputs, rounded: compat patch 11). quantization "fp8" emulates SGLang's
block-FP8 serving: at every weight update each linear weight (not the embeddings, the output layer or the norms)
is quantized to float8_e4m3fn with one scale per 128 x 128 block and dequantized into `dtype`, so the engine
samples from the weights an FP8 engine holds; the GEMMs themselves then run in `dtype`, not in fp8.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Mapping

import torch

from megatron_pdm.compat import lowp_gemm_emulated, lowp_gemm_scope
from megatron_pdm.models.config import ModelConfig
from megatron_pdm.models.hf import canonical_hf_state, hf_config_dict, is_mtp_key
from megatron_pdm.precision import FP8_SCALE_SUFFIX, fp8_block_dequantize, fp8_block_quantize, fp8_quantizable

from .base import RolloutSample, SamplingParams, TeacherScores, Weights, check_score_inputs, position_seed, sample_seeds

log = logging.getLogger(__name__)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
QUANTIZATIONS = (None, "fp8")


def _truncated_probs(logp: torch.Tensor, top_p: float, top_k: int) -> torch.Tensor:
    """softmax restricted to the top_k most likely tokens and then to the smallest set holding top_p of the mass
    (SGLang's order); the log-probs returned to the trainer stay those of the untruncated distribution."""
    probs = logp.exp()
    if top_k != -1:
        kth = probs.topk(min(top_k, probs.shape[-1]), dim=-1).values[..., -1:]
        probs = probs.masked_fill(probs < kth, 0)
    if top_p < 1:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p  # mass strictly above each token: keep while it is < top_p
        probs = probs.scatter(-1, order, sorted_p.masked_fill(before >= top_p * sorted_p.sum(-1, keepdim=True), 0))
    return probs


def _expert_target(name: str, model_keys) -> tuple[str, int, slice | None] | None:
    """Where a per-expert checkpoint key lives in transformers>=5's fused in-memory experts: (fused key, expert,
    row slice of gate_up_proj or None for down_proj); None when the model keeps per-expert modules."""
    if ".mlp.experts." not in name:
        return None
    prefix, rest = name.split(".mlp.experts.")
    fused = f"{prefix}.mlp.experts.gate_up_proj"
    if fused not in model_keys:
        return None
    e, proj = rest.split(".", 1)
    if proj == "down_proj.weight":
        return f"{prefix}.mlp.experts.down_proj", int(e), None
    half = model_keys[fused].shape[1] // 2
    return fused, int(e), slice(0, half) if proj == "gate_proj.weight" else slice(half, 2 * half)


def _unpaired_fp8(named) -> dict[str, str]:
    """weight -> the half present ("q": its float8 tensor, "scales": its `_scale_inv`) for every block-FP8 weight
    of the (name, tensor) pairs `named` that lacks the other half (as `EmbeddedEngine._fp8_pairs` tells the halves
    apart)."""
    q, scales = set(), set()
    for n, t in named:
        if n.endswith(FP8_SCALE_SUFFIX):
            scales.add(n.removesuffix(FP8_SCALE_SUFFIX))
        elif t.dtype == torch.float8_e4m3fn:
            q.add(n)
    return {**dict.fromkeys(q - scales, "q"), **dict.fromkeys(scales - q, "scales")}


def _raise_unpaired(present: dict[str, str]) -> None:
    """ValueError naming each weight of `present` (weight -> the half that arrived) and the half that did not."""
    if not present:
        return
    names = [f"{w} (no {w}{FP8_SCALE_SUFFIX})" if half == "q" else f"{w} (no float8 {w})"
             for w, half in sorted(present.items())]
    raise ValueError(f"update_weights: {len(names)} block-FP8 weight(s) without their other half, not loaded: "
                     f"{', '.join(names[:4])}{' ...' if len(names) > 4 else ''}")


class EmbeddedEngine:
    """`RolloutEngine` backed by a transformers model built from a `ModelConfig` (no hub access). eos_token_ids:
    where every response stops besides its stop_token_ids, as SGLang stops at its checkpoint's EOS ids
    (`wire.checkpoint_eos_ids`)."""

    def __init__(self, cfg: ModelConfig, *, dtype: str = "float32", quantization: str | None = None,
                 max_batch_size: int = 64, eos_token_ids: tuple[int, ...] = ()):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        import transformers

        if dtype not in DTYPES:
            raise ValueError(f"engine dtype: {dtype!r} is not one of {', '.join(DTYPES)}")
        if quantization not in QUANTIZATIONS:
            raise ValueError(f"engine quantization: {quantization!r} is not one of {QUANTIZATIONS}")
        self.cfg, self.quantization = cfg, quantization
        self.dtype = DTYPES[dtype]
        lowp_gemm_emulated(self.dtype)  # a bad MEGATRON_PDM_CPU_LOWP_GEMM fails here, before any compute
        self.max_batch_size, self.eos_token_ids = max_batch_size, tuple(eos_token_ids)
        hf_cfg = transformers.AutoConfig.for_model(
            **{k: v for k, v in hf_config_dict(cfg).items() if k not in ("architectures", "torch_dtype")})
        self.model = transformers.AutoModelForCausalLM.from_config(hf_cfg).to(self.dtype).eval()
        self.weight_version = -1
        self.released = False
        self._fp8_halves: dict[str, dict[str, torch.Tensor]] = {}  # block-FP8 weights waiting for their other half

    # -- weights ------------------------------------------------------------------------------------------
    def export_directory(self, version: int) -> None:
        """None: the engine shares the trainer's process and takes every update in memory (`update_weights`)."""
        return None

    def update_weights_from_export(self, directory, weight_map, nbytes, version, *, dtype, fp8) -> None:
        raise ValueError("EmbeddedEngine takes weights through update_weights only (export_directory is None)")

    def takes_stage_broadcasts(self, single_node: bool = True) -> bool:
        return False

    def update_weights_by_stages(self, version, send, *, dtype, fp8) -> None:
        raise ValueError("EmbeddedEngine takes weights through update_weights only (takes_stage_broadcasts is False)")

    @torch.no_grad()
    def update_weights(self, weights: Weights, version: int) -> None:
        """Load every weight of the model (HF layout, nothing else); rollouts then carry `version`. A full state dict
        is checked before anything is loaded (keys, and every block-FP8 weight with both halves: a failure keeps the
        old weights and version); buckets are checked each before it loads (unknown or repeated keys) and for
        missing keys and block-FP8 halves without their other half at the end, and the engine holds no valid
        version (-1) until the last one loaded (a failed stream leaves it at -1: part of it is loaded). Memory
        released before is taken back first (`load_weights`, the server's path, refuses instead, as SGLang
        does). Multi-token-prediction layers' weights are skipped (`_main_model`)."""
        self.resume_memory()
        self.forget_fp8_halves()  # each update pairs its own halves: none an earlier, failed one left
        expected = self.checkpoint_keys()
        if isinstance(weights, Mapping):  # read lazily (a checkpoint's tensors): one tensor at a time in memory
            keys = self._main_model(weights)
            self._check_keys(keys, expected, set(), final=True)
            _raise_unpaired(_unpaired_fp8((k, weights[k]) for k in keys))
            self.load_weights((k, weights[k]) for k in keys)
            self.weight_version = version
            return
        self.weight_version, seen = -1, set()
        try:
            for bucket in weights:
                keys = self._main_model(bucket)
                self._check_keys(keys, expected, seen, final=False)
                self.load_weights(bucket.items())
                seen.update(k for k in keys if not k.endswith(FP8_SCALE_SUFFIX))
                del bucket
            self._check_keys({}, expected, seen, final=True)
            self.check_fp8_halves()
        finally:
            self.forget_fp8_halves()  # none held past an update, failed or not
        self.weight_version = version

    def forget_fp8_halves(self) -> None:
        """Drop the block-FP8 halves held for their other half (at the start of an update: halves never pair
        across updates)."""
        self._fp8_halves.clear()

    def check_fp8_halves(self) -> None:
        """At the end of an update: ValueError naming every block-FP8 weight whose other half never arrived (the
        engine still holds its previous value), the held halves dropped either way."""
        held, self._fp8_halves = self._fp8_halves, {}
        _raise_unpaired({w: "q" if "q" in half else "scales" for w, half in held.items()})

    def _main_model(self, keys) -> list[str]:
        """The keys less the multi-token-prediction layers' (`is_mtp_key`), which the engine's model does not have:
        skipped as SGLang's main model skips them, so that a checkpoint carrying them (DeepSeek-V3's release, an
        export of a run started from it) loads."""
        return [k for k in keys if not is_mtp_key(k, self.cfg)]

    @staticmethod
    def _check_keys(bucket, expected: set[str], seen: set[str], *, final: bool) -> None:
        """A bucket's weights (a block-FP8 weight's scales count with it) against the model's: unknown or repeated
        ones always, missing ones at the end."""
        bucket = {k for k in bucket if not (k.endswith(FP8_SCALE_SUFFIX) and k.removesuffix(FP8_SCALE_SUFFIX)
                                            in expected)}
        unexpected = sorted(bucket - expected) + sorted(bucket & seen)
        missing = sorted(expected - seen - set(bucket)) if final else []
        if missing or unexpected:
            raise ValueError(f"update_weights: state does not match the model (missing {missing[:4]}, "
                             f"unexpected or repeated {unexpected[:4]})")

    def start(self) -> None:
        """Nothing to start: the model is built in the constructor."""

    def checkpoint_keys(self) -> set[str]:
        """The HF checkpoint keys of this model (per-expert keys even where transformers fuses the experts; no
        lm_head.weight when it is the embedding, tied)."""
        keys = set(canonical_hf_state(self.model.state_dict()))
        if self.cfg.tie_word_embeddings:
            keys.discard("lm_head.weight")
        return keys

    def _fp8_pairs(self, named_tensors):
        """Block-FP8 checkpoint entries (q at name, scales at name + "_scale_inv", possibly in different buckets)
        joined into dequantized weights; everything else passes through."""
        for name, t in named_tensors:
            if t.dtype != torch.float8_e4m3fn and not name.endswith(FP8_SCALE_SUFFIX):
                yield name, t, False
                continue
            weight = name.removesuffix(FP8_SCALE_SUFFIX)
            half = self._fp8_halves.setdefault(weight, {})
            half["scales" if name.endswith(FP8_SCALE_SUFFIX) else "q"] = t
            if len(half) == 2:
                del self._fp8_halves[weight]
                yield weight, fp8_block_dequantize(half["q"], half["scales"], self.dtype), True

    @torch.no_grad()
    def load_weights(self, named_tensors) -> None:
        """Copy (name, tensor) pairs in the HF checkpoint layout into the model, any subset of it (a bucket of a
        distributed update), plain or block-FP8 (q and its `_scale_inv`); FP8 engines quantize-dequantize each
        linear weight on the way in; multi-token-prediction layers' weights are skipped (`_main_model`)."""
        if self.released:
            raise ValueError("update_weights: memory released (resume_memory_occupation first)")
        own = self.model.state_dict()
        main = ((n, t) for n, t in named_tensors if not is_mtp_key(n, self.cfg))
        for name, w, dequantized in self._fp8_pairs(main):
            if self.quantization == "fp8" and not dequantized and fp8_quantizable(name, w):
                w = fp8_block_dequantize(*fp8_block_quantize(w), self.dtype)
            target = _expert_target(name, own)
            if target is not None:
                key, e, rows = target
                dst = own[key][e] if rows is None else own[key][e, rows]
            elif name in own:
                dst = own[name]
            else:
                raise ValueError(f"update_weights: {name!r} is not a weight of this model")
            if dst.shape != w.shape:
                raise ValueError(f"update_weights: {name!r} has shape {tuple(w.shape)}, the model expects "
                                 f"{tuple(dst.shape)}")
            dst.copy_(w.to(dst.dtype))

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
    def _check(self, prompts, params: SamplingParams, budgets: list[int] | None = None):
        if params.return_routed_experts and not self.cfg.is_moe:
            raise ValueError("sampling.return_routed_experts: the model has no MoE layers")
        if self.released:
            raise ValueError("generate: memory released (resume_memory_occupation, then update the weights)")
        if self.weight_version < 0:
            raise RuntimeError("generate: no weights loaded yet (call update_weights first)")
        if params.top_k_logprobs > self.cfg.vocab_size:
            raise ValueError(f"sampling.top_k_logprobs: {params.top_k_logprobs} exceeds the vocabulary size "
                             f"{self.cfg.vocab_size}")
        limit = self.cfg.max_position_embeddings
        for i, p in enumerate(prompts):
            budget = params.max_new_tokens if budgets is None else budgets[i]
            if len(p) == 0:
                raise ValueError(f"prompts[{i}]: empty prompt")
            if len(p) + budget > limit:
                raise ValueError(f"prompts[{i}]: prompt length {len(p)} + max_new_tokens {budget} exceeds the "
                                 f"context length {limit}")
            bad = [t for t in p if not 0 <= t < self.cfg.vocab_size]
            if bad:
                raise ValueError(f"prompts[{i}]: token id {bad[0]} outside [0, {self.cfg.vocab_size})")
        if params.truncated:
            log.warning("sampling with top_p=%s top_k=%s: the masks and ratios assume the untruncated distribution "
                        "mu = softmax(logits / T), which these samples were not drawn from", params.top_p, params.top_k)

    @staticmethod
    def _seeds(params: SamplingParams, prompt_index: int) -> list[int]:
        """Each sample's own seed: `sample_seeds`, or fresh random ones without params.seed."""
        return sample_seeds(params, prompt_index) or torch.randint(0, 2**62, (params.n,)).tolist()

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[RolloutSample]:
        self._check(prompts, params)
        jobs = [(i, list(p), seed, params.max_new_tokens) for i, p in enumerate(prompts)
                for seed in self._seeds(params, i)]
        return self._run(jobs, params)

    def extend(self, samples: list[RolloutSample], params: SamplingParams) -> list[RolloutSample]:
        todo = [k for k, s in enumerate(samples)
                if s.finish_reason != "stop" and len(s.response_ids) < params.max_new_tokens]
        inputs = [samples[k].prompt_ids + samples[k].response_ids.tolist() for k in todo]
        budgets = [params.max_new_tokens - len(samples[k].response_ids) for k in todo]
        self._check(inputs, params, budgets)
        jobs = [(samples[k].prompt_index, p, samples[k].seed if samples[k].seed is not None else
                 int(torch.randint(0, 2**62, ())), b) for k, p, b in zip(todo, inputs, budgets, strict=True)]
        out = list(samples)
        for k, more in zip(todo, self._run(jobs, params), strict=True):
            out[k] = samples[k].continued(more)
        return out

    @torch.no_grad()
    def score(self, sequences: list[list[int]], starts: list[int], top_k: int) -> list[TeacherScores]:
        """The teacher's log t(. | x_<p) at p in [starts[i], len(sequences[i])) of each sequence: one forward over
        the whole sequence (prefill, no sampling), log_softmax at temperature 1 of the logits at p - 1, the scored
        token's log-prob and the top-K (descending). The reference the other engines' `score` is tested against."""
        if self.released:
            raise ValueError("score: memory released (resume_memory_occupation, then update the weights)")
        if self.weight_version < 0:
            raise RuntimeError("score: no weights loaded yet (call update_weights first)")
        check_score_inputs(sequences, starts, top_k, self.cfg.vocab_size)
        longest = max(map(len, sequences), default=0)
        if longest > self.cfg.max_position_embeddings:
            raise ValueError(f"score: a sequence of {longest} tokens, past model.max_position_embeddings "
                             f"{self.cfg.max_position_embeddings}")
        out, device = [], self.model.device
        with self._compute_scope():
            for seq, start in zip(sequences, starts, strict=True):
                ids = torch.tensor(seq, dtype=torch.long, device=device)[None]
                positions = torch.arange(len(seq), device=device)[None]
                logits = self.model(input_ids=ids, position_ids=positions).logits[0]
                logp = torch.log_softmax(logits[start - 1 : len(seq) - 1].float(), dim=-1)
                top_lp, top_ids = logp.topk(top_k, dim=-1)
                tok = logp.gather(1, ids[0, start:, None])[:, 0]
                out.append(TeacherScores(tok.cpu(), top_ids.cpu(), top_lp.cpu()))  # copies only off the CPU
        return out

    def _run(self, jobs, params: SamplingParams) -> list[RolloutSample]:
        out = []
        with self._compute_scope():
            for b in range(0, len(jobs), self.max_batch_size):
                out += self._generate_batch(jobs[b : b + self.max_batch_size], params)
        return out

    @contextlib.contextmanager
    def _compute_scope(self):
        """The model's forward passes in `dtype`: where the CPU has no native `dtype` GEMM, emulated (compat patch
        11; weights fixed meanwhile, so their float32 copies are cached) and with the attention as eager products
        (q k^T and p v emulated like the linears: SDPA's CPU kernel is one fused op that the emulation does not see,
        and it would run natively, slowly, in `dtype`)."""
        attention = self.model.config._attn_implementation
        emulated = lowp_gemm_emulated(self.dtype)
        try:
            if emulated:
                self.model.config._attn_implementation = "eager"
            with lowp_gemm_scope(self.dtype, cache_weights=True):
                yield
        finally:
            self.model.config._attn_implementation = attention

    @torch.no_grad()
    def _generate_batch(self, jobs, params: SamplingParams) -> list[RolloutSample]:
        """jobs: (prompt index, input ids, seed, max new tokens) per row. Row r draws its token at sequence position
        q as argmax(log p + Gumbel noise seeded by position_seed(seed_r, q)): a sample from p (Gumbel-max) whose
        noise depends on the row's seed and the position alone."""
        from transformers import DynamicCache

        B, K, T = len(jobs), params.top_k_logprobs, params.temperature
        lengths = torch.tensor([len(p) for _, p, _, _ in jobs])
        width = int(lengths.max())
        ids = torch.zeros(B, width, dtype=torch.long)
        attn = torch.zeros(B, width, dtype=torch.long)
        for r, (_, p, _, _) in enumerate(jobs):  # left padding: the last prompt token of every row is at width - 1
            ids[r, width - len(p):] = torch.tensor(p)
            attn[r, width - len(p):] = 1
        stop = torch.tensor(list(dict.fromkeys((*params.stop_token_ids, *self.eos_token_ids))), dtype=torch.long)
        cache = DynamicCache()
        budget = torch.tensor([b for _, _, _, b in jobs])
        done = torch.zeros(B, dtype=torch.bool)
        stopped = torch.zeros(B, dtype=torch.bool)
        tokens, logps, top_ids, top_lps = [], [], [], []
        finished_at = budget.clone()
        step_ids, pos = ids, (attn.cumsum(-1) - 1).clamp_min(0)
        routed, hooks = [], []  # per forward: per MoE layer, [B * tokens, top_k] expert ids
        if params.return_routed_experts:
            # Qwen3-MoE's ...TopKRouter, DeepSeek-V3's ...TopkRouter: each returns (logits, weights, expert ids)
            routers = [m for m in self.model.modules() if type(m).__name__.lower().endswith("topkrouter")]
            hooks = [r.register_forward_hook(lambda _m, _i, out: routed[-1].append(out[2])) for r in routers]
        try:
            for t in range(int(budget.max())):
                routed.append([])
                logits = self.model(input_ids=step_ids, attention_mask=attn, position_ids=pos, past_key_values=cache,
                                    use_cache=True).logits[:, -1]
                logp = torch.log_softmax(logits.float() / T, dim=-1)
                scores = _truncated_probs(logp, params.top_p, params.top_k).log() if params.truncated else logp
                noise = torch.stack([torch.rand(logp.shape[-1], generator=torch.Generator().manual_seed(
                    position_seed(seed, len(p) + t))) for _, p, seed, _ in jobs])  # B generators: a host loop
                nxt = (scores - (-noise.log()).log()).argmax(-1)
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
                    stopped |= newly
                done |= stopped | (budget <= t + 1)
                if bool(done.all()):
                    break
                step_ids = nxt[:, None]
                attn = torch.cat([attn, torch.ones(B, 1, dtype=attn.dtype)], dim=-1)
                pos = pos[:, -1:] + 1
        finally:
            for h in hooks:
                h.remove()
        tokens, logps = torch.stack(tokens, 1), torch.stack(logps, 1)
        top_ids, top_lps = torch.stack(top_ids, 1), torch.stack(top_lps, 1)
        if hooks:  # [B, width + steps - 1, layers, top_k]: the prompt (left-padded), then one token per step; every
            # decoder layer as SGLang returns them, the dense ones (DeepSeek-V3's first k) expert 0
            k = self.cfg.moe_first_k_dense
            routed = torch.cat([torch.stack([torch.zeros_like(layers[0])] * k + layers, 1)
                                .reshape(B, -1, k + len(layers), layers[0].shape[-1]) for layers in routed],
                               dim=1).to(torch.int32)
        samples = []
        for r, (i, p, seed, _) in enumerate(jobs):
            n = int(finished_at[r].clamp(max=tokens.shape[1]))
            samples.append(RolloutSample(
                prompt_index=i, prompt_ids=p, response_ids=tokens[r, :n].clone(), token_logprobs=logps[r, :n].clone(),
                topk_ids=top_ids[r, :n].clone(), topk_logprobs=top_lps[r, :n].clone(),
                finish_reason="stop" if bool(stopped[r]) else "length", weight_version=self.weight_version,
                routed_experts=routed[r, width - len(p): width + n - 1].clone() if params.return_routed_experts
                else None, seed=seed,
            ))
        return samples
