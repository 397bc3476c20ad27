"""Patches that let megatron-core (0.16 - 0.19) run on a CPU-only torch build with the gloo backend.

megatron-core assumes a CUDA device in a handful of places. On a CPU-only build each of them raises
"Torch not compiled with CUDA enabled" (or a TypeError in gloo). The patches, all applied together by
`apply_cpu_patches()` and only when `torch.cuda.is_available()` is False:

1. device:   `torch.cuda.current_device()` returns the CPU device. Megatron passes it as `device=` when it
             allocates (GlobalMemoryBuffer, rotary inv_freq, MoE router weights and aux-loss scalars,
             all-gathers in tensor_parallel.mappings).
2. rng:      `torch.cuda.manual_seed/get_rng_state/set_rng_state` act on the CPU default generator, and
             megatron's `CudaRNGStatesTracker` is replaced by a tracker with the same contract that forks the
             CPU generator (used by `model_parallel_cuda_manual_seed`, expert init, activation recompute), and
             megatron's `_get_cuda_rng_state` / `_set_cuda_rng_state` (saved and restored around each recomputed
             forward) read and set the CPU generator.
3. streams:  `torch.cuda.Stream/Event/current_stream/stream/synchronize` become in-order no-ops (the MoE
             all-to-all dispatcher creates a device-to-host side stream).
4. moe:      `moe_utils.maybe_move_tensor_to_cpu(..., as_numpy=True)` converts CPU tensors to numpy too (on a
             GPU the D2H copy does it; gloo's all_to_all_single rejects tensor split sizes), and
             `moe_utils.te_general_gemm` is defined as None when Transformer Engine is absent (the router's
             gating reads the name, which megatron only binds when TE imports: a NameError otherwise).
5. scope:    `cuda_to_cpu_scope()` (not applied globally): inside it, hard-coded `device="cuda"` placements
             run on the CPU and `Tensor.type()` reports `torch.cuda.*Tensor` names (megatron's DDP, optimizer,
             grad scaler, clip_grads and schedules hard-code "cuda" and assert on those names).

6. mla:      where Transformer Engine does not import (`patch_mla_without_te`, applied by the model builder for
             multi-latent attention on the local spec, on a CPU or a GPU without TE), MLA's TE names made true to
             fact: `multi_latent_attention.HAVE_TE` is set False (0.16: megatron's TE extension substitutes a
             MagicMock for the missing `te`, so MLA's guarded import succeeds, the flag says True and
             `isinstance(.., TELinear)` raises TypeError), and its `Linear` is modelopt's where it is None (0.17+
             bind every name of that import to None without TE, modelopt's `Linear` too, which MLASelfAttention's
             whitelist then refuses as our replicated q / kv down-projections). Each half acts only where the
             installed module needs it. And wherever MLA is built (`patch_mla_q_projection`, TE or not): without
             query compression (q_lora_rank None: Kimi-K2) a spec's plain `linear_q_proj` is built as given, as
             0.16 does and as HF's `q_proj` is (no norm of its own); 0.17+'s QKNormConfigResolver replaced it by the
             backend's fused norm + linear whenever qk_layernorm is on (a norm HF's layout lacks; without TE none
             exists and the build fails). A no-op where the resolver does not exist.
7. expert bias: `TopKRouter._apply_expert_bias` (the per-expert token counts behind the expert-bias update) ands
             the routing map [tokens, experts] with the padding mask [tokens], which fails to broadcast as soon as a
             padding mask is given (megatron-core 0.16 to 0.19; the trainer gives one to every MoE model). Replaced
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
             (triton 3.9). megatron's guarded imports then say no Triton, which only its GPU kernels read. A
             megatron module that imports Triton unguarded on the way of `import megatron.core` (0.19: the MoE paged
             stash's kernels, imported by the pipeline schedules), which would make megatron-core unimportable
             without Triton, is stood in for while megatron-core is imported (`_import_megatron_eager`): each of its
             names raises if used, naming the module (its kernels run only on a GPU).

9. ckpt queue: megatron's checkpoint writer collects its results through a `multiprocessing` Manager queue made
             with the spawn context (`filesystem_async._get_write_results_queue`): a fresh interpreter that imports
             torch to unpickle the results, ~3 s of CPU per training process at its first save (measured). On a CPU
             the Manager is made with the fork context instead (the same queue; megatron forks its writer processes
             from the same process already).

11. low-precision GEMMs: `lowp_gemm_scope(dtype)` (not applied globally): inside it, the matrix products of bf16 / fp16
             CPU tensors run in float32 on the exact low-precision inputs and are rounded once to bf16 / fp16: what a
             native GEMM with float32 accumulation returns, up to summation order. Without a native GEMM, torch's bf16
             product runs at a fraction of float32 (measured with oneDNN limited to AVX2, [512, 576] x [576, 1536], mm:
             25 against 105 GFLOP/s on one thread, 0.6 against 14 on two of a busy machine; the emulation 105), fp16
             likewise on every CPU without AVX512-FP16 / AMX-FP16. A TorchDispatchMode on the dispatcher's GEMMs (`mm`,
             `addmm`, `_addmm_activation`, `bmm`, `baddbmm`, `addbmm`, `mv`, `addmv`), which `matmul`, `@`, `F.linear`,
             `einsum` and `tensordot` decompose into: megatron's local linear layers (a custom autograd Function, whose
             backward a TorchFunctionMode does not see), its core attention's `baddbmm` / `bmm`, the MoE experts and
             router, MLA's einsums, the transformers layers of the embedded engine (its attention then eager products:
             SDPA's fused CPU kernel is no GEMM the mode sees), our output layer. Below autograd: the graph records the
             low- precision product (its saved tensors stay bf16 / fp16) and the backward's products are emulated the
             same way. Entered where compute runs (the trainer's forward / backward, the analysis's forward, the
             embedded engine's generation, so also `serve`) for a dtype the CPU has no native GEMM for.
             The decision (`lowp_gemm_emulated`) is deterministic, never a timed probe: a run
             is bitwise reproducible on one host. Native iff the CPU flags (/proc/cpuinfo) have avx512_bf16 or
             amx_bf16 (fp16: avx512_fp16 or amx_fp16) and oneDNN may use them (ONEDNN_MAX_CPU_ISA, where set, allows
             AVX512_CORE_BF16, resp. AVX512_CORE_FP16); MEGATRON_PDM_CPU_LOWP_GEMM=native or emulated overrides it
             (default auto; an environment variable, so that the ranks, engines and `serve` processes started from
             one process decide alike). Cost per product: a float32 copy of each operand (4 bytes an element, a
             weight's included, freed after the product; the engine keeps its weights' copies for the whole
             generation, `cache_weights`), the float32 GEMM, one rounding pass; and, while the scope is open, every
             aten operation dispatched through Python (~4 us each: 541 of them in a forward + backward of the
             SmolLM2-width model, 5,314 in a 16-token generation of 64 rows, 0.1 and 0.4% of their time in float32):
             the scope is a null context for float32, for native dtypes and under CUDA.

Sequence parallelism with the local (non-TE) layer spec is not a patch: `megatron_pdm.models` uses its own norm
submodule that accepts it.
"""

from __future__ import annotations

import contextlib
import os
import sys

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

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
    lowp_gemm_emulated(torch.bfloat16)  # a bad MEGATRON_PDM_CPU_LOWP_GEMM fails at model build, before any compute
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
    # 0.17+: package_info otherwise runs `git rev-parse` in a subprocess at import (a fork + exec in every process
    # start, refused in the unit tier) and, inside any git work tree, appends that tree's hash to __version__
    os.environ.setdefault("NO_VCS_VERSION", "1")
    compile_ = torch.compile
    torch.compile = lambda fn=None, **_: fn if fn is not None else (lambda f: f)  # both decorator forms
    try:
        for _ in range(16):  # each pass stands in for one more Triton-only module (10); the modules that failed
            try:  # were dropped from sys.modules by the import system, those complete are kept
                import megatron.core  # noqa: F401
                break
            except ModuleNotFoundError as e:
                if e.name != "triton":
                    raise
                name = _importer_of(e)
                sys.modules[name] = _without_triton(name)
    finally:
        torch.compile = compile_


def _importer_of(error: BaseException) -> str:
    """The megatron module whose own code raised `error` (the last megatron frame of its traceback)."""
    tb, name = error.__traceback__, None
    while tb is not None:
        module = tb.tb_frame.f_globals.get("__name__", "")
        name = module if module.startswith("megatron.") else name
        tb = tb.tb_next
    if name is None:
        raise error
    return name


class _TritonKernel:
    def __init__(self, name: str):
        self.name = name

    def _refuse(self, *args, **kwargs):
        raise RuntimeError(f"{self.name} is a Triton kernel, and this process has no Triton (not installed, or "
                           "hidden on a CPU: compat patch 10)")

    __call__ = __getitem__ = _refuse


def _without_triton(name: str):
    """A stand-in for megatron's Triton-kernel module `name` (see the module docstring, 10): every name it is asked
    for is a `_TritonKernel` that raises when launched."""
    import types

    module = types.ModuleType(name, f"stand-in for {name}: Triton kernels, which need a GPU")

    def __getattr__(attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _TritonKernel(f"{name}.{attr}")

    module.__getattr__ = __getattr__
    return module


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
    # activation recompute saves and restores the "CUDA" generator around each recomputed forward (through
    # torch.cuda.random.get_rng_state, and a torch.cuda._lazy_call that a CPU build queues forever): the CPU one
    mrandom._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)
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
    # vocab_parallel.core's row blocks (float32 on the logits' device, no "cuda" placement) run alike outside it
    float_block_transparent = True

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
    """MLA's Transformer Engine names made true to fact where TE does not import (see the module docstring, 6)."""
    try:
        import transformer_engine  # noqa: F401
    except (ImportError, RuntimeError):
        from megatron.core.post_training.modelopt.layers import Linear
        from megatron.core.transformer import multi_latent_attention

        multi_latent_attention.HAVE_TE = False
        if multi_latent_attention.Linear is None:
            multi_latent_attention.Linear = Linear


def patch_mla_q_projection() -> None:
    """A spec's plain q projection built as given without query compression (see the module docstring, 6)."""
    try:
        from megatron.core.transformer.mla_qk_norm_config import QKNormConfigResolver
    except ImportError:
        return  # megatron builds the spec as written
    original = QKNormConfigResolver._mla_fused_linear_or_default
    if getattr(original, "_megatron_pdm", False):
        return

    def _mla_fused_linear_or_default(self, module_spec, module_name):
        if module_name == "linear_q_proj" and module_spec is not None and not self._is_fused_norm_linear(module_spec):
            return module_spec
        return original(self, module_spec, module_name)

    _mla_fused_linear_or_default._megatron_pdm = True
    QKNormConfigResolver._mla_fused_linear_or_default = _mla_fused_linear_or_default


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


# 11 --------------------------------------------------------------------------------------------------------
LOWP_GEMM_ENV = "MEGATRON_PDM_CPU_LOWP_GEMM"
LOWP_GEMM_CHOICES = ("auto", "native", "emulated")
# oneDNN's ISA names (ONEDNN_MAX_CPU_ISA) as the bit sets of its dnnl_cpu_isa_t: an ISA allows another iff its bits
# hold the other's (the order is partial: AVX2_VNNI_2 is below neither AVX512_CORE nor above it). None: no limit
ONEDNN_ISAS = {"SSE41": 0x1, "AVX": 0x3, "AVX2": 0x7, "AVX2_VNNI": 0xF, "AVX2_VNNI_2": 0x1F, "AVX512_CORE": 0x27,
               "AVX512_CORE_VNNI": 0x67, "AVX512_CORE_BF16": 0xE7, "AVX10_1_512": 0x1EF, "AVX512_CORE_FP16": 0x1EF,
               "AVX10_1_512_AMX": 0xFEF, "AVX512_CORE_AMX": 0xFEF, "AVX10_1_512_AMX_FP16": 0x1FEF,
               "AVX512_CORE_AMX_FP16": 0x1FEF, "AVX10_2": 0x201FF, "AVX10_2_512": 0x201FF, "AVX10_2_AMX_2": 0x22FFF,
               "AVX10_2_512_AMX_2": 0x22FFF, "DEFAULT": None, "ALL": None}
# low dtype -> (the CPU flags of a native GEMM, the oneDNN ISA that uses them)
_LOWP_NATIVE = {torch.bfloat16: (("avx512_bf16", "amx_bf16"), "AVX512_CORE_BF16"),
                torch.float16: (("avx512_fp16", "amx_fp16"), "AVX512_CORE_FP16")}
_aten = torch.ops.aten
# the dispatcher's GEMMs, which matmul, @, F.linear, einsum and tensordot decompose into, in the forward and in
# autograd's backward alike
_GEMMS = frozenset({_aten.mm.default, _aten.addmm.default, _aten._addmm_activation.default, _aten.bmm.default,
                    _aten.baddbmm.default, _aten.addbmm.default, _aten.mv.default, _aten.addmv.default})


def cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The feature flags of the first processor of a /proc/cpuinfo text (x86 Linux: every core has the same);
    empty without a flags line."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def _host_cpuinfo() -> str:
    """/proc/cpuinfo up to its first flags line (the whole file is ~1.5 kB a core); empty where there is none."""
    lines = []
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                lines.append(line)
                if line.startswith("flags"):
                    break
    except OSError:
        pass
    return "".join(lines)


def lowp_gemm_native(dtype: torch.dtype, flags: frozenset[str], max_isa: str | None) -> bool:
    """Whether this CPU multiplies `dtype` (bf16, fp16) natively: it has the instructions (`flags`, as `cpu_flags`
    reads them) and oneDNN may use them (`max_isa`: ONEDNN_MAX_CPU_ISA, None where unset). An unknown ISA name is
    an error (oneDNN would ignore it, and no guess is made)."""
    needs, isa = _LOWP_NATIVE[dtype]
    if max_isa is not None and max_isa.upper() not in ONEDNN_ISAS:
        raise ValueError(f"ONEDNN_MAX_CPU_ISA: {max_isa!r} is not a oneDNN ISA name (one of "
                         f"{', '.join(ONEDNN_ISAS)}); or set {LOWP_GEMM_ENV}=native or emulated")
    limit = None if max_isa is None else ONEDNN_ISAS[max_isa.upper()]
    allowed = limit is None or limit & ONEDNN_ISAS[isa] == ONEDNN_ISAS[isa]
    return allowed and any(f in flags for f in needs)


def lowp_gemm_choice(environ=None) -> str:
    """MEGATRON_PDM_CPU_LOWP_GEMM of `environ` (default os.environ): auto (the default), native or emulated; a
    clear error for any other value."""
    value = (os.environ if environ is None else environ).get(LOWP_GEMM_ENV, "auto")
    if value not in LOWP_GEMM_CHOICES:
        raise ValueError(f"{LOWP_GEMM_ENV}: {value!r} is not one of {', '.join(LOWP_GEMM_CHOICES)}")
    return value


def lowp_gemm_emulated(dtype: torch.dtype, *, environ=None, cpuinfo: str | None = None) -> bool:
    """Whether `lowp_gemm_scope` emulates `dtype`'s CPU GEMMs here: a low dtype, no CUDA, and the override
    (`lowp_gemm_choice`) or else the CPU (`lowp_gemm_native` of `cpuinfo`, default this host's, and of
    ONEDNN_MAX_CPU_ISA) says it has no native GEMM."""
    if dtype not in _LOWP_NATIVE or torch.cuda.is_available():
        return False
    environ = os.environ if environ is None else environ
    choice = lowp_gemm_choice(environ)
    if choice != "auto":
        return choice == "emulated"
    flags = cpu_flags(_host_cpuinfo() if cpuinfo is None else cpuinfo)
    return not lowp_gemm_native(dtype, flags, environ.get("ONEDNN_MAX_CPU_ISA"))


def _lowp_dtype(values, dtype: torch.dtype) -> bool:
    """Whether the tensors among `values` are all CPU tensors of `dtype`, at least one."""
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    return bool(tensors) and all(t.dtype == dtype and t.device.type == "cpu" for t in tensors)


class _LowpGemmMode(TorchDispatchMode):
    # vocab_parallel.core's row blocks compute in float32 / float64, whose products this mode passes through
    float_block_transparent = True

    def __init__(self, dtype: torch.dtype, *, cache_weights: bool = False):
        super().__init__()
        self.dtype = dtype
        self.weights = {} if cache_weights else None  # id(weight) -> (weight, its _version, its float32 copy)

    def _float(self, v):
        """v in float32 where it is a tensor: with the weight cache, a weight's (a contiguous leaf that requires
        grad, or a view of one: `w.t()`) float32 copy made at its first use in the scope, or again after an in-place
        change (_version); a view of the weight is taken as the same view of that copy."""
        if not isinstance(v, torch.Tensor):
            return v
        base = v if v._base is None else v._base
        if self.weights is None or not (base.is_leaf and base.requires_grad and base.is_contiguous()):
            return v.float()
        entry = self.weights.get(id(base))
        if entry is None or entry[1] != base._version:
            entry = self.weights[id(base)] = (base, base._version, base.float())
        return entry[2].as_strided(v.shape, v.stride(), v.storage_offset() - base.storage_offset())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _GEMMS and _lowp_dtype((*args, *kwargs.values()), self.dtype):
            if func is _aten.baddbmm.default and kwargs.get("beta", 1) == 0:
                # its input is not read (megatron's attention passes an uninitialised buffer): no float32 copy of it
                args = (torch.zeros((), dtype=torch.float32, device=args[0].device), *args[1:])
            args, kwargs = [self._float(v) for v in args], {k: self._float(v) for k, v in kwargs.items()}
            return func(*args, **kwargs).to(self.dtype)
        return func(*args, **kwargs)


def lowp_gemm_scope(dtype: torch.dtype, *, cache_weights: bool = False):
    """Context in which the CPU matrix products of `dtype` tensors are computed in float32 and rounded to `dtype`
    (see the module docstring, 11) where this CPU has no native `dtype` GEMM (`lowp_gemm_emulated`); a null context
    otherwise (float32, a native dtype, CUDA). cache_weights: each weight's float32 copy is made once in the scope
    (held until it ends: the model's size in float32) instead of at every product, for a scope in which weights
    change only in place if at all (the engine's generation: a decode step's products have few rows, and converting
    SmolLM2's 49,152 x 576 output weight took as long as its product with 64 rows, ~0.1 s on one thread); not for
    the trainer, whose optimizer rewrites the weights through megatron's parameter buffers, which leaves each
    parameter's _version unchanged. Under torch.inference_mode the cache is empty (its tensors are not leaves that
    require grad): use torch.no_grad, as the engine does."""
    if not lowp_gemm_emulated(dtype):
        return contextlib.nullcontext()
    return _LowpGemmMode(dtype, cache_weights=cache_weights)
