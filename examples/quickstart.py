"""The README's API example: one training step of a 2-stage GPT with TeraPipe on CPU.

    torchrun --nproc-per-node 2 examples/quickstart.py
"""

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.transformer_config import TransformerConfig

import megatron_terapipe as mt

mt.enable_cpu_mode()                                   # CPU + gloo; skip this on GPUs
dist.init_process_group("gloo")
parallel_state.initialize_model_parallel(tensor_model_parallel_size=1,
                                         pipeline_model_parallel_size=2)
torch.manual_seed(0)

config = TransformerConfig(num_layers=4, hidden_size=64, num_attention_heads=4,
                           use_cpu_initialization=True, pipeline_dtype=torch.float32)
model = GPTModel(config, mt.get_gpt_layer_spec(), vocab_size=128, max_sequence_length=64,
                 pre_process=parallel_state.is_pipeline_first_stage(),
                 post_process=parallel_state.is_pipeline_last_stage())

plan = mt.TeraPipePlan(seq_slices=[24, 16, 16, 8], order="1f1b")   # token slices, sum = 64
mt.configure(config, plan)


def forward_step(data_iterator, model):             # an ordinary Megatron forward_step
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])

    def loss_func(output_tensor):
        loss = output_tensor.float().sum()
        return loss, torch.tensor(output_tensor.numel()), {"lm loss": loss.detach()}

    return output, loss_func


tokens = torch.randint(0, 128, (4, 2, 65))             # 4 microbatches of 2 rows
data = iter({"tokens": t[:, :-1], "labels": t[:, 1:],
             "position_ids": torch.arange(64).expand(2, 64)} for t in tokens)

mt.install()                                           # Megatron's getter now returns TeraPipe
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402

losses = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=data,
                                     model=[model], num_microbatches=4, seq_length=64,
                                     micro_batch_size=2)
if parallel_state.is_pipeline_last_stage():
    print("summed token loss per microbatch:", [round(float(x["lm loss"]), 2) for x in losses])
