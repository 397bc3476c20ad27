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
print(utils.HAVE_TRITON, sys.modules.get("triton") is not None)
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
