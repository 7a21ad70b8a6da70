"""Run in a fresh interpreter by test_liger_alias.py: transformers' Trainer with use_liger_kernel=True after
install_as_liger_kernel() patches the model with Tigon; uninstall leaves no alias behind. Prints one JSON line."""

import json
import sys

import torch
import transformers

import tigon.compat.liger as tigon_liger
from tests.hf._tiny import tiny_model
from tigon.modules import RMSNorm

tigon_liger.install_as_liger_kernel()
import liger_kernel.transformers  # noqa: E402
from transformers.utils.import_utils import is_liger_kernel_available  # noqa: E402

available = is_liger_kernel_available()
resolved = liger_kernel.transformers._apply_liger_kernel_to_instance is tigon_liger._apply_liger_kernel_to_instance
from liger_kernel.transformers.monkey_patch import apply_liger_kernel_to_llama  # noqa: E402

model = tiny_model("llama")
data = [{"input_ids": torch.arange(1, 9), "labels": torch.arange(1, 9)}] * 2
args = transformers.TrainingArguments(output_dir=sys.argv[1], max_steps=1, per_device_train_batch_size=1,
                                      report_to=[], save_strategy="no", use_cpu=True, use_liger_kernel=True,
                                      dataloader_num_workers=0)
trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
trainer.train()
patched = isinstance(trainer.model.model.norm, RMSNorm)
tigon_liger.uninstall_as_liger_kernel()
print(json.dumps({"available": available, "resolved": resolved, "patched": patched,
                  "monkey_patch": apply_liger_kernel_to_llama is tigon_liger.apply_liger_kernel_to_llama,
                  "left": sorted(n for n in sys.modules if n.startswith("liger_kernel")),
                  "available_after": is_liger_kernel_available(),
                  "loss": trainer.state.log_history[-1].get("train_loss")}))
