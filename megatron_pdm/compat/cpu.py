"""Patches that let megatron-core (0.16 - 0.19) run on a CPU-only torch build with the gloo backend.

megatron-core assumes a CUDA device in a handful of places. On a CPU-only build each of them raises
"Torch not compiled with CUDA enabled" (or a TypeError in gloo). The patches, all applied together by
`apply_cpu_patches()` and only when `torch.cuda.is_available()` is False:

1. device:   `torch.cuda.current_device()` returns the CPU device. Megatron passes it as `device=` when it
             allocates (GlobalMemoryBuffer, rotary inv_freq, MoE router weights and aux-loss scalars,
             all-gathers in tensor_parallel.mappings).
2. rng:      `torch.cuda.manual_seed/get_rng_state/set_rng_state` act on the CPU default generator, and
             megatron's `CudaRNGStatesTracker` is replaced by a tracker with the same contract that forks the
             CPU generator (used by `model_parallel_cuda_manual_seed`, expert init, activation recompute).
3. streams:  `torch.cuda.Stream/Event/current_stream/stream/synchronize` become in-order no-ops (the MoE
             all-to-all dispatcher creates a device-to-host side stream).
4. moe:      `moe_utils.maybe_move_tensor_to_cpu(..., as_numpy=True)` converts CPU tensors to numpy too (on a
             GPU the D2H copy does it; gloo's all_to_all_single rejects tensor split sizes), and
             `moe_utils.te_general_gemm` is defined as None when Transformer Engine is absent (the router's
             gating reads the name, which megatron only binds when TE imports: a NameError otherwise).
5. scope:    `cuda_to_cpu_scope()` (not applied globally): inside it, hard-coded `device="cuda"` placements
             run on the CPU and `Tensor.type()` reports `torch.cuda.*Tensor` names (megatron's DDP, optimizer,
             grad scaler, clip_grads and schedules hard-code "cuda" and assert on those names).

6. mla:      `multi_latent_attention.HAVE_TE` is set False when Transformer Engine does not import
             (`patch_mla_without_te`, applied by the model builder for multi-latent attention on the local spec,
             on a CPU or a GPU without TE): megatron's TE extension substitutes a MagicMock for the missing `te`,
             so MLA's guarded import succeeds, the flag says True and `isinstance(.., TELinear)` raises TypeError.
7. expert bias: `TopKRouter._apply_expert_bias` (the per-expert token counts behind the expert-bias update) ands
             the routing map [tokens, experts] with the padding mask [tokens], which fails to broadcast as soon as a
             padding mask is given (megatron-core 0.16; the trainer gives one to every MoE model). Replaced
             (`patch_expert_bias_padding`, applied by the model builder on any device) by the same count with the
             mask broadcast over experts, uncompiled (megatron's `jit_fuser` would compile it with inductor, which
             needs a C++ compiler on a CPU machine).

8. import:   megatron-core is imported with `torch.compile` as the identity (`_import_megatron_eager`, the first
             patch applied, when nothing imported megatron-core before): importing it decorates ~40 fused functions
             with `torch.compile`, which loads dynamo and inductor, 1.4 s of every process start (measured: 2.8 s
             to import megatron-core, 1.4 s without), for functions a CPU run never compiles (see 7). They run
             eagerly: the same functions. megatron's `jit_fuser`, bound to `torch.compile` during that import,
             stays the identity in the process; `torch.compile` itself is restored.

10. triton:  Triton is hidden from the process (`import triton` raises ImportError) unless its interpreter is on
             (TRITON_INTERPRET=1, as the kernel tests set it): without CUDA it cannot run, yet megatron-core imports
             it wherever it is installed (`utils`, the MLA and MoE fusions; the test extra installs it), and its
             nanobind extension, once loaded, prints about 60 lines of "nanobind: leaked ..." at every process exit
             (triton 3.9). megatron's guarded imports then say no Triton, which only its GPU kernels read.

9. ckpt queue: megatron's checkpoint writer collects its results through a `multiprocessing` Manager queue made
             with the spawn context (`filesystem_async._get_write_results_queue`): a fresh interpreter that imports
             torch to unpickle the results, ~3 s of CPU per training process at its first save (measured). On a CPU
             the Manager is made with the fork context instead (the same queue; megatron forks its writer processes
             from the same process already).

Sequence parallelism with the local (non-TE) layer spec is not a patch: `megatron_pdm.models` uses its own norm
submodule that accepts it.
"""

from __future__ import annotations

import contextlib
import os
import sys

import torch
from torch.overrides import TorchFunctionMode

_MARK = "_megatron_pdm_cpu_patched"
_CPU = torch.device("cpu")


def cpu_patches_applied() -> bool:
    return bool(getattr(torch.cuda, _MARK, False))


def apply_cpu_patches() -> bool:
    """Apply every patch once when CUDA is absent; return whether they are in effect."""
    if torch.cuda.is_available():
        return False
    if cpu_patches_applied():
        return True
    _hide_triton()
    _import_megatron_eager()
    _patch_device()
    _patch_rng()
    _patch_streams()
    _patch_moe()
    _patch_checkpoint_queue()
    setattr(torch.cuda, _MARK, True)
    return True


# 10 (first) ------------------------------------------------------------------------------------------------
def _hide_triton():
    if os.environ.get("TRITON_INTERPRET") != "1" and "triton" not in sys.modules:
        sys.modules["triton"] = None  # find_spec answers None, `import triton` raises ImportError


# 8 ---------------------------------------------------------------------------------------------------------
def _import_megatron_eager():
    if "megatron.core" in sys.modules:
        return
    compile_ = torch.compile
    torch.compile = lambda fn=None, **_: fn if fn is not None else (lambda f: f)  # both decorator forms
    try:
        import megatron.core  # noqa: F401
    finally:
        torch.compile = compile_


# 9 ---------------------------------------------------------------------------------------------------------
def _patch_checkpoint_queue():
    import multiprocessing

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    def results_queue():
        if filesystem_async._results_queue is None:
            filesystem_async._results_queue = multiprocessing.get_context("fork").Manager().Queue()
        return filesystem_async._results_queue

    filesystem_async._get_write_results_queue = results_queue


# 1 ---------------------------------------------------------------------------------------------------------
def _patch_device():
    torch.cuda.current_device = lambda: _CPU


# 2 ---------------------------------------------------------------------------------------------------------
def _patch_rng():
    # torch.manual_seed itself calls torch.cuda.manual_seed_all: keep that one a no-op, or it would recurse
    torch.cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    torch.cuda.manual_seed_all = lambda seed: None
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)

    from megatron.core.tensor_parallel import random as mrandom

    base = mrandom.CudaRNGStatesTracker

    class CpuRNGStatesTracker(base):
        """CudaRNGStatesTracker's contract (named states, distinct seeds, nested forks) on the CPU generator."""

        def add(self, name, seed):
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"cuda rng state {name} already exists")
            self._is_initialized = True
            self.seeds_.add(seed)
            saved = torch.get_rng_state()
            torch.default_generator.manual_seed(int(seed))
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(saved)

        @contextlib.contextmanager
        def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise Exception(f"cuda rng state {name} is not added")
            saved = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(saved)

    mrandom.CudaRNGStatesTracker = CpuRNGStatesTracker  # initialize_rng_tracker() instantiates this name
    if getattr(mrandom, "_CUDA_RNG_STATE_TRACKER", None) is not None and not isinstance(
        mrandom._CUDA_RNG_STATE_TRACKER, CpuRNGStatesTracker
    ):
        mrandom._CUDA_RNG_STATE_TRACKER = None
        mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = False


# 3 ---------------------------------------------------------------------------------------------------------
class _NullEvent:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        pass

    def wait(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True


class _NullStream:
    """Every stream is the one in-order CPU stream: they compare equal, waits are no-ops."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def record_event(self, event=None):
        return event if event is not None else _NullEvent()

    def __eq__(self, other):
        return isinstance(other, _NullStream)

    def __hash__(self):
        return 0


def _patch_streams():
    torch.cuda.Stream = _NullStream
    torch.cuda.Event = _NullEvent
    torch.cuda.current_stream = lambda device=None: _NullStream()
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()
    torch.cuda.synchronize = lambda device=None: None


# 4 ---------------------------------------------------------------------------------------------------------
def _patch_moe():
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None

    original = moe_utils.maybe_move_tensor_to_cpu

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy() if as_numpy else tensor
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    moe_utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


# 5 ---------------------------------------------------------------------------------------------------------
def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, str) and device.startswith("cuda")


class _CudaToCpuMode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.Tensor.cuda, torch.Tensor.pin_memory):
            return args[0]
        if _is_cuda(kwargs.get("device")):
            kwargs = dict(kwargs, device=_CPU)
        if kwargs.get("pin_memory"):
            kwargs = dict(kwargs, pin_memory=False)
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], _CPU) + tuple(args[2:])
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        return func(*args, **kwargs)


def cuda_to_cpu_scope():
    """Context in which hard-coded CUDA placement runs on the CPU: `device="cuda"`, `.cuda()`, `.to("cuda")`,
    `pin_memory=True` become CPU placements and `Tensor.type()` reports `torch.cuda.*Tensor` names, as megatron's
    DDP, optimizer, grad scaler, clip_grads and schedules expect. A scope, not a global patch: wrapping torch's
    factories globally corrupts other libraries in the process (transformers' from_pretrained then leaves
    the rotary `inv_freq` buffer uninitialised). A no-op context where CUDA is available."""
    if torch.cuda.is_available():
        return contextlib.nullcontext()
    return _CudaToCpuMode()


# 6 ---------------------------------------------------------------------------------------------------------
def patch_mla_without_te() -> None:
    """MLA's Transformer Engine flag made true to fact where TE does not import (see the module docstring, 6)."""
    try:
        import transformer_engine  # noqa: F401
    except (ImportError, RuntimeError):
        from megatron.core.transformer import multi_latent_attention

        multi_latent_attention.HAVE_TE = False


# 7 ---------------------------------------------------------------------------------------------------------
def patch_expert_bias_padding() -> None:
    """The router's expert-load count with a padding mask that broadcasts (see the module docstring, 7)."""
    from megatron.core.transformer.moe.router import TopKRouter

    if getattr(TopKRouter._apply_expert_bias, "_megatron_pdm", False):
        return

    def _apply_expert_bias(self, routing_map, padding_mask=None):
        # counted only in passes that will update the model (not old log-probs, evaluation or a recompute's first
        # forward), as megatron does; padding tokens (mask True) count for no expert
        if self.enable_expert_bias and torch.is_grad_enabled():
            with torch.no_grad():
                if padding_mask is not None:
                    routing_map = routing_map & ~padding_mask.reshape(-1, 1)
                self.local_tokens_per_expert += routing_map.sum(dim=0)

    _apply_expert_bias._megatron_pdm = True
    TopKRouter._apply_expert_bias = _apply_expert_bias
