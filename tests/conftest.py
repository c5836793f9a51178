import os

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

# Without a CUDA GPU the Triton kernels run in Triton's interpreter, which must be chosen before
# anything imports triton: DeepSpeed and torch import it as soon as it is installed, so a test module
# that sets it itself comes too late once another test has imported deepspeed.
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
