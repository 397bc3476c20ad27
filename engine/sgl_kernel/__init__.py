"""A stand-in for `sgl_kernel` in the CPU engine environment (`make engine-env-cpu`), which no registry wheel
provides with its CPU ops (sgl-kernel's wheels hold CUDA builds only; its CPU build needs the git repository and
hours of AVX-512 compilation). SGLang 0.5.23's CPU mode imports `sgl_kernel` unconditionally, but with
`--attention-backend torch_native` and without AMX kernels (`torch.ops.sgl_kernel` has none) every layer takes its
`forward_native` branch, so no name imported from here is ever called. Every name is a function that raises
NotImplementedError naming itself: a call fails loudly, and the test tier (tests/test_sglang_real.py) fails a
server whose log shows one."""


def __getattr__(name: str):
    if name.startswith("__"):  # dunders (__path__, __version__, ...) are not kernels: the import machinery asks
        raise AttributeError(name)

    def missing(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name}: the stand-in in engine/sgl_kernel has no kernels (SGLang's "
                                  "torch-native CPU path should never call one)")

    missing.__name__ = missing.__qualname__ = name
    return missing
