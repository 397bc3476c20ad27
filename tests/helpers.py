"""What several test modules share: the tiny models (DENSE / MOE as ModelConfig, for model, engine and sync tests;
TRAIN_DENSE / TRAIN_MOE, the model sections of training configs), HF reference models, the training config and
run of the trainer tests (`train_cfg`, `rank_train`, a warm-started checkpoint, row comparison) and pool-worker
functions (`rank_*`: importable by the forkserver's workers). Tests import these from here, never from another
test module."""

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from megatron_pdm.models import (
    ModelConfig,
    ParallelConfig,
    build_model,
    canonical_hf_state,
    forward_logits,
    hf_config_dict,
    hf_state_from_model,
    initialize_parallel,
    load_hf_into_model,
    save_hf_checkpoint,
)
from megatron_pdm.objectives import ObjectiveConfig
from megatron_pdm.train.config import config_from_dict
from megatron_pdm.train.data import ARITHMETIC_TOKENIZER
from tests.reference import ref_divergence_and_change, ref_logpi

os.environ.setdefault("HF_HUB_OFFLINE", "1")


DENSE = ModelConfig(vocab_size=320, hidden_size=32, num_layers=2, num_attention_heads=4, num_query_groups=2,
                    head_dim=8, ffn_hidden_size=48, max_position_embeddings=64)


MOE = ModelConfig(model_type="qwen3_moe", vocab_size=320, hidden_size=32, num_layers=2, num_attention_heads=4,
                  num_query_groups=2, head_dim=8, ffn_hidden_size=48, num_experts=4, moe_ffn_hidden_size=16,
                  moe_router_topk=2, moe_aux_loss_coeff=0.0, max_position_embeddings=64)


def hf_model(cfg, seed=0):
    import transformers

    torch.manual_seed(seed)
    hcfg = transformers.AutoConfig.for_model(
        **{k: v for k, v in hf_config_dict(cfg).items() if k not in ("architectures", "torch_dtype")})
    return transformers.AutoModelForCausalLM.from_config(hcfg).float().eval()


def rank_forward_backward(group, cfg, tp, ep, hf_state, ids, weights, targets, cp=1):
    import torch.distributed as dist

    from megatron_pdm.compat import cuda_to_cpu_scope
    from megatron_pdm.models.attention import zigzag_positions
    from megatron_pdm.vocab_parallel import token_logprobs

    ctx = initialize_parallel(ParallelConfig(tensor=tp, expert=ep, context=cp))
    model = build_model(cfg, ctx)
    load_hf_into_model(model, hf_state, cfg, ctx)
    dp_rank, dp = ctx.dp_rank, ctx.dp
    rows = ids.shape[0] // dp
    sl = slice(dp_rank * rows, (dp_rank + 1) * rows)  # data parallel ranks take different sequences
    # context parallel ranks take different columns: chunks r and 2 cp - 1 - r of 2 cp
    cols = zigzag_positions(ids.shape[1], ctx.cp_rank, cp) if cp > 1 else slice(None)
    with cuda_to_cpu_scope():  # megatron's CP slice of RoPE pins a host tensor and copies it to CUDA
        logits = forward_logits(model, ids[sl][:, cols])
    lp = token_logprobs(logits.reshape(-1, logits.shape[-1]), targets[sl][:, cols].reshape(-1), group=ctx.tp_group)
    (lp * weights[sl][:, cols].reshape(-1)).sum().backward()
    grads = _grads_hf_layout(model, cfg, ctx)
    full = [torch.empty_like(logits) for _ in range(tp)]
    if tp > 1:
        dist.all_gather(full, logits.detach().contiguous(), group=ctx.tp_group)
    else:
        full = [logits.detach()]
    ctx.close()
    return torch.cat(full, dim=-1), grads, (sl.start, sl.stop), cols


def model_case(cfg, B=4, S=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, cfg.vocab_size, (B, S), generator=g), torch.randn(B, S, generator=g),
            torch.randint(0, cfg.vocab_size, (B, S), generator=g))


def rank_roundtrip(group, cfg, tp, ep, hf_state, directory, pp=1, first_stage_layers=0):
    ctx = initialize_parallel(ParallelConfig(tensor=tp, expert=ep, pipeline=pp, first_stage_layers=first_stage_layers))
    model = build_model(cfg, ctx)
    load_hf_into_model(model, hf_state, cfg, ctx)
    exported = hf_state_from_model(model, cfg, ctx)
    if torch.distributed.get_rank() == 0:
        save_hf_checkpoint(directory, exported, cfg)
    ctx.close()
    return exported


def rank_engine_check(group, cfg, tp, hf_state, temperature, samples):
    """Recompute log softmax(logits / T) with the megatron model at the engine's sampled and top-K ids."""
    from megatron_pdm.vocab_parallel import token_logprobs

    ctx = initialize_parallel(ParallelConfig(tensor=tp))
    model = build_model(cfg, ctx)
    load_hf_into_model(model, hf_state, cfg, ctx)
    tp_group = ctx.tp_group
    out = []
    with torch.no_grad():
        for s in samples:
            seq = torch.tensor(s.prompt_ids + s.response_ids.tolist())
            pad = (-len(seq)) % tp  # sequence parallelism splits the sequence: pad to a multiple of TP
            logits = forward_logits(model, torch.cat([seq, seq.new_zeros(pad)])[None])[0]
            P, L = len(s.prompt_ids), len(s.response_ids)
            z = logits[P - 1 : P - 1 + L]
            lp = token_logprobs(z, s.response_ids, group=tp_group, temperature=temperature)
            top = torch.stack([token_logprobs(z, s.topk_ids[:, j], group=tp_group, temperature=temperature)
                               for j in range(s.topk_ids.shape[1])], dim=1)
            out.append((lp, top))
    ctx.close()
    return out


def _grads_hf_layout(model, cfg, ctx):
    """The gradients in the HF layout (full tensors), reduced as megatron's DDP and finalize_model_grads reduce
    them: expert weights over the expert-data-parallel group (which spans TP ranks when expert-TP is 1: each
    rank's experts see its own sequence chunk), other weights over data parallelism, and the partial gradients
    of TP-replicated weights that see only this rank's sequence chunk or heads (SP norms, QK norms, router)
    over TP."""
    import torch.distributed as dist

    def reduce(t, group):
        if dist.get_world_size(group) > 1:
            dist.all_reduce(t, group=group)

    saved = {}
    for name, p in model.named_parameters():
        saved[name] = p.data.clone()
        g = p.grad.clone()
        if ".local_experts." in name:
            reduce(g, ctx.groups.expt_dp)
        else:
            if getattr(p, "sequence_parallel", False) or "layernorm" in name:
                reduce(g, ctx.groups.tp)
            reduce(g, ctx.dp_cp_group)  # CP ranks: other sequence chunks
        p.data.copy_(g)
    grads = hf_state_from_model(model, cfg, ctx)
    for name, p in model.named_parameters():
        p.data.copy_(saved[name])
    return grads


def rank_routing_check(group, cfg, tp, hf_state, samples):
    """Per sample: the experts megatron routes each token to in its MoE layers (recorded), and whether replaying
    the engine's routing (R3) reproduces the logits while replaying a different routing changes them."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    from megatron_pdm.models import routing_replay
    from megatron_pdm.models.gpt import _router_replays

    ctx = initialize_parallel(ParallelConfig(tensor=tp))
    model = build_model(cfg, ctx, moe_enable_routing_replay=True)
    load_hf_into_model(model, hf_state, cfg, ctx)
    tp_group = ctx.tp_group
    replays = _router_replays(model)
    moe = [i for i in range(cfg.num_layers) if cfg.is_moe_layer(i)]  # the engine returns every decoder layer
    out = []
    with torch.no_grad():
        for s in samples:
            seq = torch.tensor(s.prompt_ids + s.response_ids.tolist())
            seq = torch.cat([seq, seq.new_zeros((-len(seq)) % tp)])[None]
            S = seq.shape[1]
            for r in replays:
                r.set_router_replay_action(RouterReplayAction.RECORD)
            plain = forward_logits(model, seq)
            local = torch.stack([r.get_recorded_indices() for r in replays], 1)  # [S/tp, layers, k] (B = 1)
            for r in replays:
                r.clear_router_replay_action()
            parts = [local]
            if tp > 1:  # each TP rank routed its sequence slice
                parts = [torch.empty_like(local) for _ in range(tp)]
                torch.distributed.all_gather(parts, local.contiguous(), group=tp_group)
            recorded = torch.cat(parts)  # [S, layers, k]
            n = s.routed_experts.shape[0]
            routed = torch.cat([s.routed_experts[:, moe].long(), recorded[n:]])[None]  # + the last, never routed, token
            with routing_replay(model, routed, tp_group=tp_group):
                replayed = forward_logits(model, seq)
            other = (routed + 1) % cfg.num_experts  # a different routing, same shape
            with routing_replay(model, other, tp_group=tp_group):
                changed = forward_logits(model, seq)
            out.append((recorded[:n], (replayed - plain).abs().max().item(), (changed - plain).abs().max().item(), S))
    ctx.close()
    return out


def check_engine_logprobs(dist_pools, cfg, state):
    """The embedded engine's sampled and top-K log-probs are megatron's at TP 1 and 2 (the same weights)."""
    from megatron_pdm.rollout import EmbeddedEngine, RolloutEngine, SamplingParams

    engine = EmbeddedEngine(cfg, max_batch_size=3)
    assert isinstance(engine, RolloutEngine)
    engine.update_weights(state, version=7)
    params = SamplingParams(max_new_tokens=6, n=2, temperature=0.8, top_k_logprobs=5, stop_token_ids=(3,), seed=1)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    samples = engine.generate(prompts, params)
    assert [s.prompt_index for s in samples] == [0, 0, 1, 1, 2, 2]
    assert all(s.weight_version == 7 for s in samples)
    for s in samples:
        assert torch.all(s.topk_logprobs[:, :-1] >= s.topk_logprobs[:, 1:])  # sorted
        assert all(len(set(row.tolist())) == 5 for row in s.topk_ids)  # distinct
        assert (s.finish_reason == "stop") == (3 in s.response_ids.tolist())
    for tp in (1, 2):
        results = dist_pools(tp).run(rank_engine_check, shared=(cfg, tp, state, 0.8, samples))[0]
        for s, (lp, top) in zip(samples, results, strict=True):
            torch.testing.assert_close(s.token_logprobs, lp, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(s.topk_logprobs, top, atol=1e-4, rtol=1e-4)
    # same seed, same samples
    again = engine.generate(prompts, params)
    assert all(torch.equal(a.response_ids, b.response_ids) for a, b in zip(samples, again, strict=True))


def check_routed_experts(dist_pools, cfg, state, tps=(1, 2)):
    """The embedded engine returns the experts each layer routed every token to (as SGLang's
    return_routed_experts does: every decoder layer, a dense one expert 0): megatron routes the same tokens to the
    same experts, and replaying them (R3) leaves the logits as they are while another routing changes them."""
    from megatron_pdm.rollout import EmbeddedEngine, SamplingParams

    engine = EmbeddedEngine(cfg, max_batch_size=4)
    engine.update_weights(state, version=0)
    params = SamplingParams(max_new_tokens=5, n=2, top_k_logprobs=3, stop_token_ids=(3,), seed=2,
                            return_routed_experts=True)
    samples = engine.generate([[5, 6, 7], [8, 9], [10, 11, 12, 13]], params)
    moe = [i for i in range(cfg.num_layers) if cfg.is_moe_layer(i)]
    for s in samples:
        assert s.routed_experts.shape == (len(s.prompt_ids) + len(s.response_ids) - 1, cfg.num_layers,
                                          cfg.moe_router_topk)
        assert s.routed_experts.dtype == torch.int32 and not s.routed_experts[:, :cfg.moe_first_k_dense].any()
    for tp in tps:
        for s, (recorded, replay_err, changed, _) in zip(samples, dist_pools(tp).run(
                rank_routing_check, shared=(cfg, tp, state, samples))[0], strict=True):
            assert torch.equal(recorded.sort(-1).values, s.routed_experts[:, moe].long().sort(-1).values)
            assert replay_err < 1e-5 and changed > 1e-3


ROOT = Path(__file__).resolve().parents[1]


TRAIN_DENSE = dict(model_type="qwen3", vocab_size=320, hidden_size=32, num_layers=2, num_attention_heads=4,
             num_query_groups=2, head_dim=8, ffn_hidden_size=64, max_position_embeddings=32)


TRAIN_MOE = dict(TRAIN_DENSE, model_type="qwen3_moe", num_experts=4, moe_ffn_hidden_size=16, moe_aux_loss_coeff=0.0)


def train_cfg(model, parallel, init_path, objective=None, rollout=None, **train):
    return config_from_dict({
        "model": {**model, "tokenizer": str(ARITHMETIC_TOKENIZER)}, "parallel": parallel, "objective": objective or {},
        "rollout": {"n": 4, "max_new_tokens": 3, **(rollout or {})},
        "data": {"max_operand": 2},
        "train": {"steps": 2, "prompts_per_step": 4, "minibatches": 2, "micro_batch_size": 3, "eval_every": 1,
                  "eval_prompts": 8, "checkpoint_every": 1000, "init": "hf", "init_path": str(init_path),
                  "warm_start_steps": 0, **train},
        # a large Adam eps keeps updates proportional to gradients, so that fp32 summation-order differences
        # between layouts stay fp32-small instead of flipping the sign of near-zero entries' lr-sized steps
        "optim": {"lr": 1e-2, "adam_eps": 1e-4},
    })


def rank_train(group, cfg, run_dir, resume=False):
    from megatron_pdm.models import hf_state_from_model
    from megatron_pdm.train.trainer import Trainer

    trainer = Trainer(cfg, Path(run_dir))
    rows = trainer.run(resume=resume)
    state = hf_state_from_model(trainer.chunks, cfg.model, trainer.parallel)
    trainer.parallel.close()
    return rows, state


_INIT = {}  # model -> its warm-started checkpoint, built once per test session (deterministic: seeded)


def init_checkpoint(tmp_path, model, dist_pools):
    """A briefly warm-started model (so that rollouts earn some reward) as an HF checkpoint: every layout then
    starts from the same weights."""
    key = json.dumps(model, sort_keys=True)
    if key in _INIT and (_INIT[key] / "config.json").is_file():
        return _INIT[key]
    _INIT[key] = tmp_path / "init"
    cfg = ModelConfig(**model)
    path = tmp_path / "random"
    state = canonical_hf_state(hf_model(cfg, seed=11).state_dict())
    if cfg.tie_word_embeddings:  # transformers lists the tied tensor under both names; the checkpoint holds it once
        state.pop("lm_head.weight")
    save_hf_checkpoint(path, state, cfg)
    warm = train_cfg(model, {}, path, warm_start_steps=20, warm_start_lr=1e-2, steps=1)
    _, state = dist_pools(1).run(rank_train, shared=(warm, str(tmp_path / "warm")))[0]
    save_hf_checkpoint(tmp_path / "init", state, cfg)
    return tmp_path / "init"


NUMERIC = ("train/reward", "train/loss", "eval/reward", "mask/masked_frac", "divergence/mean", "policy/entropy",
           "policy/kl_ref")


def compare_rows(a, b, *, sampled_after_update=True):
    """Rows equal; with sampled_after_update=False the evaluation after an update is skipped: sampling from
    weights that differ in the last fp32 bits may flip a sampled token (multinomial thresholds)."""
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for x, y in zip(a, b, strict=True):
        for k in NUMERIC:
            if k == "eval/reward" and x["step"] > 0 and not sampled_after_update:
                continue
            if k in x or k in y:
                assert x[k] == pytest.approx(y[k], rel=1e-4, abs=1e-5), (x["step"], k)


def published_checkpoint(run_dir, config: dict, step: int = 1) -> Path:
    """A step directory that passes the completeness check (a manifest listing its config.yaml) with no shard in
    it: enough for every check made before a process starts."""
    import yaml

    from megatron_pdm.train.checkpoint import COMPLETE, CONFIG_FILE, FORMAT

    path = Path(run_dir) / "checkpoints" / f"step_{step:08d}"
    path.mkdir(parents=True)
    (path / CONFIG_FILE).write_text(yaml.safe_dump(config, sort_keys=False))
    files = {CONFIG_FILE: (path / CONFIG_FILE).stat().st_size}
    (path / COMPLETE).write_text(json.dumps({"format": FORMAT, "step": step, "world": 1, "files": files}))
    return path


def one_line(capsys, command: str) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"{command}: ") and "Traceback" not in err, err
    return err


def _in_process_server(tmp_path, cfg, *, seed=21, path=None, **kw):
    """`serve`'s EngineServer behind its HTTP handler on a thread of this process; returns (server, url, stop)."""
    from http.server import ThreadingHTTPServer

    from megatron_pdm.rollout.sglang.server import EngineServer, make_handler

    if path is None:
        path = tmp_path / "init"
        save_hf_checkpoint(path, canonical_hf_state(hf_model(cfg, seed=seed).state_dict()), cfg)
    server = EngineServer(str(path), **kw)
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(server))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()

    def stop():
        httpd.shutdown()
        httpd.server_close()

    return server, f"http://127.0.0.1:{httpd.server_address[1]}", stop


def _poll(cond, what, deadline_s=30.0):
    end = time.monotonic() + deadline_s
    while not cond():
        if time.monotonic() > end:
            raise TimeoutError(what)
        time.sleep(0.01)


def _serve_child(argv: list[str], env: dict) -> None:
    """`megatron-pdm serve ARGV` in a process forked from the test pools' preloaded server (its imports done)."""
    import torch

    os.environ.update(env)
    torch.set_num_threads(1)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.dup2(null, 2)
    from megatron_pdm.cli import main

    sys.exit(main(argv))


def _serve_argv(tmp_path, port: int) -> list[str]:
    """`megatron-pdm serve` of the checkpoint `_serve_processes` writes, on `port`."""
    return ["serve", "--model-path", str(tmp_path / "init"), "--port", str(port)]


def _forked_serve(tmp_path, env: dict, *, tries: int = 3, deadline_s: float = 60.0):
    """A serve process forked from the pools' server, healthy on a free port: (process, port). The port is free
    when `_port` looks, not necessarily when serve binds it (a gloo store or an outgoing connection may take it
    between): a serve that dies before it answers is started again on another port, up to `tries` times (the
    regression: a full suite's test waited 60 s on an engine that had died at start-up, and its other rank 300 s).
    """
    from megatron_pdm.rollout.sglang.health import is_healthy
    from tests.distributed import _context

    for _ in range(tries):
        port = _port()
        proc = _context().Process(target=_serve_child, args=(_serve_argv(tmp_path, port), env), daemon=True)
        proc.start()
        end = time.monotonic() + deadline_s
        while proc.is_alive() and time.monotonic() < end:
            if is_healthy(f"http://127.0.0.1:{port}", timeout=1.0):
                return proc, port
            time.sleep(0.05)
        if proc.is_alive():  # slow, not dead: the test's own wait says what it finds
            return proc, port
        proc.join()
    return proc, port


def _serve_processes(tmp_path, count: int, *, fork: bool = True, **env):
    """`count` serve processes of DENSE (seed 21) on free loopback ports: (processes, urls, the HF state). fork:
    forked from the gloo pools' preloaded server (`tests/distributed.py`: 0.3 s to answer, where a new interpreter
    imports for ~4 s, and each healthy before the next starts: `_forked_serve`); else real `python -m
    megatron_pdm.cli serve` processes."""
    state = canonical_hf_state(hf_model(DENSE, seed=21).state_dict())
    save_hf_checkpoint(tmp_path / "init", state, DENSE)
    procs, urls = [], []
    for _ in range(count):
        if fork:
            proc, port = _forked_serve(tmp_path, env)
            procs.append(proc)
        else:
            port = _port()
            procs.append(subprocess.Popen([sys.executable, "-m", "megatron_pdm.cli", *_serve_argv(tmp_path, port)],
                                          env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **env),
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        urls.append(f"http://127.0.0.1:{port}")
    return procs, urls, state


def _stop(procs) -> None:
    """Kill and reap serve processes (forked: multiprocessing's Process; else Popen)."""
    for p in procs:
        p.kill()
        p.join() if hasattr(p, "join") else p.wait()


def ref_kl(logp, ref_lp, kl_type):
    """The KL-to-reference estimators, written out: value, and the gradient of k2 for the "+" types."""
    d = logp - ref_lp
    value = {"k1": d, "abs": d.abs(), "k2": d**2 / 2,
             "k3": (torch.exp(-d.clamp(-20, 20)) - 1 + d.clamp(-20, 20)).clamp(-10, 10)}[
        {"low_var_kl": "k3"}.get(kl_type.rstrip("+"), kl_type.rstrip("+"))]
    return value if not kl_type.endswith("+") else value.detach() + d**2 / 2 - (d**2 / 2).detach()


def ref_loss(case, A, loss_mask, seq_ids, config, normalizer, ref_lp=None, ref_z=None):
    """Float64 single-process loss on the full logits, differentiable w.r.t. them."""
    z = case.logits.double().detach().requires_grad_(True)
    logp_all = ref_logpi(z, case.temperature)
    logp = logp_all.gather(1, case.topk.token_ids[:, None]).squeeze(-1)
    d, dd = ref_divergence_and_change(case, config.divergence, config.tail)
    log_ratio = logp.detach() - case.topk.token_logprobs.double()
    if config.mask == "pdm":
        keep = ~((d > config.delta) & (torch.sign(A) * torch.sign(dd) > 0))
    elif config.mask == "dppo":
        keep = ~((d > config.delta) & (torch.sign(A) * torch.sign(log_ratio) > 0))
    else:
        r = log_ratio.exp()
        keep = ~(((A > 0) & (r > 1 + config.eps_high)) | ((A < 0) & (r < 1 - config.eps_low)))
    if config.loss == "dppo":
        per_tok = -keep.double() * log_ratio.exp().clamp(max=config.ratio_cap) * A * logp
    else:
        r = (logp - case.topk.token_logprobs.double()).exp()
        s = torch.minimum(r * A, r.clamp(1 - config.eps_low, 1 + config.eps_high) * A)
        s = torch.where(A < 0, torch.maximum(s, config.ratio_cap * A), s)
        per_tok = -keep.double() * s
    if config.kl_coef:
        u = log_ratio.exp().clamp(max=config.ratio_cap) if config.kl_unbiased else 1.0
        if config.kl_type == "exact":  # KL(pi || pi_ref) over the whole vocabulary
            kl = (logp_all.exp() * (logp_all - ref_logpi(ref_z, case.temperature))).sum(-1)
        else:
            kl = ref_kl(logp, ref_lp, config.kl_type)
        per_tok = per_tok + config.kl_coef * u * kl
    per_tok = per_tok + config.entropy_coef * (logp_all.exp() * logp_all).sum(-1)  # - coef x H
    m = loss_mask.double()
    if config.aggregation == "seq_mean_token_mean":
        lengths = torch.zeros(int(seq_ids.max()) + 1, dtype=torch.float64).index_add_(0, seq_ids, m)
        m = m / lengths[seq_ids]
    loss = (per_tok * m).sum() / normalizer
    loss.backward()
    return loss.detach(), z.grad


CONFIGS = [
    ObjectiveConfig(),  # PDM, top-K KL, aggregated tail, DPPO loss, token mean
    ObjectiveConfig(mask="pdm", tail="uniform", aggregation="seq_mean_token_mean"),
    ObjectiveConfig(mask="dppo", divergence="topk_tv", aggregation="seq_mean_token_sum"),
    ObjectiveConfig(mask="ppo", loss="ppo", ratio_cap=3.0),
    # the KL penalty to a reference and the entropy bonus, with every estimator
    ObjectiveConfig(kl_coef=0.1, kl_type="low_var_kl", entropy_coef=0.01),
    ObjectiveConfig(kl_coef=0.2, kl_type="k1", aggregation="seq_mean_token_mean"),
    ObjectiveConfig(mask="ppo", loss="ppo", kl_coef=0.05, kl_type="k2", kl_unbiased=True, entropy_coef=0.02),
    ObjectiveConfig(mask="dppo", kl_coef=0.1, kl_type="abs"),
    ObjectiveConfig(kl_coef=0.1, kl_type="k3+", kl_unbiased=True, entropy_coef=0.05),
    ObjectiveConfig(kl_coef=0.3, kl_type="k1+", aggregation="seq_mean_token_sum"),
    # the exact KL(pi || pi_ref) from the reference's logits shard
    ObjectiveConfig(kl_coef=0.1, kl_type="exact", entropy_coef=0.01),
    ObjectiveConfig(mask="ppo", loss="ppo", kl_coef=0.2, kl_type="exact", kl_unbiased=True,
                    aggregation="seq_mean_token_mean"),
]


SEQUENCE_CONFIGS = [
    dict(correction="tis", correction_level="sequence", correction_cap=2.0),
    dict(correction="tis", correction_level="geometric", correction_cap=1.2),
    dict(correction="mis", correction_level="sequence", correction_cap=3.0, rejection="k3", rejection_threshold=0.05),
    dict(correction="none", rejection="k1", rejection_threshold=0.2, veto_threshold=0.75),
    dict(correction="tis", veto_threshold=0.4),
]


def rank_buckets_and_sync(group, cfg, parallel, state, bucket_bytes):
    """The buckets this rank yields (copied), and, on rank 0, the weights a real embedded engine holds after
    `sync_weights` (every rank drives it)."""
    import torch.distributed as dist

    from megatron_pdm.models.hf import hf_buckets_from_model
    from megatron_pdm.rollout import EmbeddedEngine
    from megatron_pdm.train.weight_sync import sync_weights

    model, ctx = _setup(cfg, parallel, state)
    buckets = [dict(b) for b in hf_buckets_from_model(model, cfg, ctx, bucket_bytes=bucket_bytes)]
    engine = EmbeddedEngine(cfg) if dist.get_rank() == 0 else None
    sync_weights(model, cfg, engine, 5, ctx, bucket_bytes=bucket_bytes)
    synced = None
    if engine is not None:
        assert engine.weight_version == 5
        synced = canonical_hf_state(engine.model.state_dict())
        if cfg.tie_word_embeddings:
            synced.pop("lm_head.weight", None)
    stage, sender = ctx.pp_rank, ctx.roles.sender
    ctx.close()
    return buckets, synced, stage, sender


def sglang_section(**fields):
    """A `rollout` section for an `SGLangEngine` (engine sglang) with `fields` set (those of `rollout.sglang` into
    its sub-section), the rest defaults, but a weight update's timeout: the request timeout (timeout_s) unless
    given, so that a hung update fails a test in seconds, not the section's 30 minutes."""
    from dataclasses import fields as fields_of

    from megatron_pdm.rollout.config import RolloutConfig
    from megatron_pdm.rollout.sglang.config import SGLangConfig

    if "timeout_s" in fields:
        fields.setdefault("update_timeout_s", fields["timeout_s"])
    own = {f.name for f in fields_of(SGLangConfig)}
    sglang = SGLangConfig(**{k: v for k, v in fields.items() if k in own})
    return RolloutConfig(engine="sglang", sglang=sglang, **{k: v for k, v in fields.items() if k not in own})


def _with(cfg, **sections):
    d = cfg.to_dict()
    for name, values in sections.items():
        d[name] = {**d.get(name, {}), **values}
    return config_from_dict(d)


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _setup(cfg, parallel, state):
    """(model, its ParallelContext): `cfg` built over `parallel` and loaded from the HF `state`."""
    ctx = initialize_parallel(parallel)
    model = build_model(cfg, ctx)
    load_hf_into_model(model, state, cfg, ctx)
    return model, ctx
