# Minimal type stubs for torch_npu (Ascend NPU support for PyTorch), covering
# only what z3kit touches. torch_npu is an optional dependency (extra "npu")
# and is never installed where mypy runs, so these stubs stand in for it.
#
# Importing torch_npu registers the "npu" device type with torch (device
# module torch.npu, the HCCL process-group backend, torch.accelerator); z3kit
# imports it for that side effect and otherwise reaches NPU streams through
# torch.get_device_module(device).
from . import npu as npu

__version__: str
