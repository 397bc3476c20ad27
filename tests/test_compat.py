"""Each CPU compatibility patch of megatron_pdm.compat, and that none of them leaks into other libraries."""

import os

import numpy as np
import pytest
import torch

from megatron_pdm.compat import apply_cpu_patches, cpu_patches_applied, cuda_to_cpu_scope

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the patches apply only without CUDA")


def test_patches_apply_once():
    assert apply_cpu_patches() is True
    assert cpu_patches_applied()
    assert apply_cpu_patches() is True  # idempotent
    assert torch.cuda.current_device() == torch.device("cpu")


def test_rng_tracker_forks_the_cpu_generator():
    apply_cpu_patches()
    from megatron.core.tensor_parallel import random as mrandom

    tracker = mrandom.CudaRNGStatesTracker()
    tracker.add("a", 11)
    tracker.add("b", 12)
    with pytest.raises(Exception, match="already exists"):
        tracker.add("c", 11)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    with tracker.fork("a"):
        a1 = torch.rand(3)
    with tracker.fork("b"):
        b1 = torch.rand(3)
    with tracker.fork("a"):
        a2 = torch.rand(3)  # the "a" stream continues where it stopped
    assert torch.equal(torch.get_rng_state(), before)  # the default stream is untouched
    g = torch.Generator().manual_seed(11)
    assert torch.equal(a1, torch.rand(3, generator=g)) and torch.equal(a2, torch.rand(3, generator=g))
    assert not torch.equal(a1, b1)
    torch.cuda.manual_seed(5)
    x = torch.rand(2)
    torch.manual_seed(5)
    assert torch.equal(x, torch.rand(2))


def test_streams_and_moe_helpers():
    apply_cpu_patches()
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    s = torch.cuda.Stream()
    assert s == torch.cuda.current_stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        torch.cuda.synchronize()
    split = moe_utils.maybe_move_tensor_to_cpu(torch.tensor([3, 4]), as_numpy=True)
    assert isinstance(split, np.ndarray) and split.tolist() == [3, 4]
    assert token_dispatcher.maybe_move_tensor_to_cpu is moe_utils.maybe_move_tensor_to_cpu
    assert moe_utils.te_general_gemm is None


def test_cuda_to_cpu_scope_is_scoped():
    with cuda_to_cpu_scope():
        z = torch.zeros(2, device="cuda")
        assert z.device.type == "cpu"
        assert z.cuda() is z
        assert z.to("cuda").device.type == "cpu"
        assert torch.ones(1).type() == "torch.cuda.FloatTensor"
        assert torch.empty(2, pin_memory=True).device.type == "cpu"
    assert torch.ones(1).type() == "torch.FloatTensor"
    with pytest.raises((AssertionError, RuntimeError)):
        torch.zeros(1, device="cuda")


def test_patches_do_not_break_transformers(tmp_path):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    from megatron_pdm.models import ModelConfig, hf_config_dict, save_hf_checkpoint

    apply_cpu_patches()
    cfg = ModelConfig()
    hcfg = transformers.AutoConfig.for_model(
        **{k: v for k, v in hf_config_dict(cfg).items() if k not in ("architectures", "torch_dtype")})
    model = transformers.AutoModelForCausalLM.from_config(hcfg)
    save_hf_checkpoint(tmp_path, model.state_dict(), cfg)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True)
    expected = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2).float() / cfg.head_dim)
    torch.testing.assert_close(reloaded.model.rotary_emb.inv_freq, expected)


_TRITON_PROBE = """
import sys
from megatron_pdm.compat import apply_cpu_patches
apply_cpu_patches()
from megatron.core.models.gpt import gpt_layer_specs  # noqa: F401 - imports the MLA and MoE fusions, which try Triton
from megatron.core import utils
print(getattr(utils, "HAVE_TRITON", False), sys.modules.get("triton") is not None)  # megatron-core 0.19: no flag
"""


@pytest.mark.e2e
def test_a_process_without_cuda_never_loads_triton_and_exits_quietly():
    """A CPU process (no Triton interpreter asked for) does not load Triton: megatron-core imported it wherever it is
    installed, and its nanobind extension then printed ~60 lines of "nanobind: leaked ..." at every exit (the last
    thing `make run` showed). Under TRITON_INTERPRET=1 (the kernel tests) Triton stays importable."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _TRITON_PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["False", "False"]
    assert "nanobind" not in run.stderr
    run = subprocess.run([sys.executable, "-c", "from megatron_pdm.compat import apply_cpu_patches; "
                          "apply_cpu_patches(); import triton"], env={**env, "TRITON_INTERPRET": "1"},
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr


def test_mla_without_te_binds_the_linear_its_whitelist_names(monkeypatch):
    """megatron-core 0.17+ bind MLA's TE names to None without Transformer Engine, modelopt's `Linear` too, and
    MLASelfAttention's whitelist then refused our replicated q / kv down-projections (every DeepSeek-V3 / Kimi-K2
    build): `patch_mla_without_te` binds it (here to None as 0.19 leaves it) and leaves a bound one alone."""
    from megatron.core.post_training.modelopt.layers import Linear
    from megatron.core.transformer import multi_latent_attention

    from megatron_pdm.compat import patch_mla_without_te

    monkeypatch.setattr(multi_latent_attention, "Linear", None)
    patch_mla_without_te()
    assert multi_latent_attention.Linear is Linear and multi_latent_attention.HAVE_TE is False
    sentinel = type("Bound", (), {})
    monkeypatch.setattr(multi_latent_attention, "Linear", sentinel)
    patch_mla_without_te()
    assert multi_latent_attention.Linear is sentinel


def test_mla_without_q_compression_keeps_the_specs_q_projection():
    """Kimi-K2's layout (q_lora_rank None, qk_layernorm for the kv latent): megatron-core 0.17+'s QKNormConfigResolver
    replaced the spec's plain `linear_q_proj` by a fused norm + linear (a norm HF's q_proj does not have; none
    exists without TE) and refused a q norm without q compression; with `patch_mla_q_projection` our local spec's
    q projection is built, and the kv side resolves as before."""
    pytest.importorskip("megatron.core.transformer.mla_qk_norm_config",
                        reason="this megatron-core (0.16) builds the spec as written: no resolver")
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.mla_qk_norm_config import QKNormConfigResolver

    from megatron_pdm.compat import patch_mla_q_projection
    from megatron_pdm.models import ModelConfig
    from megatron_pdm.models.gpt import RMSNorm, _local_spec, transformer_config
    from megatron_pdm.models.parallel import ParallelConfig

    apply_cpu_patches()
    kimi = ModelConfig(model_type="deepseek_v3", vocab_size=64, hidden_size=32, num_layers=1, num_attention_heads=2,
                       num_query_groups=2, head_dim=8, ffn_hidden_size=32, num_experts=4, moe_ffn_hidden_size=16,
                       moe_router_topk=2, q_lora_rank=0, kv_lora_rank=16, qk_rope_head_dim=8, v_head_dim=8,
                       rope_theta=10000.0, max_position_embeddings=32)
    config = transformer_config(kimi, ParallelConfig())
    assert config.q_lora_rank is None and config.qk_layernorm
    sub = _local_spec(kimi, config, kimi.num_experts).submodules.self_attention.submodules  # what the builder uses
    assert sub.linear_q_proj is ColumnParallelLinear and sub.q_layernorm is IdentityOp  # no unused q norm
    patch_mla_q_projection()
    patch_mla_q_projection()  # idempotent
    resolved = QKNormConfigResolver(config, sub).resolve()
    assert resolved["linear_q_proj"] is ColumnParallelLinear and resolved["q_layernorm"] is IdentityOp
    assert resolved["linear_kv_up_proj"] is ColumnParallelLinear and resolved["kv_layernorm"] is RMSNorm


_VERSION_PROBE = """
from megatron_pdm.compat import apply_cpu_patches
apply_cpu_patches()
import megatron.core
print(megatron.core.__version__)
"""


@pytest.mark.e2e
def test_importing_megatron_starts_no_git(tmp_path):
    """megatron-core 0.17+'s package_info runs `git rev-parse` in a subprocess at import unless NO_VCS_VERSION is set
    (a process the unit tier refuses) and, in a git work tree (this repository), appends that tree's hash to
    __version__: importing it through the compat patches (patch 8) starts no git and reports the release. A `git`
    first on PATH records any call."""
    import subprocess
    import sys

    calls = tmp_path / "git-calls"
    (tmp_path / "bin").mkdir()
    git = tmp_path / "bin" / "git"
    git.write_text(f'#!/bin/sh\necho "$@" >> {calls}\necho abcdef0\n')
    git.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "NO_VCS_VERSION"}
    env["PATH"] = f"{tmp_path / 'bin'}:{env['PATH']}"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = subprocess.run([sys.executable, "-c", _VERSION_PROBE], env=env, cwd=root, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    assert not calls.exists(), calls.read_text()
    assert "+" not in run.stdout.strip(), run.stdout


def test_a_triton_only_megatron_module_is_stood_in_for_naming_itself():
    """Without Triton (hidden on a CPU, or not installed) megatron-core 0.19's pipeline schedules still import the
    MoE paged stash's Triton kernels unguarded: patch 8 imports megatron-core with a stand-in for such a module,
    whose kernels raise, naming themselves, if ever launched (a GPU feature, never configured here)."""
    from megatron_pdm.compat.cpu import _without_triton

    module = _without_triton("megatron.core.transformer.moe.ops.paged_stash")
    kernel = module.paged_stash_copy_kernel
    for launch in (lambda: kernel(1), lambda: kernel[(1,)](2)):
        with pytest.raises(RuntimeError, match=r"megatron.core.transformer.moe.ops.paged_stash.paged_stash_copy_kernel "
                                               r"is a Triton kernel, and this process has no Triton"):
            launch()
    with pytest.raises(AttributeError):
        module.__wrapped__  # noqa: B018 - dunder lookups (inspect, pickle) stay AttributeErrors
