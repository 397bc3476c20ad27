"""What the gloo pools' forkserver imports once (tests/distributed.py), so that every forked worker starts with it:
torch, megatron-core (imported the way a CPU run imports it, `apply_cpu_patches`), the trainer and the models, and
what a training run imports on first use (transformers' tokenizers, torch's dynamo, which Adam's constructor loads,
matplotlib for the run's plot, tensorboard): measured, those first uses were ~45% of a pool worker's time in the
checkpoint tests, paid again by every fresh pool. Then everything is frozen (`gc.freeze`, inherited by the forks):
the full collections a worker runs (after every call, in `destroy_parallel`, at megatron's checkpoint saves) scan
only what the tests made (0.23 s each otherwise, measured: ~460K objects of imported modules)."""

import gc

import matplotlib
import torch
import torch._dynamo  # noqa: F401
import torch.distributed  # noqa: F401
import torch.utils.tensorboard  # noqa: F401

from megatron_pdm.compat import apply_cpu_patches

apply_cpu_patches()
matplotlib.use("Agg")

import matplotlib.pyplot  # noqa: E402, F401
import megatron.core.optimizer  # noqa: E402, F401
import rich.progress  # noqa: E402, F401
from transformers import AutoTokenizer, PreTrainedTokenizerFast  # noqa: E402, F401

import megatron_pdm.models  # noqa: E402, F401
import megatron_pdm.train.trainer  # noqa: E402, F401

gc.collect()  # no garbage frozen with the rest
gc.freeze()
